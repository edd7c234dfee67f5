"""What explaining heads costs beside the scoring pass: query-key attribution (``storylens why``) and the
write-aware scores (``storylens writes``), each over the same quiz stories as one ``score_heads`` pass, timed side
by side in one process.

    python benchmarks/bench_why.py --json benchmarks/why.json [--stories 200] [--llama-stories 20]

On the shipped Tiny Storyteller (its quiz's first ``--stories`` stories) and a seeded random Llama of the 30 x 9-head
shape (``bench_record.build``; ``--llama-stories``):

* ``score``: :func:`storylens.table.scores.score_heads` (the recording pass every head's columns come from), timed
  first after a warm-up, the comparator;
* ``why``: :func:`storylens.looking.why.explain` for one head in the last block (the most writers) on the name
  pairs, and on the previous-token pairs: its time over the scoring pass's;
* ``writes``: :func:`storylens.effects.writes.write_scores` (every head at once): its time over the scoring pass's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_perf import _cpu  # noqa: E402
from bench_record import build  # noqa: E402

from storylens.core.heads import Head  # noqa: E402
from storylens.data.names import name_vocabulary  # noqa: E402
from storylens.data.stories import load_split  # noqa: E402
from storylens.effects.writes import write_scores  # noqa: E402
from storylens.engine.encode import encode_stories  # noqa: E402
from storylens.lm import load_lm  # noqa: E402
from storylens.looking.why import explain  # noqa: E402
from storylens.table.scores import score_heads  # noqa: E402


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(lm, n: int, name: str) -> dict:
    quiz = load_split().quiz
    texts = list(quiz[:n])
    stories = encode_stories(lm, texts, name_vocabulary(quiz))
    score_heads(lm, stories[:2], progress=False)  # warm-up
    score = _timed(lambda: score_heads(lm, stories, progress=False))
    head = Head(lm.n_layer - 1, 0)
    out = {"model": name, "stories": n, "heads": lm.n_layer * lm.n_head, "score_s": round(score, 3)}
    for positions in ("name", "prev"):
        t = _timed(lambda positions=positions: explain(lm, head, stories, positions))
        out[f"why_{positions}_s"] = round(t, 3)
        out[f"why_{positions}_x_score"] = round(t / score, 2)
    t = _timed(lambda: write_scores(lm, stories))
    out["writes_s"], out["writes_x_score"] = round(t, 3), round(t / score, 2)
    out["head"] = head.label
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--stories", type=int, default=200)
    ap.add_argument("--llama-stories", type=int, default=20)
    args = ap.parse_args()
    rows = [bench(load_lm(None), args.stories, "Tiny Storyteller (shipped)")]
    with tempfile.TemporaryDirectory() as tmp:
        llama = load_lm(build("llama-30x9", Path(tmp)))
        rows.append(bench(llama, args.llama_stories, "Llama 30 x 9, seeded random (bench_record.build)"))
    doc = {
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    for r in rows:
        print(
            f"{r['model']}: {r['stories']} stories; score {r['score_s']:.1f} s; why {r['head']} name "
            f"{r['why_name_x_score']}x, prev {r['why_prev_x_score']}x; writes (every head) {r['writes_x_score']}x"
        )
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
