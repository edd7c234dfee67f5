"""What `storylens score` and `report` write, before and after a change to the engine room.

    python scripts/engine_outputs.py run OUT      # score and report: shipped model, tiny GPT-2 and Llama
    python scripts/engine_outputs.py compare A B  # every column of A's outputs against B's

``run`` writes, under OUT, one folder per (model, command): the shipped Tiny Storyteller on its 200
quiz stories, and seeded random GPT-2 and Llama (grouped key/value heads) models, saved with the
shipped tokenizer, on the first 60 quiz stories. ``compare`` reads heads.json, examples.json and
summary.json of each and prints the largest difference of every numeric column, the columns or
keys the second lacks (and those it adds), and exits 1 if any number differs by more than ``--tol``
(default 1e-7) or a column of the first is missing. Timings, and paths that differ only in their folder,
are not compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

N_TINY = 60
TINY_KINDS = ("gpt2", "llama")


def _tiny_model(kind: str, folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

    from storylens.model.hub import load_model

    native = load_model()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=native.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    vocab = native.tokenizer.get_vocab_size()
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=3, n_head=4, n_embd=64, n_positions=256, vocab_size=vocab)
    else:
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            vocab_size=vocab,
        )
    cfg.bos_token_id = cfg.eos_token_id = tok.bos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than the default init, so heads differ from an even spread
        for name, p in model.named_parameters():
            if "proj" in name or "attn" in name:
                p.mul_(8.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _storylens(*args: str) -> None:
    cmd = [sys.executable, "-m", "storylens", *args, "--no-progress"]
    print("$ storylens", " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    quiz = Path(__file__).resolve().parents[1] / "storylens" / "pretrained" / "tiny-storyteller" / "quiz.txt.gz"
    _storylens("score", "--stories", str(quiz), "--out", str(out / "shipped-score"))
    _storylens("report", "--out", str(out / "shipped-report"), "--truth-stories", "4")
    for kind in TINY_KINDS:
        model = _tiny_model(kind, out / f"model-{kind}")
        _storylens(
            "score",
            "--model",
            str(model),
            "--stories",
            str(quiz),
            "--limit",
            str(N_TINY),
            "--out",
            str(out / f"{kind}-score"),
        )
        _storylens(
            "report",
            "--model",
            str(model),
            "--quiz",
            str(quiz),
            "--out",
            str(out / f"{kind}-report"),
            "--truth-stories",
            "0",
        )


def _numbers(doc, path: str = "") -> dict[str, object]:
    """Every leaf of a JSON document by its path."""
    if isinstance(doc, dict):
        return {k: v for key, val in doc.items() for k, v in _numbers(val, f"{path}/{key}").items()}
    if isinstance(doc, list):
        return {k: v for i, val in enumerate(doc) for k, v in _numbers(val, f"{path}[{i}]").items()}
    return {path: doc}


TIMINGS = ("/seconds/", "/timings_s/")  # how long steps took: never equal twice


def _skipped(key: str, va: object, vb: object) -> bool:
    """Timings, and paths that differ only by where each run was made (a folder's or checkout's path)."""
    if any(t in key + "/" for t in TIMINGS):
        return True
    return isinstance(va, str) and isinstance(vb, str) and "/" in va and Path(va).name == Path(vb).name


def compare(a: Path, b: Path, tol: float, renames: dict[str, str]) -> int:
    bad = 0
    for folder in sorted(p for p in a.iterdir() if p.is_dir() and not p.name.startswith("model-")):
        for name in ("heads.json", "examples.json", "summary.json"):
            fa, fb = folder / name, b / folder.name / name
            if not fa.exists():
                continue
            if not fb.exists():
                print(f"{folder.name}/{name}: missing in {b.name}")
                bad += 1
                continue
            na, nb = _numbers(json.loads(fa.read_text())), _numbers(json.loads(fb.read_text()))
            for old, new in renames.items():
                na = {k.replace(old, new): v for k, v in na.items()}
            worst, where, differ = 0.0, "", []
            for k, va in na.items():
                if k not in nb:
                    differ.append(f"only in {a.name}: {k}")
                    continue
                vb = nb[k]
                if _skipped(k, va, vb):
                    continue
                if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
                    d = abs(float(va) - float(vb))
                    if d > worst:
                        worst, where = d, k
                elif va != vb:
                    differ.append(f"differs: {k}: {va!r} vs {vb!r}")
            added = [f"new in {b.name}: {k}" for k in nb if k not in na]  # an addition is listed, not a failure
            status = "ok" if worst <= tol and not differ else "DIFFERS"
            differ += added
            bad += status != "ok"
            print(f"{folder.name}/{name}: {len(na)} values, largest difference {worst:.3g} {where} [{status}]")
            for line in differ[:10]:
                print("   ", line)
            if len(differ) > 10:
                print(f"    ... {len(differ) - 10} more")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--tol", type=float, default=1e-7)
    c.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="a documented key rename")
    args = p.parse_args()
    if args.cmd == "run":
        run(args.out)
        return 0
    return compare(args.a, args.b, args.tol, dict(r.split("=", 1) for r in args.rename))


if __name__ == "__main__":
    sys.exit(main())
