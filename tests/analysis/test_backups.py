"""Heads that stand in for others (storylens.effects.backups): the gains and the repair against losses taken
by hand with pre-hooks (float64, tiny seeded GPT-2, GPT-Neo, grouped-KV Llama and the native model), and a
model built by hand with a known backup, which must rank first."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tiny_lms import KINDS, loss_off, tiny_lm

from storylens.core.heads import Head
from storylens.effects.backups import backup_effects, top_heads
from storylens.effects.exact import exact_head_effects
from storylens.lm import NativeLM, load_lm

WORDS = (30, 22, 30, 14)


@pytest.fixture(scope="module", params=KINDS)
def lm(request, shipped_model, tmp_path_factory):
    return tiny_lm(request.param, shipped_model, tmp_path_factory.mktemp(request.param))


def test_gains_and_repair_equal_the_losses_taken_by_hand(lm, corpus_split):
    """gain(h) = [L(K + h) - L(K)] - [L(h) - L({})] and repair = sum_k [L(k) - L({})] - [L(K) - L({})], each
    summed over stories and divided by their predicted tokens: the same float64 sums, batched otherwise,
    round far under 1e-9."""
    ids = [lm.encode(" ".join(s.split()[:n])) for s, n in zip(corpus_split.quiz, WORDS)]
    removed = [Head(0, 1), Head(lm.n_layer - 1, 2)]
    got = backup_effects(lm, ids, removed, ("zero",), batch_size=4)
    result, cols = got.result("zero"), got.columns("zero")
    tokens = sum(len(s) - 1 for s in ids)
    K = [(h.layer, h.head) for h in removed]
    base = {tuple(s): (loss_off(lm, s, []), loss_off(lm, s, K)) for s in ids}
    for h in [Head(0, 0), Head(lm.n_layer - 1, 3)]:
        total = 0.0
        for s in ids:
            clean, without = base[tuple(s)]
            total += (loss_off(lm, s, [*K, h]) - without) - (loss_off(lm, s, [h]) - clean)
        assert abs(cols["backup_gain"][h].item() - total / tokens) <= 1e-9, h.label
    separate = sum(loss_off(lm, s, [k]) - base[tuple(s)][0] for s in ids for k in K)
    joint = sum(without - clean for clean, without in base.values())
    assert abs(result.joint.nats - joint / tokens) <= 1e-9
    assert abs(result.repair.nats - (separate - joint) / tokens) <= 1e-9
    assert torch.isnan(cols["backup_gain"][removed[0]])  # already off: not measured
    assert result.removed == ("L1H2", f"L{lm.n_layer}H3") and len(result.gains) == lm.n_layer * lm.n_head - 2


def _backup_model(shipped_model, folder):
    """Two blocks of two heads, width 4, no layer norms, built by hand. Every token embeds as e0. Block 1's
    heads attend evenly (zero queries and keys) and read e0: head A (L1H1) writes 2 e1, head B (L1H2) writes e1.
    Block 2's MLP writes min(x, 2) on e2 (x the e1 coordinate: x - relu(x - 2), GELU at slope 50), and the
    answer token's logit is 5 e2. So with both heads x = 3 and min = 2; without A, x = 1; without B, x = 2 (no
    change: A covers it); without both, 0. B matters only once A is gone: B is A's backup."""
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    marker, vocab = tok.bos_token_id, shipped_model.tokenizer.get_vocab_size()
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=4, n_positions=64, vocab_size=vocab, bos_token_id=marker, eos_token_id=marker,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    lm = load_lm(folder, dtype=torch.float64)
    answer, s = 300, 50.0
    t = lm.module.transformer
    with torch.no_grad():
        for p in lm.module.parameters():
            p.zero_()
        t.wte.weight[:, 0] = 1.0
        attn = t.h[0].attn
        attn.c_attn.weight[0, 8] = 1.0  # A's value (head 0, its first dimension)
        attn.c_attn.weight[0, 10] = 1.0  # B's value (head 1, its first dimension)
        attn.c_proj.weight[0, 1] = 2.0  # A writes 2 e1
        attn.c_proj.weight[2, 1] = 1.0  # B writes e1
        mlp = t.h[1].mlp
        mlp.c_fc.weight[1, 0], mlp.c_fc.weight[1, 1], mlp.c_fc.bias[1] = s, s, -2 * s
        mlp.c_proj.weight[0, 2], mlp.c_proj.weight[1, 2] = 1 / s, -1 / s
        lm.module.lm_head.weight[answer, 2] = 5.0
    for block in t.h:
        block.ln_1, block.ln_2 = nn.Identity(), nn.Identity()
    t.ln_f = nn.Identity()
    return lm, marker, answer


