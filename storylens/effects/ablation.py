"""Switch heads off and measure what changes: the experiment the lesson did not run.

Everything here goes through the named hook point ``blocks.{l}.attn.hook_z`` (each head's
output ``[batch, query, head, head_size]`` before the output projection, see
:mod:`storylens.lm`), with torch's own hooks: no weight is edited and no forward pass is
re-implemented, so it works on storylens's GPT and on any transformers causal LM alike.

* :func:`ablate_heads` - a context manager that replaces chosen heads' outputs by
  zeros (``mode="zero"``) or by each head's mean output vector (``mode="mean"``,
  means from :func:`head_output_means`); hooks already there keep running.
* :func:`head_output_means` - each head's mean output vector over stories.
* :func:`ablation_loss_table` - next-token loss where the next token is the first
  token of a mention of the main character's name ("name positions") and at every
  other position, without ablation and with each head (and groups of heads) off.
* :func:`~storylens.table.name_ablation.name_ablation_table` (in :mod:`storylens.table`: it picks heads from the head table) - the same over story texts, with the main character
  found by :mod:`storylens.data.names` and the top name-mass heads as the group.
* :func:`generation_divergence` - the same seed, with and without heads: where do
  the generated stories part?

Positions count the end-of-story marker as position 0. The prediction made at position ``t``
is scored against the token at ``t + 1``, so a story of ``T`` tokens has ``T - 1`` scored
positions; a name position is a ``t`` whose target ``t + 1`` is a mention's first token.
Every condition is a forward pass over the stories on the fused attention path, batched by a
token budget (:data:`~storylens.core.batching.BATCH_TOKENS`). A condition whose first switched-off head
is in block ``l`` starts at block ``l``, from what block ``l - 1`` returned in the baseline pass over
the same batch (:meth:`~storylens.lm.hooks.AttentionLM.skip_blocks`): the blocks before it compute
exactly what they computed there, so they are not run again.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from storylens.core.batching import BATCH_TOKENS, pad_batch, valid_mask
from storylens.core.errors import StorylensError
from storylens.core.heads import Head, as_heads, head_label
from storylens.core.modes import eval_mode
from storylens.core.progress import ProgressLines
from storylens.engine.encode import length_batches
from storylens.lm import AttentionLM, Hook, ModelLike, wrap

MODES = ("zero", "mean")


def normalise_heads(lm: AttentionLM, heads: Iterable[Head | str]) -> tuple[Head, ...]:
    """``[(4, 2), "L1H1"] -> (Head(0, 0), Head(4, 2))``: checked against the model, sorted, unique."""
    try:
        return as_heads(heads, lm.n_layer, lm.n_head)
    except ValueError as e:
        raise StorylensError(str(e)) from None


def group_label(heads: Sequence[Head]) -> str:
    """``((4, 2), (3, 3)) -> "L5H3+L4H4"`` (in the order given)."""
    return "+".join(head_label(b, h) for b, h in heads) if heads else "none"


def _mean_vectors(lm: AttentionLM, heads: Sequence[Head], means) -> dict[Head, torch.Tensor]:
    if means is None:
        raise StorylensError("mode 'mean' needs means (from head_output_means)")
    out = {}
    for h in heads:
        try:
            v = torch.as_tensor(means[h] if isinstance(means, Mapping) else means[h.layer, h.head])
        except (KeyError, IndexError):
            raise StorylensError(f"means: no mean output vector for {h.label}") from None
        if v.dim() != 1:
            raise StorylensError(f"means: {h.label}'s mean is {tuple(v.shape)}, expected one vector")
        out[h] = v
    return out


@dataclass(frozen=True)
class _HeadReplacer:
    """The ``hook_z`` hook of an ablation: ``z [batch, query, head, head_size]`` returned with the heads
    of ``heads[hook.layer]`` set to zero (``values`` None) or to ``values[hook.layer]``
    ``[len(heads), head_size]`` (the tensor it is given is not modified). One for every block."""

    heads: Mapping[int, Sequence[int]]
    values: Mapping[int, torch.Tensor] | None

    def __call__(self, z: torch.Tensor, hook: Hook) -> torch.Tensor:
        z = z.clone()
        idx = torch.tensor(self.heads[hook.layer], device=z.device)
        if self.values is None:
            z[:, :, idx] = 0.0
        else:
            z[:, :, idx] = self.values[hook.layer].to(device=z.device, dtype=z.dtype)[None, None]
        return z


@contextlib.contextmanager
def ablate_heads(model: ModelLike, heads: Iterable[Head | str], mode: str = "zero", means=None) -> Iterator[None]:
    """Switch ``heads`` off inside the ``with`` block, through ``blocks.{l}.attn.hook_z``.

    ``heads``: :class:`~storylens.core.heads.Head` (0-indexed) or labels like ``"L5H3"``.
    ``mode="zero"`` replaces each head's output by zeros; ``mode="mean"`` by its mean
    output vector, ``means[layer, head]`` (a ``[layer, head, head_size]`` tensor from
    :func:`head_output_means`, or a ``{Head: vector}`` mapping). Other hooks keep running;
    on exit, even by an exception, the ablation's hooks are removed.
    """
    if mode not in MODES:
        raise StorylensError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    lm = wrap(model)
    heads = normalise_heads(lm, heads)
    vectors = _mean_vectors(lm, heads, means) if mode == "mean" else None
    by_layer: dict[int, list[int]] = {}
    for h in heads:
        by_layer.setdefault(h.layer, []).append(h.head)
    values = None
    if vectors is not None:
        values = {layer: torch.stack([vectors[Head(layer, h)] for h in hs]) for layer, hs in by_layer.items()}
    replace = _HeadReplacer(by_layer, values)
    with lm.hooks([(f"blocks.{layer}.attn.hook_z", replace) for layer in by_layer]):
        yield


def _pad(stories: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, tokens]`` ids padded at the end with ``pad_id``, and ``[batch, tokens]`` real-token mask."""
    ids, lengths = pad_batch(stories, pad_id, device)
    return ids, valid_mask(lengths, ids.shape[1])


