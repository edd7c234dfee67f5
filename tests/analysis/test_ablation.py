"""Switching heads off through the hook point blocks.{l}.attn.hook_z: exactly the chosen heads change,
and nothing stays changed."""

import pytest
import torch

from storylens.core.errors import StorylensError
from storylens.effects.ablation import (
    Condition,
    ablate_heads,
    ablation_loss_table,
    ablation_losses,
    first_difference,
    generation_divergence,
    head_output_means,
)
from storylens.engine.encode import mention_first_tokens
from storylens.lesson.checks import rounding_bound
from storylens.lm import wrap
from storylens.table.name_ablation import name_ablation_table


@pytest.fixture(scope="module")
def model(shipped_model):
    return shipped_model


@pytest.fixture(scope="module")
def lm(model):
    """The wrapped model the internal helpers take (the public entry points wrap it themselves)."""
    return wrap(model)


@pytest.fixture(scope="module")
def small_ids(quiz_ids):
    """A few quiz stories, shortened: enough to exercise padding and batching, cheaply."""
    return [quiz_ids[0][:40], quiz_ids[1][:25], quiz_ids[2][:33]]


def padded(stories):
    T = max(len(s) for s in stories)
    x = torch.zeros(len(stories), T, dtype=torch.long)
    for i, s in enumerate(stories):
        x[i, : len(s)] = torch.tensor(s)
    return x


class Reader:
    """A reading hook on every block's hook_z: keeps a copy of what each block's c_proj receives,
    ``[batch, query, head, head_size]``. Hooks run in the order they were added."""

    def __init__(self, model):
        self.model, self.seen = model, {}

    def __enter__(self):
        points = self.model.hook_points()
        self.handles = [
            points[f"blocks.{i}.attn.hook_z"].register_forward_hook(self.keep(i))
            for i in range(self.model.config.n_layer)
        ]
        return self

    def keep(self, layer):
        def hook(module, inputs, z):
            self.seen[layer] = z.clone()

        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def no_hooks(model) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@torch.inference_mode()
def capture(model, x):
    with Reader(model) as r:
        model(x)
    return r.seen


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_only_the_ablated_head_changes(model, small_ids, mode):
    x = padded(small_ids)
    means = head_output_means(model, small_ids) if mode == "mean" else None
    before = capture(model, x)
    with ablate_heads(model, [(2, 1)], mode, means), Reader(model) as r, torch.inference_mode():
        model(x)  # L3H2 off; the reader, added after, sees what c_proj gets
    after = r.seen
    for b in (0, 1):  # earlier blocks: bit-identical
        assert torch.equal(before[b], after[b])
    for h in (0, 2, 3):  # the other heads of that block: bit-identical
        assert torch.equal(before[2][:, :, h], after[2][:, :, h])
    expected = torch.zeros_like(after[2][:, :, 1]) if mode == "zero" else means[2, 1].expand_as(after[2][:, :, 1])
    assert torch.equal(after[2][:, :, 1], expected)
    assert not torch.equal(before[2][:, :, 1], after[2][:, :, 1])
    assert not torch.equal(before[3], after[3])  # and later blocks feel it


def test_zeroing_a_whole_block_leaves_its_c_proj_bias(model, small_ids):
    x = padded(small_ids)
    attn = model.transformer.h[3].attn
    got = {}

    def keep(mod, inp, out):
        got["out"] = out[0].clone()  # returns None: the output is left as it is

    handle = attn.register_forward_hook(keep)
    try:
        with torch.inference_mode(), ablate_heads(model, [(3, h) for h in range(model.config.n_head)]):
            model(x)
    finally:
        handle.remove()
    out = got["out"]
    assert torch.equal(out, attn.c_proj.bias.expand_as(out))


def test_exit_restores_hooks_and_logits(model, small_ids):
    x = padded(small_ids)
    with torch.inference_mode():
        ref = model(x).logits
    point = model.hook_points()["blocks.1.attn.hook_z"]
    mine = point.register_forward_hook(lambda m, i, z: None)  # a hook already in place must survive
    try:
        with torch.inference_mode():
            with ablate_heads(model, ["L2H1", "L5H3", (5, 3)], "zero"):
                assert len(point._forward_hooks) == 2
                changed = model(x).logits
            assert not torch.equal(ref, changed)
            assert list(point._forward_hooks) == [mine.id]
            assert torch.equal(model(x).logits, ref)
            with pytest.raises(RuntimeError):  # an exception inside removes them too
                with ablate_heads(model, [(1, 0)]):
                    raise RuntimeError("boom")
            assert list(point._forward_hooks) == [mine.id]
    finally:
        mine.remove()
    assert no_hooks(model)
    with torch.inference_mode():
        assert torch.equal(model(x).logits, ref)


def test_bad_arguments(model):
    with pytest.raises(StorylensError):
        with ablate_heads(model, [(6, 0)]):
            pass
    with pytest.raises(StorylensError):
        with ablate_heads(model, [(0, 0)], mode="mean"):  # no means
            pass
    with pytest.raises(StorylensError):
        with ablate_heads(model, [(0, 0)], mode="half"):
            pass
    assert no_hooks(model)


def test_head_means_ignore_padding(model, small_ids):
    together = head_output_means(model, small_ids, batch_size=8)
    one_by_one = head_output_means(model, small_ids, batch_size=1)
    assert together.shape == (model.config.n_layer, model.config.n_head, model.config.head_size)
    tol = rounding_bound(model.config, torch.float32, together.abs().max().item())  # storylens.lesson.checks
    assert (together - one_by_one).abs().max().item() <= tol
    seen = capture(model, torch.tensor([small_ids[1]]))
    assert (head_output_means(model, [small_ids[1]])[4] - seen[4][0].mean(0)).abs().max().item() <= tol


