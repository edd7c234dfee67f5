"""Any causal LM: storylens's scores on real transformers classes (GPT-2, GPT-Neo with its local
attention, Llama with rotary positions and grouped key/value heads), each equal to the same score
computed directly from transformers' own ``output_attentions``, story by story, in float64."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.analysis import score_heads
from storylens.core.heads import Head
from storylens.data.names import main_character, name_vocabulary
from storylens.effects.ablation import ablate_heads
from storylens.lesson.inputs import lesson_quiz
from storylens.lm import NativeLM, TransformersLM, load_lm
from storylens.looking.example_store import PER_STORY
from storylens.model.hub import export_hf, load_model

WINDOW = 96
N_STORIES = 10


def _config(kind: str, vocab: int):
    from transformers import GPT2Config, GPTNeoConfig, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
            n_layer=2, n_head=4, n_embd=64, n_positions=WINDOW, vocab_size=vocab, bos_token_id=0, eos_token_id=0
        )
    if kind == "gpt_neo":  # one global and one local layer; the local window (8) is shorter than a story
        return GPTNeoConfig(
            num_layers=2,
            num_heads=4,
            hidden_size=64,
            max_position_embeddings=WINDOW,
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
        max_position_embeddings=WINDOW,
        vocab_size=vocab,
        bos_token_id=0,
        eos_token_id=0,
    )


@pytest.fixture(scope="module")
def native():
    return load_model()


@pytest.fixture(scope="module")
def quiz(native):
    return lesson_quiz(native)[0]


@pytest.fixture(scope="module", params=["gpt2", "gpt_neo", "llama"])
def tiny_folder(request, native, tmp_path_factory):
    """A seeded random model of one architecture, saved with storylens's tokenizer."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = _config(request.param, native.tokenizer.get_vocab_size())
    cfg.bos_token_id = cfg.eos_token_id = tok.bos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than the default init, so heads differ from an even spread
        for name, p in model.named_parameters():
            if "proj" in name or "attn" in name or "attention" in name:
                p.mul_(8.0)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- the reference, written plainly


def _reference(model, ids: list[int], marker: int, name_pos: list[int], first: int | None) -> dict:
    """Per-story means ``[layer, head]`` of every built-in detector, from ``output_attentions``."""
    with torch.no_grad():
        atts = model(torch.tensor([ids]), output_attentions=True).attentions
    return _reference_on([att[0] for att in atts], ids, marker, name_pos, first)


def _reference_on(maps: list[torch.Tensor], ids: list[int], marker: int, name_pos: list[int], first: int | None):
    """The same per-story means from any per-layer maps ``[head, q, k]``."""
    T = len(ids)
    out = {k: [] for k in ("name_mass", "prev_token", "prev_argmax", "prev4", "marker", "duplicate_token", "induction")}
    for a in maps:  # [head, q, k], float64
        H = a.shape[0]
        rows = {k: [] for k in out}
        for h in range(H):

            def mean(vals):
                return sum(vals) / len(vals) if vals else None

            qs = range(1, T)
            rows["prev_token"].append(mean([float(a[h, q, q - 1]) for q in qs]))
            rows["prev_argmax"].append(mean([float(int(a[h, q].argmax()) == q - 1) for q in qs]))
            rows["prev4"].append(mean([float(a[h, q, max(0, q - 4) : q].sum()) for q in qs]))
            rows["marker"].append(mean([sum(float(a[h, q, k]) for k in range(q + 1) if ids[k] == marker) for q in qs]))
            nq = [q for q in range(T) if first is not None and q > first and q not in name_pos]
            rows["name_mass"].append(mean([sum(float(a[h, q, k]) for k in name_pos if k <= q) for q in nq]))
            dup = {q: [k for k in range(q) if ids[k] == ids[q]] for q in range(T)}
            rows["duplicate_token"].append(mean([sum(float(a[h, q, k]) for k in ks) for q, ks in dup.items() if ks]))
            ind = {q: [k + 1 for k in ks] for q, ks in dup.items()}
            rows["induction"].append(mean([sum(float(a[h, q, k]) for k in ks) for q, ks in ind.items() if ks]))
        for k in out:
            out[k].append(rows[k])
    return out