def _check_stories(lm: AttentionLM, stories_ids: Sequence[Sequence[int]]) -> None:
    if isinstance(stories_ids, (str, bytes, dict)) or not isinstance(stories_ids, Sequence):
        raise StorylensError(f"stories: a list of stories' token ids, got {type(stories_ids).__name__}")
    if not stories_ids:
        raise StorylensError("stories: nothing to run (empty list)")
    for i, s in enumerate(stories_ids):
        if isinstance(s, (str, bytes)) or not (isinstance(s, Sequence) or torch.is_tensor(s)):
            raise StorylensError(f"story {i}: token ids (a list of int), got {type(s).__name__}; encode text first")
        if not torch.is_tensor(s) and any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in s):
            raise StorylensError(f"story {i}: token ids (a list of int), not all of them int; encode text first")
        if not 1 <= len(s) <= lm.window:
            raise StorylensError(f"story {i}: {len(s)} tokens; each story needs 1..{lm.window} (cut it to the window)")


@torch.inference_mode()
def head_output_means(
    model: ModelLike, stories_ids: Sequence[Sequence[int]], *, batch_size: int = 16, include_marker: bool = True
) -> torch.Tensor:
    """Each head's mean output vector, ``[layer, head, head_size]`` (float32; float64 for a float64 model).

    The mean is over every real token position of every story (padding never counts),
    each position weighted equally; ``include_marker=False`` leaves out position 0 (the
    end-of-story marker each story opens with). Outputs are what ``hook_z`` sees (before the
    output projection), from the unablated model; sums are kept in float64.
    """
    lm = wrap(model)
    _check_stories(lm, stories_ids)
    totals: dict[int, torch.Tensor] = {}
    current: dict[str, torch.Tensor] = {}

    def add(z: torch.Tensor, hook: Hook) -> None:
        w = current["mask"].to(torch.float64)
        total = torch.einsum("bthd,bt->hd", z.to(torch.float64), w).cpu()
        totals[hook.layer] = total + totals[hook.layer] if hook.layer in totals else total

    count = 0
    with eval_mode(lm.module), lm.hooks([(f"blocks.{i}.attn.hook_z", add) for i in range(lm.n_layer)]):
        for idx in length_batches([len(s) for s in stories_ids], batch_size, BATCH_TOKENS):
            ids, valid = _pad([stories_ids[i] for i in idx], lm.marker_id, lm.device)
            if not include_marker:
                valid = valid.clone()
                valid[:, 0] = False
            current["mask"] = valid
            lm.forward(ids, logits=False)
            count += int(valid.sum())
    if count == 0:
        raise StorylensError("stories: no token positions to average over")
    return (torch.stack([totals[i] for i in range(lm.n_layer)]) / count).to(
        torch.promote_types(lm.dtype, torch.float32)
    )


