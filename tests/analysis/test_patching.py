"""``storylens patch``: attribution patching (AtP) and exact noising per head, checked in float64 on
tiny seeded GPT-2, GPT-Neo and Llama (grouped key/value heads) models and the shipped model, each
loaded through storylens's loader, against hooks this test writes on the models' own output
projections (a forward pre-hook on its input, where each head's output sits before it is mixed)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.cli import main
from storylens.core.errors import StorylensError, UsageError
from storylens.effects.patching import EXAMPLE_PAIRS, encode_pairs, patch_heads, read_pairs
from storylens.lm import load_lm
from storylens.model.hub import load_model

N_PAIRS = 4
# float64 with a few dozen sums of O(1) terms: rounding is ~1e-15 relative; 1e-9 leaves room for
# the different order of sums (batched vs one pair) and still catches any wrong term.
TOL = 1e-9
# transformers' LlamaRMSNorm normalises in float32 (hidden_states.to(torch.float32)) even in a float64
# model, so a Llama's activations carry float32 rounding (2^-24, about 6e-8 relative) wherever padding
# a batch moves a float64 sum's last bit: 1e-6 is about 16 such roundings.
TOL_FLOAT32_NORM = 1e-6


def _tol(lm) -> float:
    return TOL_FLOAT32_NORM if getattr(lm.module.config, "model_type", "") == "llama" else TOL


def _config(kind: str, vocab: int):
    from transformers import GPT2Config, GPTNeoConfig, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
            n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=vocab, bos_token_id=0, eos_token_id=0
        )
    if kind == "gpt_neo":
        return GPTNeoConfig(
            num_layers=2,
            num_heads=4,
            hidden_size=64,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            vocab_size=vocab,
            bos_token_id=0,
            eos_token_id=0,
        )
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        vocab_size=vocab,
        bos_token_id=0,
        eos_token_id=0,
    )


def _projections(lm):
    """The output projection of every block, found by the test from each family's own names."""
    m = lm.module
    if hasattr(m, "model") and hasattr(m.model, "layers"):  # llama
        return [layer.self_attn.o_proj for layer in m.model.layers]
    if hasattr(m, "transformer") and hasattr(m.transformer.h[0].attn, "attention"):  # gpt-neo
        return [b.attn.attention.out_proj for b in m.transformer.h]
    return [b.attn.c_proj for b in m.transformer.h]  # gpt-2 and storylens's GPT


def _logits(lm, ids):
    m = lm.module
    return m(input_ids=ids).logits if hasattr(m, "config") and hasattr(m.config, "model_type") else m(ids).logits


@pytest.fixture(scope="module")
def native():
    return load_model()


@pytest.fixture(scope="module", params=["gpt2", "gpt_neo", "llama", "native"])
def lm(request, native, tmp_path_factory):
    """A float64 model loaded through storylens's loader: a seeded tiny transformers model saved
    with storylens's tokenizer, or the shipped model."""
    if request.param == "native":
        return load_lm(dtype=torch.float64)
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = _config(request.param, native.tokenizer.get_vocab_size())
    cfg.bos_token_id = cfg.eos_token_id = tok.bos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger attention weights, so that heads differ from an even spread
        for name, p in model.named_parameters():
            if "proj" in name or "attn" in name:
                p.mul_(4.0)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_lm(str(folder), dtype=torch.float64)


@pytest.fixture(scope="module")
def pairs(lm):
    return encode_pairs(lm, read_pairs(EXAMPLE_PAIRS)[:N_PAIRS])


def _metric(lm, p, pre_hooks=None):
    handles = [proj.register_forward_pre_hook(f) for proj, f in (pre_hooks or [])]
    try:
        logits = _logits(lm, torch.tensor([p.clean_ids]))
    finally:
        for h in handles:
            h.remove()
    return logits[0, -1, p.answer_id] - logits[0, -1, p.wrong_id]


