"""The estimators beside the exact effect (storylens.effects.estimators), float64 on tiny seeded GPT-2, GPT-Neo,
Llama with grouped key/value heads and the native model: AtP from the head's scalar equals the gradient pass's
AtP; GradDrop's vector-Jacobian products equal dropping each block's gradient with a hook; integrated gradients
with one head on its path converge to the exact effect at the midpoint rule's rate; the audit's arithmetic."""

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tiny_lms import KINDS, head_inputs, loss_change, tiny_lm

from storylens.core.batching import pad_batch, valid_mask
from storylens.core.heads import Head
from storylens.effects.ablation import head_output_means
from storylens.effects.audit import Effect, attribution, exact_effects
from storylens.effects.estimators import (
    _kept_outputs,
    _target,
    audit_estimate,
    estimate_head_effects,
    path_slopes,
    slopes_at_zero,
)
from storylens.engine.encode import EncodedStory

WORDS = (30, 22, 30, 14)


@pytest.fixture(scope="module", params=KINDS)
def lm(request, shipped_model, tmp_path_factory):
    return tiny_lm(request.param, shipped_model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ids(lm, corpus_split):
    return [lm.encode(" ".join(s.split()[:n])) for s, n in zip(corpus_split.quiz, WORDS)]


def _batch(lm, ids):
    grid, lengths = pad_batch(ids, lm.marker_id)
    return grid, valid_mask(lengths, grid.shape[1])


def test_atp_from_the_heads_scalar_equals_the_gradient_pass(lm, ids):
    """f'(0) of z + a (mu - z) is dL/dz . (mu - z): the gradient pass's AtP (a zero leaf at hook_z, block by
    block), summed otherwise; float64 sums of a few hundred terms round far under 1e-9."""
    means = head_output_means(lm, ids, include_marker=False)
    got = estimate_head_effects(lm, ids, "atp", ("mean", "zero"), means=means, batch_size=4).columns()
    records = [EncodedStory(i, tuple(s), False, None, (), ()) for i, s in enumerate(ids)]
    cols, acc = attribution(lm, records, batch_size=4)
    assert torch.allclose(acc.z_means(), means.to(torch.float64), atol=1e-12)  # the same mean
    for mode in ("mean", "zero"):
        assert (got[f"atp_{mode}"] - cols[f"atp_{mode}"]).abs().max().item() <= 1e-9, mode


def _dropped_by_hook(lm, grid, valid, target, j):
    """AtP with block j's contribution to the residual stream cut from the gradient by a forward hook on the
    block (its output replaced by input + (output - input).detach()): the slow way, one backward per block."""
    from storylens.effects.audit import story_losses
    from storylens.effects.estimators import _mover

    block = lm.blocks()[j]

    def cut(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        h = output if torch.is_tensor(output) else output[0]
        h = x + (h - x).detach()
        return h if torch.is_tensor(output) else (h, *output[1:])

    B, L, H = grid.shape[0], lm.n_layer, lm.n_head
    alphas = [torch.zeros(B, H, dtype=lm.dtype, requires_grad=True) for _ in range(L)]
    handle = block.register_forward_hook(cut, with_kwargs=True)
    try:
        with lm.hooks([(f"blocks.{i}.attn.hook_z", _mover(alphas[i], target(i))) for i in range(L)]):
            total = story_losses(lm, grid, valid).sum()
        grads = torch.autograd.grad(total, alphas, allow_unused=True)
    finally:
        handle.remove()
    return torch.stack([torch.zeros(B, H) if g is None else g for g in grads], 1).to(torch.float64)


def test_graddrop_equals_dropping_each_blocks_gradient_with_a_hook(lm, ids):
    grid, valid = _batch(lm, ids)
    target = _target("zero", None, None)
    atp, dropped = slopes_at_zero(lm, grid, valid, target, drop=True)
    assert dropped is not None and dropped.shape == (lm.n_layer, len(ids), lm.n_layer, lm.n_head)
    for j in range(lm.n_layer):
        slow = _dropped_by_hook(lm, grid, valid, target, j)
        assert (dropped[j] - slow).abs().max().item() <= 1e-9, j
    assert (dropped[-1][:, 0] - atp[:, 0]).abs().max() > 1e-6  # the last block's path carries something


def test_integrated_gradients_of_one_head_converge_to_its_exact_effect(lm, ids):
    """One head alone on its path: the midpoint rule's error falls as 1/m^2 (from 2 to 8 steps it should fall 16-fold; asked at least 8-fold,
    and from 8 to 32 again; float64 rounding, ~1e-15 of the loss, is far below), to the exact effect."""
    grid, valid = _batch(lm, ids)
    head = Head(0, 1)
    exact = exact_effects(lm, ids, [head], ("zero",), batch_size=4)[head, "zero"].nats * sum(len(s) - 1 for s in ids)
    start = _kept_outputs(lm, grid).get(head.layer - 1)
    errors = {}
    for m in (2, 8, 32):
        points = [([head.head], (k + 0.5) / m) for k in range(m)]
        s = path_slopes(lm, grid, valid, head.layer, points, _target("zero", None, None), start)
        errors[m] = abs(float(s[:, :, head.head].mean(0).sum()) - exact)
    assert errors[8] < errors[2] / 8 and errors[32] < errors[8] / 8, errors


def test_quadratic_is_the_slope_half_way_each_head_alone(lm, ids):
    """quadratic: f'(1/2) with the head alone moved half way to zero, against a central difference of the
    loss itself with the head's slice of the output projection's input scaled by 1 - a (a pre-hook written
    here): (f(1/2 + h) - f(1/2 - h)) / 2h, h = 1e-4, off by h^2 f'''(a) / 6 (about 1e-9 times f''') and by
    rounding (1e-16 of a summed loss near 100, over h: 1e-10): within 1e-6 nats. Only where attention runs in
    float64: GPT-Neo's scores and Llama's softmax are float32 whatever the model's dtype (their eager
    attention's, which storylens keeps), and rounding of 1e-7 over h swamps a central difference there."""
    kind = (
        lm.module.config.model_type
        if hasattr(lm.module, "config") and hasattr(lm.module.config, "model_type")
        else "native"
    )
    if kind in ("gpt_neo", "llama"):
        pytest.skip(f"{kind}'s attention rounds in float32 in a float64 model: no 1e-6 central difference")
    acc = estimate_head_effects(lm, ids, "quadratic", ("zero",), batch_size=4)
    per_token = acc.columns()["quadratic_zero"]
    tokens = sum(len(s) - 1 for s in ids)
    h = 1e-4
    for layer, head in [(0, 2), (lm.n_layer - 1, 0)]:
        total = 0.0
        for story in ids:
            z = head_inputs(lm, story, layer, head)[1:]
            up, _ = loss_change(lm, story, layer, head, (0.5 - h) * z)  # a = 1/2 + h: 1 - a of z left
            down, _ = loss_change(lm, story, layer, head, (0.5 + h) * z)
            total += (up - down) / (2 * h)
        assert abs(per_token[layer, head].item() * tokens - total) <= 1e-6, (layer, head)


def test_the_audit_names_disagreements_and_what_the_top_misses():
    heads = [Head(0, h) for h in range(6)]
    exact = {h: Effect(v, 0.01) for h, v in zip(heads, [0.5, 0.4, 0.3, 0.2, 0.1, -0.3])}
    est = {h: Effect(v, 0.01) for h, v in zip(heads, [0.5, 0.4, 0.01, 0.2, 0.1, 0.3])}
    a = audit_estimate("atp", "mean", est, exact, 10, top=2)
    assert [d.head for d in a.disagree] == ["L1H6"]  # opposite signs beyond both errors
    assert a.missed is not None and a.missed.largest_missed in ("L1H3", "L1H6") and a.missed.past_it_seen == 0
    assert a.missed.could_hide == 0 and a.missed.drawn == 4
    sizes = {h: Effect(abs(e.nats), e.se) for h, e in est.items()}
    star = audit_estimate("atp*", "mean", sizes, exact, 10, top=2)  # a size: against |exact|, no sign compared
    unsigned = {h: Effect(abs(e.nats), e.se) for h, e in exact.items()}
    assert star.disagree == () and star.rho == audit_estimate("atp", "mean", sizes, unsigned, 10).rho
    sampled = audit_estimate("atp", "mean", est, exact, 10, top=2, draws=2, seed=1)
    assert sampled.missed is not None and sampled.missed.drawn == 2 and sampled.missed.could_hide <= 4


def test_atp_star_is_the_size_of_atp_where_no_later_block_reads_the_heads(lm, ids):
    """GradDrop drops each block's path in turn; where no later block reads a head (here: every block after the
    first made to add nothing, so the loss reads the first block's heads only through the residual stream),
    every dropped estimate is AtP or zero and AtP* is |AtP|; for the last block's heads this holds in any model.
    The same float64 numbers added in another order: 1e-9."""
    star = estimate_head_effects(lm, ids, "atp*", ("zero",), batch_size=4).columns()["atpstar_zero"]
    atp = estimate_head_effects(lm, ids, "atp", ("zero",), batch_size=4).columns()["atp_zero"]
    assert (star[-1] - atp[-1].abs()).abs().max().item() <= 1e-9
    later = lm.blocks()[1:]
    for block in later:  # every block after the first adds nothing: the first block's heads reach the loss directly
        block.forward = functools.partial(_passed_through, block.forward)
    try:
        star = estimate_head_effects(lm, ids, "atp*", ("zero",), batch_size=4).columns()["atpstar_zero"]
        atp = estimate_head_effects(lm, ids, "atp", ("zero",), batch_size=4).columns()["atp_zero"]
    finally:
        for block in later:
            del block.forward
    assert (star[0] - atp[0].abs()).abs().max().item() <= 1e-9
    assert atp[0].abs().max() > 0  # not vacuous: the first block's heads still move the loss


def _passed_through(forward, *args, **kwargs):
    """A block's output with its contribution removed: its input passed on, in the shape it returns."""
    out = forward(*args, **kwargs)
    x = args[0] if args else kwargs["hidden_states"]
    return x if torch.is_tensor(out) else (x, *out[1:])


def test_on_one_block_whose_only_nonlinearity_is_the_softmax_every_estimate_is_exact(shipped_model, tmp_path):
    """A one-block GPT-2 without layer norms or MLP, its metric the pairs' logit difference: the metric is linear
    in every head's output, the patched head's own softmax is the only nonlinearity, and a head's output is
    patched after it to the corrupt run's value, computed exactly. So AtP, AtP* (its size: one block, nothing to
    drop), IG and the quadratic estimate all equal exact patching (float64, sums of a few terms: 1e-9)."""
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    from storylens.effects.patch_more import patch_more
    from storylens.effects.patching import EXAMPLE_PAIRS, encode_pairs, read_pairs
    from storylens.lm import load_lm

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    marker = tok.bos_token_id
    cfg = GPT2Config(
        n_layer=1, n_head=4, n_embd=32, n_positions=128, vocab_size=shipped_model.tokenizer.get_vocab_size(),
        bos_token_id=marker, eos_token_id=marker, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_lm(tmp_path, dtype=torch.float64)
    t = lm.module.transformer
    block = t.h[0]
    block.ln_1, block.ln_2, t.ln_f = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()
    with torch.no_grad():
        for p in block.mlp.parameters():
            p.zero_()
    pairs = encode_pairs(lm, read_pairs(EXAMPLE_PAIRS)[:6], EXAMPLE_PAIRS.name)
    for estimator in ("atp", "atp*", "ig", "quadratic"):
        r = patch_more(lm, pairs, exact="all", estimator=estimator, ig_steps=1)
        for h in r.heads:
            want = abs(h.exact) if estimator == "atp*" else h.exact
            assert abs(h.estimate - want) <= 1e-9 and abs(h.atp - h.exact) <= 1e-9, (estimator, h.head)