def test_a_known_backup_ranks_first(shipped_model, tmp_path):
    lm, marker, answer = _backup_model(shipped_model, tmp_path / "backup")
    ids = [[marker, *[answer] * n] for n in (6, 9, 12, 15)]
    exact = exact_head_effects(lm, ids, ("zero",), batch_size=4).columns()["exact_zero"]
    assert exact[0, 0] > 1.0 and exact[0, 1].abs() < 1e-3  # A matters alone; B not at all while A is there
    removed = top_heads(exact, 1)
    assert removed == [Head(0, 0)]
    result = backup_effects(lm, ids, removed, ("zero",), batch_size=4).result("zero")
    (first, gain), *rest = result.gains
    assert first == "L1H2" and gain.nats > 1.0 and all(abs(g.nats) < 1e-3 for _, g in rest)
    both = backup_effects(lm, ids, [Head(0, 0), Head(0, 1)], ("zero",), batch_size=4).result("zero")
    assert both.joint.nats > both.separate.nats + 1.0  # off together costs more than apart: repair < 0
    assert both.repair.nats < 0


@pytest.mark.slow  # every head patched alone and with the two strongest, on the 20 pairs
def test_patch_backups_remove_the_strongest_and_sum_their_exact_effects(shipped_model):
    """patch --backups K on the example pairs: the K heads of largest |exact| are those patch_heads ranks so,
    what they do one at a time summed equals their exact patching effects summed (two routes to the same float32
    logits of order 10: rounding near 1e-6, asked within 1e-4), and repair is separate - joint."""
    from storylens.effects.patch_more import patch_more
    from storylens.effects.patching import EXAMPLE_PAIRS, encode_pairs, patch_heads, read_pairs

    lm = NativeLM(shipped_model)
    pairs = encode_pairs(lm, read_pairs(EXAMPLE_PAIRS), EXAMPLE_PAIRS.name)
    plain = patch_heads(lm, pairs, exact="all")
    ranked = sorted(plain.heads, key=lambda h: -abs(h.exact))
    got = patch_more(lm, pairs, exact="all", backups=2, estimator="atp")
    b = got.backups
    assert b is not None and b.removed == tuple(h.head for h in ranked[:2])
    assert abs(b.separate - sum(h.exact for h in ranked[:2])) <= 1e-4
    assert abs(b.repair - (b.separate - b.joint)) <= 1e-9
    gains = {h.head: h.backup_gain for h in got.heads}
    assert all(gains[h] is None for h in b.removed) and sum(g is not None for g in gains.values()) == 22
    assert got.estimate_spearman is not None and got.estimate_spearman == pytest.approx(got.spearman, abs=1e-6)


def test_score_backups_writes_the_gains_and_the_repair(shipped_model, corpus_split, tmp_path):
    import json

    import jsonschema

    from storylens.core.schema import schema
    from storylens.corpus.score import score_corpus
    from storylens.data.sources import open_source

    path = tmp_path / "s.txt"
    path.write_text("".join(f"{' '.join(s.split()[:40])}\n<|endoftext|>\n" for s in corpus_split.quiz[:4]))
    run = score_corpus(
        NativeLM(shipped_model), open_source(path), tmp_path / "out", exact=("zero",), backups=1, progress=False
    )
    b = run.summary.backups
    assert b is not None and b.n_stories == 4 and len(b.removed) == 1 and len(b.gains) == 23
    top = max(run.scores.heads, key=lambda h: abs(h.scores["exact_zero"]))
    assert b.removed == (top.label,)
    assert top.scores["backup_gain"] is None or top.scores["backup_gain"] != top.scores["backup_gain"]  # not measured
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    jsonschema.Draft202012Validator(schema("summary-score")).validate(summary)
    assert summary["backups"]["removed"] == [top.label]