def _corrupt_inputs(lm, p) -> list[torch.Tensor]:
    """Each block's output-projection input ``[pos, n_head * d_head]`` on the corrupt text."""
    kept = {}
    projs = _projections(lm)

    def keeper(i):
        def keep(module, args):
            kept[i] = args[0][0].detach().clone()

        return keep

    handles = [proj.register_forward_pre_hook(keeper(i)) for i, proj in enumerate(projs)]
    with torch.no_grad():
        _logits(lm, torch.tensor([p.corrupt_ids]))
    for h in handles:
        h.remove()
    return [kept[i] for i in range(len(projs))]


@pytest.fixture(scope="module")
def result(lm, pairs):
    return patch_heads(lm, pairs, exact="all")


def test_atp_is_the_first_order_term_from_autograd(lm, pairs, result):
    """AtP = sum over positions of (z_corrupt - z_clean) . dmetric/dz, with z the projection's input."""
    projs, H = _projections(lm), lm.n_head
    total = torch.zeros(lm.n_layer, H, dtype=torch.float64)
    for p in pairs:
        corrupt = _corrupt_inputs(lm, p)
        clean: dict = {}

        def keeper(i, clean=clean):
            def keep(module, args):
                args[0].retain_grad()
                clean[i] = args[0]

            return keep

        m = _metric(lm, p, [(proj, keeper(i)) for i, proj in enumerate(projs)])
        m.backward()
        for i in range(lm.n_layer):
            x = clean[i][0]  # [pos, n_head * d_head] (the batch of one dropped)
            term = (corrupt[i] - x.detach()) * clean[i].grad[0]
            total[i] += term.view(term.shape[0], H, -1).sum((0, 2))
        lm.module.zero_grad(set_to_none=True)
    expected = total / len(pairs)
    got = torch.tensor([[h.atp for h in result.heads if h.layer == i] for i in range(lm.n_layer)], dtype=torch.float64)
    scale = expected.abs().max().item()
    assert scale > 1e-6  # the heads matter at all on this model
    assert (got - expected).abs().max().item() <= _tol(lm) * max(1.0, scale)


def test_exact_patching_equals_a_pre_hook(lm, pairs, result):
    """Exact = the clean run with one head's slice of the projection's input from the corrupt run."""
    projs, H = _projections(lm), lm.n_head
    corrupts = [_corrupt_inputs(lm, p) for p in pairs]
    with torch.no_grad():
        cleans = [_metric(lm, p) for p in pairs]
    heads = result.heads
    if lm.module.__class__.__name__ == "GPT":  # the shipped model: one head a block keeps the test fast
        heads = tuple(h for h in heads if h.index == h.layer % H)
    for h in heads:
        effects = []
        for p, corrupt_all, clean in zip(pairs, corrupts, cleans):
            corrupt = corrupt_all[h.layer]
            d = corrupt.shape[-1] // H

            def swap(module, args, corrupt=corrupt, d=d, head=h.index):
                x = args[0].clone()
                x[0, :, head * d : (head + 1) * d] = corrupt[:, head * d : (head + 1) * d]
                return (x,) + tuple(args[1:])

            with torch.no_grad():
                effects.append(float(_metric(lm, p, [(projs[h.layer], swap)]) - clean))
        expected = sum(effects) / len(effects)
        assert h.exact is not None
        assert abs(h.exact - expected) <= _tol(lm) * max(1.0, abs(expected)), h.head


def test_metrics_and_gap(lm, pairs, result):
    with torch.no_grad():
        clean = [float(_metric(lm, p)) for p in pairs]
    assert result.clean_metric == pytest.approx(sum(clean) / len(clean), abs=_tol(lm))
    assert result.exact_heads == lm.n_layer * lm.n_head
    gap = result.corrupt_metric - result.clean_metric
    for h in result.heads:
        assert h.gap_fraction == pytest.approx(h.exact / gap, rel=1e-12)