@dataclass(frozen=True)
class Condition:
    label: str  # "L5H3", "L5H3+L4H4+L6H2", "baseline"
    heads: tuple[Head, ...]
    mode: str  # "zero", "mean", or "none" for the baseline


@dataclass(frozen=True)
class AblationRow:
    """One condition. Losses are mean cross-entropy (nats) over the positions pooled."""

    label: str
    mode: str
    heads: tuple[Head, ...]  # 0-indexed
    name_loss: float
    other_loss: float
    name_increase: float  # name_loss - baseline name_loss
    other_increase: float  # other_loss - baseline other_loss


@dataclass(frozen=True)
class AblationTable:
    """Baseline losses and one :class:`AblationRow` per (heads, mode)."""

    rows: tuple[AblationRow, ...]
    baseline_name_loss: float
    baseline_other_loss: float
    n_stories: int
    n_name_positions: int
    n_other_positions: int
    seconds: float  # wall time of the forward passes (means not included)

    def row(self, label: str, mode: str = "zero") -> AblationRow:
        label = label.strip().upper()
        for r in self.rows:
            if r.label == label and r.mode == mode:
                return r
        raise KeyError(f"no row {label!r} with mode {mode!r}")

    def to_rows(self) -> list[dict]:
        return [asdict(r) for r in self.rows]

    def top(self, k: int = 5, mode: str = "zero", by: str = "name_increase") -> list[AblationRow]:
        rows = [r for r in self.rows if r.mode == mode]
        return sorted(rows, key=lambda r: -getattr(r, by))[:k]

    def format(self) -> str:
        """A text table: one line per label, both modes side by side, in the order run."""
        labels: list[str] = []
        for r in self.rows:
            if r.label not in labels:
                labels.append(r.label)
        modes = [m for m in MODES if any(r.mode == m for r in self.rows)]
        w = max(8, *(len(x) for x in labels))
        head = f"{'heads':<{w}}" + "".join(f"  {'name+ ' + m:>12}  {'other+ ' + m:>12}" for m in modes)
        lines = [
            f"baseline loss: name {self.baseline_name_loss:.4f} ({self.n_name_positions} positions), "
            f"other {self.baseline_other_loss:.4f} ({self.n_other_positions} positions), "
            f"{self.n_stories} stories",
            head,
        ]
        for lab in labels:
            cells = []
            for m in modes:
                try:
                    r = self.row(lab, m)
                    cells.append(f"  {r.name_increase:>+12.4f}  {r.other_increase:>+12.4f}")
                except KeyError:
                    cells.append(f"  {'':>12}  {'':>12}")
            lines.append(f"{lab:<{w}}" + "".join(cells))
        return "\n".join(lines)


LOSS_CHUNK = 512  # rows of logits at a time: [512, vocab] stays in cache (about 2x faster on CPU)