def _story(lm, text: str, names) -> tuple[list[int], list[int], int | None]:
    """A story as the reference reads it: ``[marker] + tokens`` cut to the window, the main
    character's name positions and its first mention (None without one)."""
    enc = lm.tokenizer.encode(text, add_special_tokens=False)
    ids = ([lm.marker_id] + enc.ids)[:WINDOW]
    mc = main_character(text, enc.offsets, names, WINDOW)
    pos = list(mc.positions) if mc is not None else []
    return ids, pos, mc.first_mention if mc is not None and pos else None


def test_every_score_equals_transformers_output_attentions(tiny_folder, quiz):
    lm = load_lm(tiny_folder, dtype=torch.float64)
    assert isinstance(lm, TransformersLM) and lm.window == WINDOW and lm.n_layer == 2 and lm.n_head == 4
    stories = quiz[:N_STORIES]
    got = score_heads(lm, stories, batch_size=4, max_stories_prev=4, progress=False)

    names = name_vocabulary(stories)
    sums: dict[str, list] = {}
    for i, text in enumerate(stories):
        ids, pos, first = _story(lm, text, names)
        ref = _reference(lm.module, ids, lm.marker_id, pos, first)
        for k, grid in ref.items():
            for layer, row in enumerate(grid):
                for h, v in enumerate(row):
                    if v is not None:
                        sums.setdefault(k, {}).setdefault((layer, h), []).append(v)
                        if k in ("prev_token", "prev_argmax", "prev4") and i < 4:
                            sums.setdefault(k + "_first", {}).setdefault((layer, h), []).append(v)
    checked = 0
    for k, per_head in sums.items():
        for (layer, h), vals in per_head.items():
            want = sum(vals) / len(vals)
            have = getattr(got.at(Head(layer, h)), k)
            assert abs(have - want) <= 1e-9, (k, Head(layer, h).label, have, want)
            checked += 1
    assert checked == 10 * 2 * 4  # every column, every head
    assert got.n_name_scored > 0 and len(sums["duplicate_token"]) == 8


def test_hook_z_ablation_on_a_transformers_model(tiny_folder, quiz):
    lm = load_lm(tiny_folder)
    ids = torch.tensor([lm.encode(quiz[0])[:40]])
    base = lm.forward(ids)
    seen = {}
    with lm.hooks([("blocks.1.attn.hook_z", lambda z, hook: seen.setdefault("z", z.clone()))]):
        with ablate_heads(lm, ["L2H3"]):
            off = lm.forward(ids)
    assert not torch.equal(base, off)
    assert seen["z"].shape == (1, 40, 4, 16)  # [batch, query, head, head_size]
    assert torch.equal(lm.forward(ids), base)  # every hook gone on exit


def test_a_pass_that_reads_no_attention_is_transformers_sdpa_bit_for_bit(tiny_folder, quiz):
    from transformers import AutoModelForCausalLM

    lm = load_lm(tiny_folder)
    ids = torch.tensor([lm.encode(quiz[0])[:40], lm.encode(quiz[1])[:40]])
    with torch.inference_mode():
        if lm.attention != "eager":  # GPT-Neo does not dispatch through the attention interface
            sdpa = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="sdpa").eval()
            assert torch.equal(lm.forward(ids), sdpa(input_ids=ids, use_cache=False).logits)
        seen = []  # a pattern hook still gets the probabilities: that block takes the explicit path
        with lm.hooks([("blocks.1.attn.hook_pattern", lambda p, hook: seen.append(p.shape))]):
            lm.forward(ids)
    assert seen == [(2, 4, 40, 40)]


