"""``storylens circuit``: which edges between heads, MLPs and the logits carry a task of clean/corrupt pairs, or the
corpus loss under mean or zero ablation (edge attribution patching), how faithful the circuits of their top edges
are (each run exactly), and how stable (docs/circuit.md)."""

from __future__ import annotations

from storylens.circuits.edges import IG_STEPS, METHODS
from storylens.circuits.oracle import ORACLE_EDGES
from storylens.circuits.run import circuit_lines, run_circuit, write_circuit
from storylens.circuits.stability import RESAMPLES
from storylens.circuits.stories import ABLATIONS
from storylens.cli.options import add_model, add_no_progress, add_pairs, check_seed, load, out_path, task_rows
from storylens.cli.rules import ray_address
from storylens.core.errors import UsageError
from storylens.core.progress import progress_command
from storylens.core.publish import check_target_folder
from storylens.corpus.circuit import CHUNK_STORIES, StoryCircuitOptions, circuit_over_stories
from storylens.corpus.ray_engine import check_address
from storylens.data.sources import open_source
from storylens.effects.patching import encode_pairs, pair_patterns
from storylens.engine.encode import BATCH_STORIES
from storylens.lm import wrap
from storylens.viz.circuit import circuit_html

COMMAND = "circuit"
POSITION = 55


def add_parser(sub) -> None:
    p = sub.add_parser(
        COMMAND, help="the circuit of edges that carries a task of clean/corrupt pairs, and its faithfulness"
    )
    add_pairs(p)
    _add_stories(p)
    p.add_argument("--out", required=True, help="output folder: circuit.json, circuit.csv, circuit.html")
    p.add_argument(
        "--method",
        choices=METHODS,
        default="eap",
        help="how every edge is scored: eap (edge attribution patching: one backward pass), eap-ig-inputs (the "
        "gradients averaged along the input's path from the corrupt prompt to the clean one, --ig-steps points; "
        "pairs only), eap-ig-activations (along each node's own path in turn from its ablated value: (1 + 2 x "
        "blocks) x --ig-steps backward passes); default eap",
    )
    p.add_argument("--ig-steps", type=int, default=IG_STEPS, metavar="M", help=f"EAP-IG's steps (default {IG_STEPS})")
    p.add_argument(
        "--oracle",
        type=int,
        default=ORACLE_EDGES,
        metavar="K",
        help=f"audit the scores by ablating each of the top K edges and K drawn at random alone (default {ORACLE_EDGES}; 0: none)",
    )
    p.add_argument(
        "--resamples",
        type=int,
        default=RESAMPLES,
        metavar="N",
        help=f"stability: the smallest faithful circuit found again on N bootstrap resamples of the pairs or stories (default {RESAMPLES}; 0: none)",
    )
    p.add_argument(
        "--second-pairs",
        default=None,
        metavar="FILE",
        help="stability: a second pairs file (or shipped task) for the same behaviour, a paraphrase say: the circuit "
        "of the same size found on it, its Jaccard index with this one's and what the edges both hold keep",
    )
    p.add_argument("--seed", type=int, default=0, help="the oracle's random edges and the resamples (default 0)")
    add_model(p)
    add_no_progress(p)
    p.set_defaults(func=run)