def test_atp_equals_exact_where_the_metric_is_linear_in_the_heads(native, tmp_path):
    """One block, its MLP switched off (zero weights) and no final norm: the logits are affine in
    the heads' outputs, so the first-order term is the whole effect."""
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = GPT2Config(
        n_layer=1,
        n_head=4,
        n_embd=32,
        n_positions=64,
        vocab_size=native.tokenizer.get_vocab_size(),
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg.bos_token_id = cfg.eos_token_id = tok.bos_token_id
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.transformer.h[0].mlp.parameters():
            p.zero_()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_lm(str(tmp_path), dtype=torch.float64)
    lm.module.transformer.ln_f = torch.nn.Identity()
    r = patch_heads(lm, encode_pairs(lm, read_pairs(EXAMPLE_PAIRS)[:N_PAIRS]), exact="all")
    scale = max(abs(h.exact) for h in r.heads)
    assert scale > 1e-6  # the heads matter at all
    for h in r.heads:
        assert abs(h.atp - h.exact) <= TOL * scale, h.head


def test_exact_top_k_follows_atp(native):
    lm = load_lm()
    pairs = encode_pairs(lm, read_pairs(EXAMPLE_PAIRS)[:2])
    r = patch_heads(lm, pairs, exact=3)
    done = [h for h in r.heads if h.exact is not None]
    assert len(done) == r.exact_heads == 3
    smallest = min(abs(h.atp) for h in done)
    assert all(abs(h.atp) <= smallest for h in r.heads if h.exact is None)


def test_unreachable_heads_are_refused(native, monkeypatch):
    """A model whose hook_z never fires: one line, not a table of zeros."""
    lm = load_lm()
    pairs = encode_pairs(lm, read_pairs(EXAMPLE_PAIRS)[:1])
    silent = torch.nn.Identity()
    monkeypatch.setattr(lm, "add_hook", lambda name, fn: silent.register_forward_pre_hook(lambda m, a: None))
    with pytest.raises(StorylensError, match="cannot be reached"):
        patch_heads(lm, pairs)


# ---------------------------------------------------------------- bad input on the command line

GOOD = {
    "clean": "Lily and Tom went to the park. Tom gave a ball to",
    "corrupt": "Sam and Ben went to the park. Max gave a ball to",
    "answer": " Lily",
    "wrong": " Tom",
}


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "no pairs"),
        (["{not json"], "pairs.jsonl:1: not JSON"),
        ([json.dumps({"clean": "a", "corrupt": "b"})], "pairs.jsonl:1: missing 'answer', 'wrong'"),
        ([json.dumps(GOOD), json.dumps({**GOOD, "corrupt": "Sam went to the park."})], "pairs.jsonl:2: clean is"),
        ([json.dumps({**GOOD, "answer": " Lily and"})], "pairs.jsonl:1: answer ' Lily and' is 2 tokens"),
        ([json.dumps({**GOOD, "wrong": " Lily"})], "pairs.jsonl:1: answer and wrong are the same token"),
    ],
)
def test_bad_pairs_one_line_nothing_written(tmp_path, capsys, lines, message):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "out"
    code = main(["patch", "--pairs", str(pairs), "--out", str(out)])
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert err.startswith("storylens: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not out.exists()


def test_bad_exact_is_a_usage_error(tmp_path, capsys):
    assert main(["patch", "--exact", "some", "--out", str(tmp_path / "o")]) == 2
    assert "--exact" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(UsageError):
        read_pairs(_write(tmp_path / "x.jsonl", "[1, 2]\n"))


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_cli_writes_csv_json_html(tmp_path, capsys):
    out = tmp_path / "out"
    pairs = _write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in read_pairs(EXAMPLE_PAIRS)[:3]))
    assert main(["patch", "--pairs", str(pairs), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "clean" in printed and "Spearman" in printed
    data = json.loads((out / "patch.json").read_text())
    assert data["pairs"] == 3 and len(data["heads"]) == 24 and data["exact_heads"] == 24
    rows = (out / "patch.csv").read_text().splitlines()
    assert rows[0].split(",")[:4] == ["head", "layer", "index", "atp"] and len(rows) == 25
    page = (out / "patch.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


@pytest.mark.slow  # a headless Chromium start (~10 s on a loaded machine)
def test_page_opens_offline_and_a_click_shows_attention(tmp_path):
    from offline_page import offline_page

    out = tmp_path / "out"
    pairs = _write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in read_pairs(EXAMPLE_PAIRS)[:2]))
    assert main(["patch", "--pairs", str(pairs), "--out", str(out), "--no-progress"]) == 0
    with offline_page(out / "patch.html") as (page, errors, requests):
        assert page.locator(".slp-grid").count() == 2  # exact and atp side by side
        assert page.locator(".slp-grid rect.cell").count() == 2 * 24
        page.locator('.slp-grid[data-key="exact"] rect.cell[data-head="L5H4"]').click()
        assert "L5H4" in page.locator("#slp-head").inner_text()
        assert page.locator(".slp-map").count() == 2  # clean and corrupt
        assert page.locator('.slp-map[data-side="corrupt"] svg').count() == 1
        assert page.locator(".sl-export button").count() == 2 * 4  # PNG and SVG on every picture
    assert errors == [] and requests == []


def test_the_summary_claims_no_sign_within_two_errors(result):
    """The printed top heads bracket every effect within two standard errors of zero (and its share of
    the gap with the exact one), and say what the brackets mean."""
    from storylens.effects.patching import summary_lines

    lines = summary_lines(result, top=len(result.heads))
    assert lines[-1].startswith("in brackets: within two standard errors")
    for h in result.heads:
        (row,) = [line for line in lines if line.startswith(f"{h.head} ")]
        assert (f"({h.atp:+.3f} ± {h.atp_se:.3f})" in row) == (abs(h.atp) <= 2 * h.atp_se)
        if h.exact is not None:
            assert (f"({h.exact:+.3f} ± {h.exact_se:.3f})" in row) == (abs(h.exact) <= 2 * h.exact_se)


def test_the_name_task_tokenises_as_required_and_the_shipped_model_does_it(shipped_model, tmp_path, capsys):
    """The default task (storylens/data/name_pairs.jsonl): each clean story introduces its main character's
    name once and its prompt ends where the name is needed again; the corrupt story changes only that name.
    Under the shipped tokenizer the two differ at exactly one token, the answer's in clean and the wrong
    one's in corrupt. The shipped model does the task: every pair's clean metric is above zero, and their
    mean beyond two standard errors; `patch` says so first, and of the indirect-object pairs it says not."""
    from storylens.effects.patching import NAME_PAIRS, NAME_PARAPHRASES, task_verdict
    from storylens.lm import NativeLM

    lm = NativeLM(shipped_model)
    texts = {}
    for source in (NAME_PAIRS, NAME_PARAPHRASES):  # the task, and its paraphrase (other stories, other names)
        pairs = encode_pairs(lm, read_pairs(source), source.name)
        assert len(pairs) >= 40 and len({(p.clean, p.corrupt) for p in pairs}) == len(pairs)
        for p in pairs:
            differ = [i for i, (a, b) in enumerate(zip(p.clean_ids, p.corrupt_ids)) if a != b]
            assert len(differ) == 1 and (p.clean_ids[differ[0]], p.corrupt_ids[differ[0]]) == (p.answer_id, p.wrong_id)
            # introduced once, needed again
            assert p.clean_ids.count(p.answer_id) == 1 and p.wrong_id not in p.clean_ids
        r = patch_heads(lm, pairs, exact=0)
        assert min(x.clean_metric for x in r.per_pair) > 0 > max(x.corrupt_metric for x in r.per_pair)
        assert r.clean_metric > 2 * r.clean_metric_se
        texts[source] = {p.clean.split(" One")[0].split(" named")[0] for p in pairs}
    assert not texts[NAME_PAIRS] & texts[NAME_PARAPHRASES]  # no story opening shared: a paraphrase
    assert task_verdict(r.clean_metric, r.clean_metric_se, r.pairs).startswith("The model does this task")
    assert task_verdict(-1.0, 0.2, 20).startswith("The model does not do this task")
    assert task_verdict(-0.7, 0.7, 20).startswith("Whether the model does this task is unclear")
    assert "not known" in task_verdict(1.0, None, 1)
    assert main(["patch", "--out", str(tmp_path / "p"), "--exact", "0", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("The model does this task: its clean metric is +")
    assert "The model does this task" in (tmp_path / "p" / "patch.html").read_text()