def test_ablations_that_skip_the_blocks_before_the_head_equal_whole_passes(tiny_folder, quiz):
    from storylens.effects.ablation import Condition, ablation_losses, head_output_means

    lm = load_lm(tiny_folder, dtype=torch.float64)
    ids = [lm.encode(t)[:WINDOW] for t in quiz[:6]]
    starts = [[5, 9], [], [3], [], [7], []]
    conds = [Condition("L2H2", (Head(1, 1),), "zero"), Condition("L2H1", (Head(1, 0),), "mean")]
    conds.append(Condition("L2H4+L1H1", (Head(1, 3), Head(0, 0)), "zero"))
    means = head_output_means(lm, ids)
    skipped = ablation_losses(lm, ids, starts, conds, means=means, batch_size=4)
    lm.blocks = lambda: None  # no block known: every condition runs every block
    whole = ablation_losses(lm, ids, starts, conds, means=means, batch_size=4)
    assert skipped[1:] == whole[1:] and skipped[0].keys() == whole[0].keys()
    for key in whole[0]:  # the same blocks on the same inputs: the same numbers
        assert torch.equal(skipped[0][key], whole[0][key]), key
    assert not torch.equal(whole[0]["L2H2/zero"], whole[0]["baseline"])


def test_export_reads_back_with_the_same_head_table(native, quiz, tmp_path):
    folder = export_hf(native, tmp_path / "hf")
    hf = load_lm(folder)
    assert isinstance(hf, TransformersLM) and (hf.n_layer, hf.n_head, hf.window) == (6, 4, 256)
    a = score_heads(NativeLM(native), quiz[:24], max_stories_prev=10, progress=False)
    b = score_heads(hf, quiz[:24], max_stories_prev=10, progress=False)
    # float32 on both sides, different kernels. Probabilities and every mean of them (every score,
    # every share) within what rounding allows for a probability; output_norm is a magnitude, so
    # the same derivation at its own scale (storylens.lesson.checks; margin for other CPUs)
    from storylens.lesson.checks import probability_bound, rounding_bound

    pairs = [(k, x, rb[k]) for ra, rb in zip(a.to_rows(), b.to_rows()) for k, x in ra.items() if isinstance(x, float)]
    assert any(k == "output_norm" for k, _, _ in pairs) and any(k == "prev_token" for k, _, _ in pairs)
    worst = max(abs(x - y) for k, x, y in pairs if k != "output_norm")
    print(f"export vs native, worst score difference {worst:.2e}")
    assert worst <= probability_bound(native.config, torch.float32), worst
    for k, x, y in pairs:
        if k == "output_norm":
            assert abs(x - y) <= rounding_bound(native.config, torch.float32, max(abs(x), abs(y))), (x, y)