def _add_stories(p) -> None:
    """The corpus form: ``--stories`` instead of ``--pairs``, its ablation, and how the stories are streamed."""
    g = p.add_argument_group("the corpus loss instead of a task of pairs")
    g.add_argument(
        "--stories",
        default=None,
        metavar="SRC",
        help="score edges against the loss on these stories (a .txt/.gz file with <|endoftext|> lines, .jsonl, "
        ".parquet, a saved dataset folder, hf:OWNER/NAME) instead of a task of pairs",
    )
    g.add_argument("--ablation", choices=ABLATIONS, default="mean", help="with --stories: what an ablated edge "
                   "carries after the opening token: the writer's mean over the stories (default) or zero")  # fmt: skip
    g.add_argument("--limit", type=int, default=None, metavar="N", help="with --stories: only the first N stories")
    g.add_argument("--text-field", default="text", help="with --stories: the story's field in JSON lines or Parquet")
    g.add_argument("--split", default=None, help="with --stories: a Hugging Face dataset's split")
    g.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_STORIES,
        help=f"with --stories: stories per pass (default {BATCH_STORIES})",
    )
    g.add_argument("--chunk-stories", type=int, default=CHUNK_STORIES,
                   help=f"with --stories: stories a chunk, the unit of checkpoints and of Ray work (default {CHUNK_STORIES})")  # fmt: skip
    g.add_argument(
        "--resume", action="store_true", help="with --stories: go on from the checkpoint an interrupted run left"
    )
    g.add_argument(
        "--engine", choices=["local", "ray"], default="local", help="with --stories: this process, or Ray actors"
    )
    g.add_argument("--workers", type=int, default=2, help="with --engine ray: how many actors (default 2)")
    g.add_argument(
        "--address", default=None, type=ray_address, help="with --engine ray: join this cluster (default: a local Ray)"
    )


def _check(args) -> None:
    if args.ig_steps < 1:
        raise UsageError(f"--ig-steps: a whole number, 1 or more (got {args.ig_steps})")
    if args.oracle < 0 or args.resamples < 0:
        raise UsageError(f"--oracle and --resamples: whole numbers, 0 or more (got {args.oracle}, {args.resamples})")
    check_seed(args.seed)
    if args.stories is not None and args.pairs != "names":  # the corpus form's options: storylens.cli.rules
        raise UsageError("--pairs and --stories: one task or the other, not both")
    if args.stories is not None and args.second_pairs is not None:
        raise UsageError("--second-pairs: only with a task of pairs, not --stories")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit: a whole number, 1 or more (got {args.limit})")


def run(args) -> int:
    _check(args)
    out = out_path(args.out)
    check_target_folder(out, kind="circuit")  # before the model: a bad --out costs nothing
    if args.stories is not None:
        return _run_stories(args, out)
    source, rows = task_rows(args)  # bad lines refused before the model loads
    second = task_rows(args, args.second_pairs) if args.second_pairs is not None else None
    model = load(args)
    pairs = encode_pairs(model, rows, source.name)
    again = None if second is None else (second[0].name, encode_pairs(model, second[1], second[0].name))

    def say(step: str) -> None:
        if not args.no_progress:
            print(f"storylens: circuit: {step}", flush=True)

    with progress_command("circuit"):
        result = run_circuit(
            model, pairs, method=args.method, ig_steps=args.ig_steps, oracle=args.oracle, resamples=args.resamples, seed=args.seed,
            progress=say, second=again,
        )  # fmt: skip
    page = circuit_html(result.to_dict(), title=f"storylens circuit: {result.model}", pairs=pair_patterns(model, pairs))
    write_circuit(out, result, page, d_model=wrap(model).head_output_weights(0).shape[-1])
    print("\n".join(circuit_lines(result)))
    return 0


def _run_stories(args, out) -> int:
    opts = StoryCircuitOptions(
        ablation=args.ablation, method=args.method, ig_steps=args.ig_steps, oracle=args.oracle,
        resamples=args.resamples, seed=args.seed, batch_size=args.batch_size, chunk_stories=args.chunk_stories,
        resume=args.resume, engine=args.engine, workers=args.workers, address=args.address, model_source=args.model,
        progress=not args.no_progress,
    )  # fmt: skip
    if args.engine == "ray" and args.address:
        check_address(args.address)
    source = open_source(
        args.stories, text_field=args.text_field, limit=args.limit, split=args.split, allow_download=args.allow_download
    )
    with progress_command("circuit"):
        result = circuit_over_stories(wrap(load(args)), source, out, opts)
    print("\n".join(circuit_lines(result)))
    return 0
