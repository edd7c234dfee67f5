"""Copying from the training data: how much of what a model writes is its training stories verbatim.

Each model starts ``samples`` stories by itself (the prompt is the end-of-story marker alone, as a
story opens), one seed per story (``seed``, ``seed + 1``, ...; temperature 1, no top-k), up to
``tokens`` new tokens or the next marker. A story's 8-word runs are counted as the leakage check
counts them (:mod:`storylens.data.leakage`: whitespace words, case and punctuation kept, one run
per start position); the **copied share** is the fraction of all generated runs, pooled over the
samples, found in at least one training story. The same prompts, seeds and training stories for
every model, so models of different sizes compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from storylens.core.errors import StorylensError
from storylens.core.files import read_json
from storylens.data.leakage import RUN_WORDS, run_hashes, word_runs
from storylens.lm import AttentionLM

COPYING_FILE = "copying.json"  # a finished run's copied share, beside its head timeline
SAMPLES = 50  # stories generated per model
TOKENS = 200  # new tokens at most per story


def generated_stories(lm: AttentionLM, *, samples: int = SAMPLES, tokens: int = TOKENS, seed: int = 0) -> list[str]:
    """``samples`` stories the model writes from the end-of-story marker, seeds ``seed, seed + 1, ...``."""
    out = []
    with torch.inference_mode():
        for i in range(samples):
            idx = torch.tensor([[lm.marker_id]], device=lm.device)
            gen = torch.Generator(device=lm.device).manual_seed(seed + i)
            n = min(tokens, lm.window - 1)
            steps = lm.generate_stream(idx, n, temperature=1.0, generator=gen, eos_id=lm.marker_id)
            ids = [s.token for s in steps]
            if ids and ids[-1] == lm.marker_id:
                ids = ids[:-1]
            out.append(lm.decode(ids).strip())
    return out


def copied_share(stories: Sequence[str], train_runs: set[int], n: int = RUN_WORDS) -> dict:
    """The pooled share of ``stories``' ``n``-word runs found in ``train_runs`` (:func:`run_hashes`
    of the training stories), with the counts behind it."""
    found = total = 0
    per_story = []
    for text in stories:
        hashes = [hash(r) for r in word_runs(text, n)]
        hit = sum(h in train_runs for h in hashes)
        found, total = found + hit, total + len(hashes)
        if hashes:
            per_story.append(hit / len(hashes))
    return {
        "share": found / total if total else None,
        "runs": total,
        "runs_found": found,
        "stories": len(stories),
        "stories_with_runs": len(per_story),
        "max_story_share": max(per_story) if per_story else None,
        "run_words": n,
    }


def read_copying(run: str | Path) -> dict | None:
    """A run's (or a model folder's) :data:`COPYING_FILE`, None where it has none."""
    path = Path(run)
    path = path.parent / COPYING_FILE if path.is_file() else path / COPYING_FILE
    try:
        return read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StorylensError(f"{path}: unreadable ({e})") from None


def copying(
    lm: AttentionLM, train: Sequence[str], *, samples: int = SAMPLES, tokens: int = TOKENS, seed: int = 0
) -> dict:
    """:func:`copied_share` of :func:`generated_stories` against the training stories ``train``,
    with the settings that made them and the first generated story."""
    stories = generated_stories(lm, samples=samples, tokens=tokens, seed=seed)
    result = copied_share(stories, run_hashes(train))
    return {**result, "samples": samples, "tokens": tokens, "seed": seed, "prompt": "the end-of-story marker",
            "example": stories[0] if stories else ""}  # fmt: skip