def _losses(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at the scored positions only: ``logits [B, T, V]`` -> ``[n_scored]`` float64."""
    rows, t = logits[:, :-1][scored], targets[scored]
    return torch.cat(
        [
            F.cross_entropy(rows[i : i + LOSS_CHUNK].float(), t[i : i + LOSS_CHUNK], reduction="none")
            for i in range(0, rows.shape[0], LOSS_CHUNK)
        ]
    ).to(torch.float64)


def _name_other_sums(lm: AttentionLM, ids: torch.Tensor, scored: torch.Tensor, is_name: torch.Tensor) -> torch.Tensor:
    """``[batch, 2]`` float64 on the CPU: each story's summed name and other losses in one forward pass over ``ids``."""
    logits = lm.forward(ids)
    assert logits is not None  # logits=True
    ce = torch.zeros(scored.shape, dtype=torch.float64, device=ids.device)
    ce[scored] = _losses(logits, ids[:, 1:], scored)
    return torch.stack([(ce * is_name).sum(1), (ce * (scored & ~is_name)).sum(1)], 1).cpu()


def _name_positions(
    idx: Sequence[int],
    stories_ids: Sequence[Sequence[int]],
    name_starts: Sequence[Iterable[int]],
    T: int,
    device: torch.device,
) -> torch.Tensor:
    """``[len(idx), T - 1]`` bool: True at ``t`` where ``t + 1`` starts a mention, each start checked."""
    is_name = torch.zeros(len(idx), T - 1, dtype=torch.bool, device=device)
    for r, i in enumerate(idx):
        for p in name_starts[i]:
            if not 1 <= p < len(stories_ids[i]):
                raise StorylensError(f"story {i}: name start {p} is outside 1..{len(stories_ids[i]) - 1}")
            is_name[r, p - 1] = True
    return is_name


def ablation_losses(
    lm: AttentionLM,
    stories_ids: Sequence[Sequence[int]],
    name_starts: Sequence[Iterable[int]],
    conditions: Sequence[Condition],
    *,
    means=None,
    batch_size: int = 16,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], int, int]:
    """Summed name and other losses per condition (plus ``"baseline"``), and position counts.

    Returns ``({"baseline" | f"{label}/{mode}": tensor([name_sum, other_sum])}, n_name, n_other)``
    with float64 sums. ``name_starts[i]``: positions of story i's mention first tokens.
    """
    sums, counts = ablation_story_losses(
        lm, stories_ids, name_starts, conditions, means=means, batch_size=batch_size, progress=progress
    )
    return {k: v.sum(0) for k, v in sums.items()}, int(counts[:, 0].sum()), int(counts[:, 1].sum())


