"""Heads watched while they form: one line of ``RUN/heads_timeline.jsonl`` per evaluation.

At every evaluation, ``storylens train`` measures the weights it would ship at that step (the
moving average when that is what the run ships, else the raw weights) on its quiz:

* ``heads``: the head table, every detector (:func:`storylens.analysis.score_heads`, the columns
  of ``storylens score``), one row per head with its label;
* ``quiz_loss``: the mean next-token loss over the quiz (nats), every predicted token weighted
  equally, and its ``quiz_perplexity``;
* ``in_context``: the mean loss at late positions minus the mean loss at early positions (Olsson
  et al. 2022's in-context learning score, fitted to a 256-token window): positions are the
  index, in ``[marker] + story``, of the token predicted, ``EARLY`` and ``LATE`` below; negative
  when later tokens are easier;
* ``induction``: the standard probe: ``[marker] + r + r`` for random token sequences ``r`` (a
  fixed seed, every ordinary token equally likely), the mean loss on ``r``'s second copy against
  its first (tokens 2.. of each copy: the first token of a copy follows nothing it followed
  before). A model that copies has a low second-copy loss; one that does not stays near
  ``ln(vocab)`` on both.

The first line, step 0, measures the initial weights before any step (``weights`` ``"initial"``):
where each score starts, so that a head formed before the first evaluation shows as formed there
(:func:`initial_entry` makes that line for a timeline recorded without one).

None of it draws on the training's random streams, so a run with its timeline trains exactly as
one without. The file is rewritten whole and atomically at each evaluation; a resumed run keeps
the entries up to its checkpoint's step and writes the later ones again.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from storylens.core.batching import length_batches, pad_batch
from storylens.core.errors import StorylensError
from storylens.core.files import MAX_RESULT_BYTES, parse_json, read_text
from storylens.core.modes import eval_mode
from storylens.core.publish import write_text_atomic
from storylens.core.schema import check_grid, check_schema, schema
from storylens.data.names import name_vocabulary
from storylens.engine.encode import BATCH_STORIES, encode_stories
from storylens.lm import NativeLM
from storylens.looking.detectors import BUILTIN_DETECTORS
from storylens.looking.induction import induction_sequences
from storylens.model.gpt import GPT
from storylens.table.scores import score_heads

TIMELINE_FILE = "heads_timeline.jsonl"
EARLY = (16, 31)  # predicted positions, inclusive: past the stories' formulaic openings
LATE = (112, 127)  # ... and late in the story: 92% of the quiz stories reach position 128
INDUCTION_LENGTH = 64  # tokens in each random sequence (twice that, plus the marker, fits a 256 window)
INDUCTION_SEQUENCES = 32
INDUCTION_SEED = 0
IGNORE = -1

Forward = Callable[[torch.Tensor], torch.Tensor]  # ids [batch, tokens] -> logits [batch, tokens, vocab]


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 for the loss; float32 and float64 as they are."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


@dataclass(frozen=True)
class PositionLosses:
    """Next-token loss summed per predicted position (float64) and how many tokens each sum holds."""

    sums: torch.Tensor  # [window]
    counts: torch.Tensor  # [window]

    def mean(self, first: int = 1, last: int | None = None) -> float | None:
        """Mean loss over predicted positions ``first..last`` (inclusive); None where none is reached."""
        last = len(self.sums) - 1 if last is None else last
        n = self.counts[first : last + 1].sum()
        return None if n == 0 else float(self.sums[first : last + 1].sum() / n)


@torch.inference_mode()
def position_losses(
    forward: Forward, stories_ids: Sequence[Sequence[int]], *, window: int, pad_id: int, batch_size: int = 16
) -> PositionLosses:
    """The next-token loss of every story (``[marker] + tokens``, within ``window``) by the
    position of the token predicted (1 .. window - 1), summed in float64."""
    sums = torch.zeros(window, dtype=torch.float64)
    counts = torch.zeros(window, dtype=torch.long)
    for idx in length_batches([len(s) for s in stories_ids], batch_size):
        chunk = [stories_ids[i] for i in idx]
        if max(len(s) for s in chunk) < 2:
            continue
        x, _ = pad_batch([s[:-1] for s in chunk], pad_id)
        logits = forward(x)
        y, _ = pad_batch([s[1:] for s in chunk], IGNORE, logits.device)
        loss = F.cross_entropy(
            _at_least_float32(logits).transpose(1, 2), y, ignore_index=IGNORE, reduction="none"
        )  # [b, t]
        valid = y >= 0
        T = y.shape[1]
        sums[1 : T + 1] += (loss.double() * valid).sum(0).cpu()
        counts[1 : T + 1] += valid.sum(0).cpu()
    return PositionLosses(sums, counts)


def in_context_score(losses: PositionLosses, early: tuple[int, int] = EARLY, late: tuple[int, int] = LATE) -> dict:
    """Late minus early mean loss (None when the stories reach no late position)."""
    e, lt = losses.mean(*early), losses.mean(*late)
    return {
        "early": list(early),
        "late": list(late),
        "early_loss": e,
        "late_loss": lt,
        "score": None if e is None or lt is None else lt - e,
        "late_tokens": int(losses.counts[late[0] : late[1] + 1].sum()),
    }


@torch.inference_mode()
def induction_test(forward: Forward, sequences: torch.Tensor, *, batch_size: int = 16) -> dict:
    """Mean loss on each copy's tokens 2.. (``length - 1`` per copy per sequence)."""
    length = (sequences.shape[1] - 1) // 2
    first = second = 0.0
    for i in range(0, len(sequences), batch_size):
        ids = sequences[i : i + batch_size]
        logits = forward(ids[:, :-1])
        loss = F.cross_entropy(
            _at_least_float32(logits).transpose(1, 2), ids[:, 1:], reduction="none"
        ).double()  # [b, t]
        # loss[:, t] predicts token t + 1; the first copy is tokens 1..length, the second length+1..2*length
        first += float(loss[:, 1:length].sum())
        second += float(loss[:, length + 1 : 2 * length].sum())
    n = len(sequences) * (length - 1)
    return {
        "length": length,
        "sequences": len(sequences),
        "first_copy_loss": first / n,
        "second_copy_loss": second / n,
        "score": first / n - second / n,
    }