def test_report_runs_on_a_transformers_folder(tiny_folder, tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(
        # every section, the lesson's too (a transformers model's default leaves it out: test_report_sections.py)
        [
            sys.executable,
            "-m",
            "storylens",
            "report",
            "--model",
            str(tiny_folder),
            "--out",
            str(out),
            "--no-progress",
            "--sections",
            "overview,widget,lesson,detectors,sinks,truth,heads",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    heads = json.loads((out / "heads.json").read_text())["heads"]
    assert [h["label"] for h in heads] == [f"L{b}H{h}" for b in (1, 2) for h in (1, 2, 3, 4)]
    assert "of 8 heads below the baseline" in r.stdout
    html = (out / "report.html").read_text()
    assert "All 8 heads" in html and "Not run for this model" in html
    # what the heads move and where they fire, on every model kind
    assert all(isinstance(h["norm_marker"], float) and 0 < h["output_share"] < 1 for h in heads)
    assert "Does attention tell the truth here?" in html
    examples = json.loads((out / "examples.json").read_text())
    assert [h["label"] for h in examples["heads"]] == [h["label"] for h in heads]
    assert all(len(h["examples"]["prev_token"]) == 8 for h in examples["heads"])


def test_report_on_the_export(native, tmp_path):
    folder = export_hf(native, tmp_path / "hf")
    out = tmp_path / "report"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "storylens",
            "report",
            "--model",
            str(folder),
            "--out",
            str(out),
            "--no-progress",
            "--sections",
            "overview,widget,lesson,detectors,sinks,truth,heads",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "of 24 heads below the baseline" in r.stdout
    assert len(json.loads((out / "heads.json").read_text())["heads"]) == 24


def test_commands_on_a_transformers_folder(tiny_folder, tmp_path):
    def run(*argv):
        r = subprocess.run(
            [sys.executable, "-m", "storylens", *argv, "--model", str(tiny_folder)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, (argv, r.stderr)
        return r.stdout

    assert run("perplexity").startswith("quiz perplexity ")
    assert run("generate", "Once upon a time", "--max-new-tokens", "5").startswith("Once upon a time")
    page = tmp_path / "replay.html"
    run("generate", "Once upon a time", "--max-new-tokens", "4", "--record", "--html", str(page))
    assert page.stat().st_size > 1000
    table = run("ablate", "--heads", "L1H2", "L2H4", "--mode", "zero")
    assert "L1H2+L2H4" in table and "first difference" in table
    r = subprocess.run(
        [sys.executable, "-m", "storylens", "check", "--model", str(tiny_folder)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1 and "storylens's own models" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- what a head moves (norm-weighted attention)


def _value_and_output(attn, kind: str, hidden: torch.Tensor, n_head: int):
    """Reference value vectors ``[T, head, d]`` (each query head's group) and ``W_O`` per head
    ``[head, d, d_model]``, read from the module's own projections, written per architecture."""
    if kind == "gpt2":
        C = hidden.shape[-1]
        v = attn.c_attn(hidden)[..., 2 * C :]  # c_attn: q | k | v
        w_o = attn.c_proj.weight  # Conv1D: y = x @ W, W [H * d, d_model]
        return v.view(-1, n_head, C // n_head), w_o.view(n_head, C // n_head, -1)
    if kind == "gpt_neo":
        self_attn = attn.attention
        v = self_attn.v_proj(hidden)
        w_o = self_attn.out_proj.weight.T  # Linear: y = x @ W.T
        return v.view(v.shape[0], n_head, -1), w_o.reshape(n_head, -1, w_o.shape[1])
    cfg = attn.config
    groups, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    v = attn.v_proj(hidden).view(-1, groups, d)
    v = torch.stack([v[:, h // (n_head // groups)] for h in range(n_head)], 1)  # head h reads group h // 2
    w_o = attn.o_proj.weight.T
    return v, w_o.reshape(n_head, d, -1)


def _attention_inputs(model, ids: list[int]):
    """Each layer's attention probabilities ``[head, q, k]`` (``output_attentions``) and the hidden
    states its attention module was handed."""
    from storylens.lm.transformers_lm import _attention_of, _decoder_layers

    seen: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(_decoder_layers(model)):
        attn = _attention_of(layer)

        def grab(module, args, kwargs, i=i):
            seen[i] = (args[0] if args else kwargs["hidden_states"])[0]

        handles.append(attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        with torch.no_grad():
            atts = model(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        for h in handles:
            h.remove()
    return [a[0] for a in atts], [seen[i] for i in range(len(atts))]


def test_norm_weighted_scores_and_output_norms_equal_the_direct_computation(tiny_folder, quiz):
    """Kobayashi et al.'s norm-weighted map w_ij = a_ij |f_j| / sum_k a_ik |f_k|, f_j = W_O^h v_j,
    computed here from transformers' own probabilities and the modules' own value and output
    projections; storylens's norm_* columns and output norms equal it in float64."""
    from storylens.lm.transformers_lm import _attention_of, _decoder_layers

    lm = load_lm(tiny_folder, dtype=torch.float64)
    kind = lm.module.config.model_type
    stories = quiz[:N_STORIES]
    got = score_heads(lm, stories, batch_size=4, progress=False, examples=3)
    names = name_vocabulary(stories)
    sums: dict[str, dict] = {}
    out_norms: dict[tuple[int, int], list[float]] = {}
    prev: dict[tuple[int, int], list[tuple[float, int, int]]] = {}  # every (value, story, query) of prev_token
    seen: list[tuple[list, list]] = []  # per story, every block's probabilities and value vectors (the sink columns)
    for i, text in enumerate(stories):
        ids, pos, first = _story(lm, text, names)
        atts, hidden = _attention_inputs(lm.module, ids)
        weighted, fs = [], []
        seen.append((atts, fs))
        for layer, (a, x) in enumerate(zip(atts, hidden)):
            attn = _attention_of(_decoder_layers(lm.module)[layer])
            with torch.no_grad():
                v, w_o = _value_and_output(attn, kind, x, lm.n_head)
                f = torch.einsum("thd,hde->hte", v, w_o)  # [head, key, d_model]
            norms = f.norm(dim=-1)  # [head, key]
            fs.append(f)
            w = a * norms[:, None, :]
            weighted.append(w / w.sum(-1, keepdim=True))
            moved = torch.einsum("hqk,hke->hqe", a, f).norm(dim=-1)  # |sum_j a_ij f_j|  [head, query]
            for h in range(lm.n_head):
                out_norms.setdefault((layer, h), []).append(float(moved[h, 1:].mean()))
                prev.setdefault((layer, h), []).extend((float(a[h, q, q - 1]), i, q) for q in range(1, len(ids)))
        for k, grid in _reference_on(weighted, ids, lm.marker_id, pos, first).items():
            for layer, row in enumerate(grid):
                for h, val in enumerate(row):
                    if val is not None:
                        sums.setdefault(k, {}).setdefault((layer, h), []).append(val)
    checked = 0
    for k, per_head in sums.items():
        for (layer, h), vals in per_head.items():
            have = getattr(got.at(Head(layer, h)), "norm_" + k)
            assert abs(have - sum(vals) / len(vals)) <= 1e-9, (k, Head(layer, h).label)
            checked += 1
    assert checked == 7 * 2 * 4
    for (layer, h), vals in out_norms.items():
        row = got.at(Head(layer, h))
        assert abs(row.output_norm - sum(vals) / len(vals)) <= 1e-9 * max(1.0, row.output_norm)
        layer_sum = sum(sum(out_norms[(layer, g)]) / len(vals) for g in range(lm.n_head))
        assert abs(row.output_share - sum(vals) / len(vals) / layer_sum) <= 1e-9
    for (layer, h), every in prev.items():  # where each head fires: the top 3, at most PER_STORY a story
        ranked = sorted(every, key=lambda e: (-e[0], e[1], e[2]))
        want = [e for i, e in enumerate(ranked) if sum(f[1] == e[1] for f in ranked[:i]) < PER_STORY][:3]
        have = got.examples.entries(layer, h, "prev_token")
        assert [(e.story, e.query) for e in have] == [(s, q) for _, s, q in want], Head(layer, h).label
        assert all(abs(e.value - w[0]) <= 1e-9 for e, w in zip(have, want))
        assert all(e.key_weight >= e.value for e in have)  # the most-attended key holds at least this share
    from sink_reference import assert_sink_columns

    assert assert_sink_columns(got, seen) == 5 * 2 * 4  # sink_rate .. active_rate, every head
    moved_most = max(abs(getattr(r, "norm_" + k) - getattr(r, k)) for r in got.heads for k in sums)
    print(f"{kind}: the norm weighting moves a score by up to {moved_most:.2e}")
    assert moved_most > 1e-6  # the weighting is not the identity here, so the comparison tests it


@pytest.mark.parametrize("family", ["native", "llama"])
def test_every_column_is_the_same_at_one_and_two_torch_threads(family, native, quiz, tmp_path):
    """A Ray actor scores on one torch thread, a process on as many as it has: every column, the
    norm-weighted ones and ``output_norm`` included (their output factor is a QR factorisation, which
    LAPACK rounds by thread count unless formed on one thread), within the float64 sums' order. At a
    width where LAPACK splits its work (the shipped model's 256; a grouped Llama of 576, SmolLM's)."""
    if family == "native":
        lm = NativeLM(native)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        cfg = LlamaConfig(
            hidden_size=576,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=WINDOW,
            vocab_size=native.tokenizer.get_vocab_size(),
        )
        torch.manual_seed(0)
        tok = PreTrainedTokenizerFast(tokenizer_object=native.tokenizer, bos_token="<|endoftext|>")
        lm = TransformersLM(LlamaForCausalLM(cfg), tok)
    stories = quiz[:N_STORIES]
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = score_heads(lm, stories, batch_size=4, progress=False).to_rows()
    finally:
        torch.set_num_threads(threads)
    assert len(got[1]) == len(got[2]) == lm.n_layer * lm.n_head
    for a, b in zip(got[1], got[2]):
        assert a.keys() == b.keys()
        for k, x in a.items():
            if isinstance(x, float):
                assert abs(x - b[k]) <= 1e-9, (a["label"], k, x, b[k])
            else:
                assert x == b[k], (k, x, b[k])