def test_table_losses_match_a_direct_computation(model, lm, small_ids):
    starts = [[5, 30], [], [12]]  # pretend name starts
    table = ablation_loss_table(lm, small_ids, starts, heads=["L5H3", "L1H1"], groups=[["L5H3", "L4H4"]], batch_size=2)
    assert [(r.label, r.mode) for r in table.rows] == [
        ("L1H1", "zero"),
        ("L1H1", "mean"),
        ("L5H3", "zero"),
        ("L5H3", "mean"),
        ("L5H3+L4H4", "zero"),
        ("L5H3+L4H4", "mean"),
    ]
    assert table.n_name_positions == 3
    assert table.n_other_positions == sum(len(s) - 1 for s in small_ids) - 3

    def direct(ctx):
        name, other = [], []
        with torch.inference_mode(), ctx:
            for s, st in zip(small_ids, starts):
                logits = model(torch.tensor([s])).logits[0, :-1]
                ce = torch.nn.functional.cross_entropy(logits, torch.tensor(s[1:]), reduction="none")
                for t in range(len(s) - 1):
                    (name if t + 1 in st else other).append(ce[t])
        return torch.stack(name).mean().item(), torch.stack(other).mean().item()

    import contextlib

    # a cross-entropy moves by at most twice its logits' change; logits stay below 25 (20.6 on the quiz)
    LOSS_TOL = 2 * rounding_bound(model.config, torch.float32, 25.0)
    assert (table.baseline_name_loss, table.baseline_other_loss) == pytest.approx(
        direct(contextlib.nullcontext()), abs=LOSS_TOL
    )
    r = table.row("L5H3", "zero")
    assert (r.name_loss, r.other_loss) == pytest.approx(direct(ablate_heads(model, [(4, 2)])), abs=LOSS_TOL)
    assert r.name_increase == pytest.approx(r.name_loss - table.baseline_name_loss)
    means = head_output_means(model, small_ids)
    g = table.row("L5H3+L4H4", "mean")
    assert (g.name_loss, g.other_loss) == pytest.approx(
        direct(ablate_heads(model, [(4, 2), (3, 3)], "mean", means)), abs=LOSS_TOL
    )
    text = table.format()
    assert "L5H3+L4H4" in text and "baseline loss" in text


def test_losses_reject_bad_name_starts(lm, small_ids):
    with pytest.raises(StorylensError):
        ablation_losses(lm, small_ids, [[0], [], []], [Condition("L1H1", ((0, 0),), "zero")])
    with pytest.raises(StorylensError):
        ablation_losses(lm, small_ids, [[], []], [])


def test_mention_first_tokens():
    # "Lily and Lily": tokens "Li" "ly" " and" " Lily"
    offsets = [(0, 2), (2, 4), (4, 8), (8, 13)]
    assert mention_first_tokens(offsets, [(0, 4), (9, 13)]) == [1, 4]
    assert mention_first_tokens(offsets, [(0, 4), (9, 13)], window=4) == [1]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_generation_divergence(model):
    prompt = "Once upon a time, there was a little girl named Lily."
    same = generation_divergence(model, prompt, [], seed=3, max_new_tokens=12)
    assert same.same and same.baseline_ids == same.ablated_ids
    gen = torch.Generator().manual_seed(3)
    from storylens.model.tokenizer import encode_story, eot_id

    idx = torch.tensor([encode_story(model.tokenizer, prompt).ids])
    plain = [s.token for s in model.generate_stream(idx, 12, generator=gen, eos_id=eot_id(model.tokenizer))]
    assert list(same.baseline_ids) == plain

    every = [(b, h) for b in range(model.config.n_layer) for h in range(model.config.n_head)]
    d = generation_divergence(model, prompt, every, seed=3, max_new_tokens=12, temperature=0)
    assert d.baseline_ids[: d.first_difference or 0] == d.ablated_ids[: d.first_difference or 0]
    if d.first_difference is not None:
        i = d.first_difference
        assert i == len(d.baseline_ids) or i == len(d.ablated_ids) or d.baseline_ids[i] != d.ablated_ids[i]
    assert no_hooks(model)
    assert "first difference" in d.format()
    with pytest.raises(StorylensError):
        generation_divergence(model, prompt, [(0, 0)], max_new_tokens=10_000)


def test_name_ablation_table_on_quiz_stories(model, corpus_split):
    from storylens.data.names import find_main_characters

    stories = corpus_split.quiz[:6]
    table = name_ablation_table(model, stories, heads=["L5H3"], name_heads=["L5H3", "L4H4"], modes=("zero",))
    assert [(r.label, r.mode) for r in table.rows] == [("L5H3", "zero"), ("L5H3+L4H4", "zero")]
    mains = find_main_characters(model.tokenizer, stories)
    with_main = [m for m in mains if m is not None and m.positions]
    assert table.n_stories == len(with_main)
    # a mention's first token starts a run of name positions (mentions are never adjacent here)
    runs = sum(sum(1 for i, p in enumerate(m.positions) if i == 0 or m.positions[i - 1] != p - 1) for m in with_main)
    assert table.n_name_positions == runs
    assert table.n_name_positions + table.n_other_positions == sum(
        min(len(model.tokenizer.encode(s).ids) + 1, model.config.block_size) - 1
        for s, m in zip(stories, mains)
        if m is not None and m.positions
    )