def measure(model: GPT, tokenizer, quiz: Sequence[str], *, batch_size: int = 16) -> dict:
    """Everything a timeline entry holds about ``model`` (in evaluation mode inside). The head table
    is scored in ``storylens score``'s batches (``BATCH_STORIES``), so the two give the same numbers."""
    lm = NativeLM(model, tokenizer)
    with eval_mode(model):
        encoded = encode_stories(lm, quiz, name_vocabulary(quiz))
        scores = score_heads(lm, encoded, batch_size=BATCH_STORIES, detectors=BUILTIN_DETECTORS, progress=False)

        def forward(ids: torch.Tensor) -> torch.Tensor:
            logits = model(ids).logits
            assert logits is not None
            return logits

        losses = position_losses(
            forward, [e.ids for e in encoded], window=lm.window, pad_id=lm.marker_id, batch_size=batch_size
        )
        special = [lm.marker_id] + [int(t) for t in tokenizer.get_added_tokens_decoder()]
        length = min(INDUCTION_LENGTH, (lm.window - 1) // 2)  # both copies and the marker in the window
        sequences = induction_sequences(
            lm.vocab_size, special, length=length, n=INDUCTION_SEQUENCES, seed=INDUCTION_SEED, marker=lm.marker_id
        )
        induction = induction_test(forward, sequences, batch_size=batch_size)
    quiz_loss = losses.mean()
    if quiz_loss is None:
        raise StorylensError("quiz: no token to predict")
    return {
        "quiz_loss": quiz_loss,
        "quiz_perplexity": math.exp(quiz_loss),
        "in_context": in_context_score(losses),
        "induction": induction,
        "counts": scores.counts(),
        "heads": scores.to_rows(),
    }


def timeline_entry(step: int, tokens: int, weights: str, model: GPT, tokenizer, quiz: Sequence[str]) -> dict:
    """One evaluation's line: ``step``, ``tokens`` seen, which ``weights`` (``ema`` or ``raw``),
    the measures, and the seconds they took."""
    t = time.perf_counter()
    entry = {"step": step, "tokens": tokens, "weights": weights, **measure(model, tokenizer, quiz)}
    entry["seconds"] = round(time.perf_counter() - t, 3)
    return entry


def initial_entry(config, seed: int, tokenizer, quiz: Sequence[str]) -> dict:
    """The step-0 line of a run made with ``config`` (a :class:`~storylens.model.gpt.GPTConfig`)
    and ``seed``: its initial weights (``torch.manual_seed(seed)``, then the model, as
    ``storylens train`` makes them), measured before any step, ``weights`` ``"initial"``. For a
    timeline recorded without one; the global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return timeline_entry(0, 0, "initial", model, tokenizer, quiz)


def read_timeline(path: str | Path) -> list[dict]:
    """The entries of a timeline file, in order (one JSON object per line)."""
    path = Path(path)
    if path.is_dir():
        path = path / TIMELINE_FILE
    entries: list[dict] = []
    try:
        lines = read_text(path, MAX_RESULT_BYTES).splitlines()
    except FileNotFoundError:
        raise StorylensError(f"{path}: no head timeline here (storylens train writes one)") from None
    entry_schema = schema("timeline-entry")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            entry = parse_json(line)
        except ValueError as e:
            raise StorylensError(f"{where}: not a timeline entry ({e})") from None
        try:
            check_schema(entry, entry_schema, where)
        except StorylensError as e:
            raise StorylensError(
                str(e).replace("not a valid storylens heads_timeline.jsonl entry", "not a timeline entry")
            ) from None
        rows = entry["heads"]
        check_grid([(r["label"], r["block"], r["head"]) for r in rows], max(r["block"] for r in rows),
                   max(r["head"] for r in rows), where, base=1)  # fmt: skip
        if entries and entry["step"] < entries[-1]["step"]:
            raise StorylensError(f"{where}: step {entry['step']} after step {entries[-1]['step']}: not in order")
        entries.append(entry)
    return entries


def write_timeline(path: Path, entries: Sequence[dict]) -> None:
    """The whole file, atomically (a kill leaves the old one)."""
    write_text_atomic(path, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries))


# ---------------------------------------------------------------- reading a timeline


def evaluations(entries: Sequence[dict]) -> list[dict]:
    """The entries after training began: the step-0 line (the initial weights) left out."""
    return [e for e in entries if e["step"] > 0]


def induction_step(entries: Sequence[dict]) -> dict | None:
    """Where induction appears: the evaluation after the largest rise of the induction score
    (first-copy minus second-copy loss) between two evaluations. The initial weights' line is not
    one: from it every score moves at once, as the model first learns anything. None with fewer
    than two evaluations."""
    entries = evaluations(entries)
    if len(entries) < 2:
        return None
    rises = [(b["induction"]["score"] - a["induction"]["score"], b) for a, b in zip(entries, entries[1:])]
    rise, at = max(rises, key=lambda r: r[0])
    return {"step": at["step"], "tokens": at["tokens"], "rise": rise}


def loss_bumps(entries: Sequence[dict]) -> list[dict]:
    """Every evaluation whose quiz loss is higher than the evaluation before (a bump in the loss)."""
    entries = evaluations(entries)
    return [
        {"step": b["step"], "tokens": b["tokens"], "rise": b["quiz_loss"] - a["quiz_loss"]}
        for a, b in zip(entries, entries[1:])
        if b["quiz_loss"] > a["quiz_loss"]
    ]


def formation(entries: Sequence[dict], column: str) -> dict | None:
    """When and where a kind of head forms: the head with the highest ``column`` at the last
    evaluation, its block (from 1), and the first evaluation at which its score is at least half
    way from its first value to its highest (the midpoint crossing of its rise). A head whose
    score never rose above the first evaluation's formed by then (``at_first``): the timeline
    cannot say how much earlier."""
    if not entries:
        return None
    rows = [h for h in entries[-1]["heads"] if isinstance(h.get(column), (int, float))]
    if not rows:
        return None
    best = max(rows, key=lambda h: h[column])
    values = [next(h[column] for h in e["heads"] if h["label"] == best["label"]) for e in entries]
    peak = max(range(len(values)), key=lambda i: values[i])  # the first evaluation at the highest score
    half = values[0] + (values[peak] - values[0]) / 2
    at = next(e for e, v in zip(entries, values) if v >= half)
    return {
        "head": best["label"],
        "block": best["block"],
        "first": values[0],
        "peak": values[peak],
        "peak_step": entries[peak]["step"],
        "last": values[-1],
        "half_way_step": at["step"],
        "half_way_tokens": at["tokens"],
        "at_first": at is entries[0],
    }