@torch.inference_mode()
def ablation_story_losses(
    lm: AttentionLM,
    stories_ids: Sequence[Sequence[int]],
    name_starts: Sequence[Iterable[int]],
    conditions: Sequence[Condition],
    *,
    means=None,
    batch_size: int = 16,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`ablation_losses` story by story, for errors over stories: ``({"baseline" | f"{label}/{mode}":
    [story, 2]}, counts [story, 2])``, each story's summed name and other losses and its number of name and
    other positions (float64, stories in the order given)."""
    _check_stories(lm, stories_ids)
    if len(name_starts) != len(stories_ids):
        raise StorylensError(f"name_starts: {len(name_starts)} entries for {len(stories_ids)} stories")
    device, S = lm.device, len(stories_ids)
    sums = {"baseline": torch.zeros(S, 2, dtype=torch.float64)}
    for c in conditions:
        sums[f"{c.label}/{c.mode}"] = torch.zeros(S, 2, dtype=torch.float64)
    counts = torch.zeros(S, 2, dtype=torch.float64)
    batches = length_batches([len(s) for s in stories_ids], batch_size, BATCH_TOKENS)
    starts = {
        c: min((h.layer for h in normalise_heads(lm, c.heads)), default=0) for c in conditions
    }  # the block each condition starts at
    carried = sorted({layer - 1 for layer in starts.values() if layer > 0})  # kept from the baseline
    bar = None
    if progress:
        bar = tqdm(total=S, unit="story", desc="ablations", disable=None)  # None: terminals only
    lines = ProgressLines("ablating heads", S, enabled=progress)  # off a terminal, instead
    with eval_mode(lm.module):
        try:
            for idx in batches:
                ids, valid = _pad([stories_ids[i] for i in idx], lm.marker_id, device)
                scored = valid[:, 1:]  # prediction at t is scored against t + 1
                is_name = _name_positions(idx, stories_ids, name_starts, ids.shape[1], device) & scored
                rows = torch.tensor(idx)
                counts[rows] = torch.stack([is_name.sum(1), (scored & ~is_name).sum(1)], 1).cpu().to(torch.float64)
                with lm.keep_block_outputs(carried) as kept:
                    sums["baseline"][rows] = _name_other_sums(lm, ids, scored, is_name)
                for c in conditions:
                    start = starts[c]
                    skip = lm.skip_blocks(start, kept[start - 1]) if start - 1 in kept else contextlib.nullcontext()
                    with skip, ablate_heads(lm, c.heads, c.mode, means):
                        sums[f"{c.label}/{c.mode}"][rows] = _name_other_sums(lm, ids, scored, is_name)
                del kept
                if bar is not None:
                    bar.update(len(idx))
                lines.update(len(idx))
        finally:
            if bar is not None:
                bar.close()
    return sums, counts


def single_head_conditions(lm: AttentionLM, modes: Sequence[str] = MODES, heads=None) -> list[Condition]:
    """One condition per head (all heads by default) and mode."""
    heads = normalise_heads(lm, heads) if heads is not None else tuple(Head.every(lm.n_layer, lm.n_head))
    return [Condition(h.label, (h,), m) for h in heads for m in modes]


def _table_conditions(
    lm: AttentionLM,
    heads: Iterable[Head | str] | None,
    groups: Sequence[Sequence[Head | str]],
    modes: Sequence[str],
) -> list[Condition]:
    """Every head alone, then each group with all its heads off, in each of ``modes`` (checked)."""
    for m in modes:
        if m not in MODES:
            raise StorylensError(f"modes: {m!r} is not one of {', '.join(MODES)}")
    conditions = single_head_conditions(lm, modes, heads)
    for g in groups:
        group = tuple(dict.fromkeys(normalise_heads(lm, [x])[0] for x in g))  # checked, order kept
        if not group:
            raise StorylensError("groups: an empty group")
        for m in modes:
            conditions.append(Condition(group_label(group), group, m))
    return conditions


def _pooled(s: torch.Tensor, n_name: int, n_other: int) -> tuple[float, float]:
    """Summed ``[name, other]`` losses -> their means over ``n_name`` and ``n_other`` positions (NaN: none)."""
    name = float(s[0] / n_name) if n_name else math.nan
    other = float(s[1] / n_other) if n_other else math.nan
    return name, other


def ablation_loss_table(
    lm: AttentionLM,
    stories_ids: Sequence[Sequence[int]],
    name_starts: Sequence[Iterable[int]],
    *,
    heads: Iterable[Head | str] | None = None,
    groups: Sequence[Sequence[Head | str]] = (),
    modes: Sequence[str] = MODES,
    means: torch.Tensor | Mapping | None = None,
    batch_size: int = 16,
    progress: bool = False,
) -> AblationTable:
    """Name-position and other-position loss, baseline and with heads off.

    ``stories_ids``: each story's ids (``[marker] + tokens``, within the window).
    ``name_starts[i]``: the positions in story i holding the first token of a mention
    of its main character (see :func:`storylens.engine.encode.mention_first_tokens`); a story with none counts
    only towards the other positions. Position ``t`` is a name position when ``t + 1``
    is a name start; every other scored position (``0 .. T-2``) is an other position.
    Losses are pooled: the mean over all positions of that kind, every position
    weighted equally.

    Conditions: every head in ``heads`` (default: all) alone, in each of ``modes``, and
    each group in ``groups`` with all its heads off together (label ``"L5H3+L4H4"``).
    ``means`` (for ``"mean"``) default to :func:`head_output_means` over the same stories.
    """
    conditions = _table_conditions(lm, heads, groups, modes)
    if "mean" in modes and means is None:
        means = head_output_means(lm, stories_ids, batch_size=batch_size)
    t0 = time.perf_counter()
    sums, n_name, n_other = ablation_losses(
        lm, stories_ids, name_starts, conditions, means=means, batch_size=batch_size, progress=progress
    )
    seconds = time.perf_counter() - t0
    base_name, base_other = _pooled(sums["baseline"], n_name, n_other)
    rows = []
    for c in conditions:
        name, other = _pooled(sums[f"{c.label}/{c.mode}"], n_name, n_other)
        rows.append(AblationRow(c.label, c.mode, c.heads, name, other, name - base_name, other - base_other))
    return AblationTable(
        rows=tuple(rows),
        baseline_name_loss=base_name,
        baseline_other_loss=base_other,
        n_stories=len(stories_ids),
        n_name_positions=n_name,
        n_other_positions=n_other,
        seconds=seconds,
    )


@dataclass(frozen=True)
class Divergence:
    """Two generations from the same prompt and seed, one with ``heads`` switched off."""

    prompt: str
    heads: tuple[Head, ...]
    mode: str
    seed: int
    first_difference: int | None  # index of the first new token that differs; None: identical
    baseline_ids: tuple[int, ...]  # new tokens only
    ablated_ids: tuple[int, ...]
    baseline_text: str  # the new tokens, decoded
    ablated_text: str

    @property
    def same(self) -> bool:
        return self.first_difference is None

    def format(self) -> str:
        where = "never (identical)" if self.same else f"at new token {self.first_difference}"
        return (
            f"prompt: {self.prompt!r}\nheads off ({self.mode}): {group_label(self.heads)}; seed {self.seed}; "
            f"first difference {where}\n--- baseline:\n{self.baseline_text}\n--- ablated:\n{self.ablated_text}"
        )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (one ending early counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def generation_divergence(
    model: ModelLike,
    prompt: str | Sequence[int],
    heads: Iterable[Head | str],
    seed: int = 0,
    max_new_tokens: int = 100,
    *,
    mode: str = "zero",
    means=None,
    temperature: float = 1.0,
    top_k: int | None = None,
    stop_at_marker: bool = True,
) -> Divergence:
    """Generate twice with KV caching (``model.generate_stream``) from ``prompt``, both with
    ``torch.Generator().manual_seed(seed)``, the second time with ``heads`` off.

    A text prompt is encoded like a story (``[marker] + tokens``). With the same seed the
    two runs draw the same random numbers, so they agree until the ablation changes a
    sampled token; after that they go their own ways. ``stop_at_marker`` ends a run at
    the end-of-story marker (it is kept as the run's last token).
    """
    lm = wrap(model)
    heads = normalise_heads(lm, heads)
    if isinstance(prompt, str):
        prompt_text = prompt
        ids = lm.encode(prompt)
    else:
        ids = [int(i) for i in prompt]
        prompt_text = lm.decode(ids)
    idx = torch.tensor([ids], dtype=torch.long, device=lm.device)
    eos = lm.marker_id if stop_at_marker else None

    def run() -> list[int]:
        gen = torch.Generator(device=idx.device).manual_seed(seed)
        steps = lm.generate_stream(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen, eos_id=eos)
        return [s.token for s in steps]

    try:
        base = run()
        with ablate_heads(lm, heads, mode, means):
            abl = run()
    except ValueError as e:  # window overflow, bad temperature, ...
        raise StorylensError(str(e)) from None
    return Divergence(
        prompt=prompt_text,
        heads=heads,
        mode=mode,
        seed=seed,
        first_difference=first_difference(base, abl),
        baseline_ids=tuple(base),
        ablated_ids=tuple(abl),
        baseline_text=lm.decode(base),
        ablated_text=lm.decode(abl),
    )
