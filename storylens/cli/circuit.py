"""``storylens circuit``: which edges between heads, MLPs and the logits carry a task of clean/corrupt pairs
(edge attribution patching), how faithful the circuits of their top edges are (each run exactly), and how
stable (docs/circuit.md)."""

from __future__ import annotations

from storylens.circuits.edges import IG_STEPS, METHODS
from storylens.circuits.oracle import ORACLE_EDGES
from storylens.circuits.run import circuit_lines, run_circuit, write_circuit
from storylens.circuits.stability import RESAMPLES
from storylens.cli.options import add_model, add_no_progress, add_pairs, check_seed, load, out_path, task_rows
from storylens.core.errors import UsageError
from storylens.core.progress import progress_command
from storylens.core.publish import check_target_folder
from storylens.effects.patching import encode_pairs, pair_patterns
from storylens.lm import wrap
from storylens.viz.circuit import circuit_html

COMMAND = "circuit"
POSITION = 55


def add_parser(sub) -> None:
    p = sub.add_parser(
        COMMAND, help="the circuit of edges that carries a task of clean/corrupt pairs, and its faithfulness"
    )
    add_pairs(p)
    p.add_argument("--out", required=True, help="output folder: circuit.json, circuit.csv, circuit.html")
    p.add_argument(
        "--method",
        choices=METHODS,
        default="eap",
        help="how every edge is scored: eap (edge attribution patching: one backward pass), eap-ig-inputs (the "
        "gradients averaged along the input's path from the corrupt prompt to the clean one, --ig-steps points), "
        "eap-ig-activations (along each node's own path in turn: (1 + 2 x blocks) x --ig-steps backward passes); "
        "default eap",
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
        help=f"stability: the smallest faithful circuit found again on N bootstrap resamples of the pairs (default {RESAMPLES}; 0: none)",
    )
    p.add_argument("--seed", type=int, default=0, help="the oracle's random edges and the resamples (default 0)")
    add_model(p)
    add_no_progress(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.ig_steps < 1:
        raise UsageError(f"--ig-steps: a whole number, 1 or more (got {args.ig_steps})")
    if args.oracle < 0 or args.resamples < 0:
        raise UsageError(f"--oracle and --resamples: whole numbers, 0 or more (got {args.oracle}, {args.resamples})")
    check_seed(args.seed)
    out = out_path(args.out)
    check_target_folder(out)  # before the model: a bad --out costs nothing
    source, rows = task_rows(args)  # bad lines refused before the model loads
    model = load(args)
    pairs = encode_pairs(model, rows, source.name)

    def say(step: str) -> None:
        if not args.no_progress:
            print(f"storylens: circuit: {step}", flush=True)

    with progress_command("circuit"):
        result = run_circuit(
            model, pairs, method=args.method, ig_steps=args.ig_steps, oracle=args.oracle, resamples=args.resamples, seed=args.seed,
            progress=say,
        )  # fmt: skip
    page = circuit_html(result.to_dict(), title=f"storylens circuit: {result.model}", pairs=pair_patterns(model, pairs))
    write_circuit(out, result, page, d_model=wrap(model).head_output_weights(0).shape[-1])
    print("\n".join(circuit_lines(result)))
    return 0
