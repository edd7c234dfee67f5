"""``storylens circuit``'s run on a task of pairs: every edge's EAP score, the faithfulness curve of the top
circuits with CPR and CMD, the smallest circuit that keeps 80 % of the metric, the oracle audit and stability;
written as circuit.json (``storylens/schemas/circuit.schema.json``), circuit.csv (one row per edge) and
circuit.html, read back by :func:`load_circuit`."""

from __future__ import annotations

import csv
import io
import itertools
import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch

from storylens.circuits.edges import IG_STEPS, EdgeScores, Graph, eap_scores
from storylens.circuits.faithfulness import Faithfulness, faithfulness, top_circuit
from storylens.circuits.oracle import ORACLE_EDGES, Oracle, edge_oracle
from storylens.circuits.stability import RESAMPLES, SecondPairs, Stability, second_pairs, stability
from storylens.core.errors import StorylensError
from storylens.core.figures import csv_cell, plus_minus
from storylens.core.frames import to_frame
from storylens.core.plain import Plain
from storylens.core.publish import publish_folder
from storylens.core.schema import read_versioned, versioned
from storylens.effects.patching import BATCH_PAIRS, Pair, task_verdict
from storylens.lm import AttentionLM, ModelLike, wrap

ENOUGH = 0.8  # the faithfulness the smallest circuit shown keeps


@dataclass(frozen=True)
class EdgeRow(Plain):
    """One edge: its writer and receiver (``L{block}H{head}.q``, ...), its score with its error over pairs,
    and whether the smallest faithful circuit holds it."""

    writer: str
    receiver: str
    score: float
    score_se: float
    in_circuit: bool


@dataclass
class CircuitResult(Plain):
    """One run: on ``pairs`` (``task`` "pairs", ablation "corrupt": the corrupt prompt's values) or on ``stories``
    (``task`` "stories", ablation "mean" or "zero"; ``tokens`` predicted, every figure per token)."""

    model: str
    task: str
    ablation: str
    pairs: int | None
    stories: int | None
    tokens: int | None
    metric: str
    method: str
    ig_steps: int | None  # EAP-IG's steps (None: eap)
    clean_metric: float
    clean_metric_se: float
    corrupt_metric: float
    corrupt_metric_se: float
    verdict: str
    n_layer: int
    n_head: int
    n_kv_head: int
    n_edges: int
    faithfulness: Faithfulness
    circuit_size: int | None  # the edges of the smallest circuit with f >= ENOUGH (None: no size reaches it)
    circuit_f: float | None
    edges: list[EdgeRow]
    oracle: Oracle | None
    stability: Stability | None
    second: SecondPairs | None = None  # the circuit found again on a second file of pairs (--second-pairs)

    def to_pandas(self):
        """One row per edge (a pandas DataFrame)."""
        return to_frame([e.to_dict() for e in self.edges], [f.name for f in fields(EdgeRow)])


def run_circuit(
    model: ModelLike, pairs: list[Pair], *, method: str = "eap", ig_steps: int = IG_STEPS, oracle: int = ORACLE_EDGES,
    resamples: int = RESAMPLES, seed: int = 0, batch_size: int = BATCH_PAIRS, progress=None,
    second: tuple[str, list[Pair]] | None = None,
) -> CircuitResult:  # fmt: skip
    """The whole run (the module docstring); ``progress(step)`` told of each step's start; ``second``: a second
    file of pairs for the same behaviour (its name, its pairs), on which the circuit is found again."""
    lm = wrap(model)
    say = progress or (lambda step: None)
    say("edge scores")
    scores = eap_scores(lm, pairs, method=method, steps=ig_steps, batch_size=batch_size)
    say("faithfulness")
    f = faithfulness(lm, pairs, scores, batch_size=batch_size, seed=seed)
    size = smallest_faithful(f)
    say("oracle")
    audit = edge_oracle(lm, pairs, scores, k=oracle, seed=seed, batch_size=batch_size) if oracle else None
    say("stability")
    stable = (
        stability(lm, pairs, scores, size, resamples=resamples, seed=seed, batch_size=batch_size)
        if resamples and size and len(pairs) > 1  # resamples of one pair are that pair: nothing to compare
        else None
    )
    again = None
    if second is not None and size:
        say("second pairs")
        other = eap_scores(lm, second[1], method=method, steps=ig_steps, batch_size=batch_size)
        again = second_pairs(lm, pairs, scores, second[1], other, size, source=second[0], resamples=resamples,
                             seed=seed, batch_size=batch_size)  # fmt: skip
    head = dict(task="pairs", ablation="corrupt", pairs=len(pairs), stories=None, tokens=None,
                metric="logit(answer) - logit(wrong) at the last position",
                verdict=task_verdict(f.clean, f.clean_se, len(pairs)))  # fmt: skip
    return assemble(lm, scores, f, audit, stable, method=method, ig_steps=ig_steps, second=again, **head)


def smallest_faithful(f: Faithfulness) -> int | None:
    """The edges asked of the smallest size whose circuit keeps :data:`ENOUGH` (None: no size does)."""
    return next((n for n, x in zip(f.n, f.f) if x >= ENOUGH), None)


def assemble(
    lm: AttentionLM, scores: EdgeScores, f: Faithfulness, audit: Oracle | None, stable: Stability | None, *,
    method: str, ig_steps: int, second: SecondPairs | None = None, **head,
) -> CircuitResult:  # fmt: skip
    """The result of a run from its parts (``head``: the task's fields: ``task`` .. ``metric``, ``verdict``)."""
    size = smallest_faithful(f)
    circuit = top_circuit(scores, size) if size is not None else torch.zeros_like(scores.mean, dtype=torch.bool)
    width = scores.mean.shape[1]
    flat = circuit.flatten()
    index = {
        (w, r): u * width + v for u, w in enumerate(scores.graph.writers) for v, r in enumerate(scores.graph.receivers)
    }
    rows = [EdgeRow(w, r, m, se, bool(flat[index[(w, r)]])) for w, r, m, se in scores.edges()]
    at = None if size is None else f.n.index(size)
    return CircuitResult(
        model=lm.name, method=method, ig_steps=None if method == "eap" else ig_steps, clean_metric=f.clean,
        clean_metric_se=f.clean_se, corrupt_metric=f.corrupt, corrupt_metric_se=f.corrupt_se, n_layer=lm.n_layer,
        n_head=lm.n_head, n_kv_head=lm.n_kv_head, n_edges=scores.graph.n_edges, faithfulness=f, circuit_size=size,
        circuit_f=None if at is None else f.f[at], edges=rows, oracle=audit, stability=stable, second=second, **head,
    )  # fmt: skip


CSV_COLUMNS = tuple(f.name for f in fields(EdgeRow))


def circuit_csv(result: CircuitResult) -> str:
    """One row per edge."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for e in result.edges:
        w.writerow([e.writer, e.receiver, csv_cell(e.score), csv_cell(e.score_se), int(e.in_circuit)])
    return out.getvalue()


def circuit_json(result: CircuitResult) -> str:
    """circuit.json: ``schema_version`` first, then the result's fields."""
    return json.dumps(versioned(result.to_dict()), indent=1, allow_nan=False) + "\n"


def load_circuit(folder: str | Path) -> CircuitResult:
    """Read back the circuit.json ``storylens circuit --out FOLDER`` wrote (the folder or the file); one
    StorylensError line where it is not one."""
    path = Path(folder)
    path = path / "circuit.json" if path.is_dir() else path
    doc = read_versioned(path, "not a folder storylens circuit wrote", "circuit")
    required = [f.name for f in fields(CircuitResult) if f.default is MISSING]  # later fields: optional
    if missing := [name for name in required if name not in doc]:
        raise StorylensError(f"{path}: not a storylens circuit.json (missing {', '.join(missing)})")
    _check_shape(doc, str(path))
    try:
        return CircuitResult.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StorylensError(f"{path}: not a storylens circuit.json ({type(e).__name__}: {e})") from None


def _check_shape(doc: dict, where: str) -> None:
    """One StorylensError line unless circuit.json's edges are its model's graph, every edge once in the graph's
    order, and its faithfulness lists one entry per size."""
    n_layer, n_head, n_kv, edges = doc["n_layer"], doc["n_head"], doc["n_kv_head"], doc["edges"]
    if n_head % n_kv:
        raise StorylensError(f"{where}: {n_head} query heads do not share {n_kv} key/value heads evenly")
    if n_layer * n_head > len(edges) or len(edges) != doc["n_edges"]:  # every head writes to the logits at least
        raise StorylensError(f"{where}: {len(edges)} edges listed, n_edges {doc['n_edges']}, for {n_layer} x {n_head}")
    graph = Graph(n_layer, n_head, n_kv)
    w, r = graph.writers, graph.receivers
    expected = ((w[u], r[v]) for v in range(len(r)) for u in range(graph.upstream(v)))
    for i, (e, want) in enumerate(itertools.zip_longest(edges, expected)):
        if want is None or e is None or (e["writer"], e["receiver"]) != want:
            got = "none" if e is None else f"{e['writer']} -> {e['receiver']}"
            raise StorylensError(f"{where}: edge {i + 1} is {got}, not the graph's {want and ' -> '.join(want)}")
    f = doc["faithfulness"]
    if len({len(f[k]) for k in ("percentages", "n", "kept", "f", "f_se")}) != 1:
        raise StorylensError(f"{where}: the faithfulness lists are not one entry per size")


def _eap_ig_name(label: str) -> str:
    """A storylens node label (``input``, ``L2H3``, ``M4``, ``logits``, a receiver ``L2H3.q``) as EAP-IG names
    it (``input``, ``a1.h2``, ``m3``, ``logits``; blocks and heads from 0)."""
    base = label.split(".")[0]
    if base in ("input", "logits"):
        return base
    if base.startswith("M"):
        return f"m{int(base[1:]) - 1}"
    layer, head = base[1:].split("H")
    return f"a{int(layer) - 1}.h{int(head) - 1}"


def eap_ig_graph(result: CircuitResult, d_model: int) -> dict | None:
    """The edge scores as EAP-IG's ``Graph.to_json`` writes them (``Graph.from_json`` and MIB's circuit track read
    it): ``cfg``, ``nodes`` (``in_graph``: an edge of the circuit in or out), ``edges`` named
    ``parent->child<q|k|v>`` with ``score`` and ``in_graph``. None for grouped key/value heads: EAP-IG's graph has
    a key and a value input per query head, which a grouped edge's score does not split into."""
    if result.n_kv_head != result.n_head:
        return None
    edges, used = {}, {"logits"}
    for e in result.edges:
        parent, child = _eap_ig_name(e.writer), _eap_ig_name(e.receiver)
        kind = e.receiver.split(".")[1] if "." in e.receiver else None
        edges[f"{parent}->{child}" + (f"<{kind}>" if kind else "")] = {"score": e.score, "in_graph": e.in_circuit}
        if e.in_circuit:
            used |= {parent, child}
    names = ["input"] + [n for layer in range(result.n_layer) for n in
                         [f"a{layer}.h{h}" for h in range(result.n_head)] + [f"m{layer}"]] + ["logits"]  # fmt: skip
    cfg = {"n_layers": result.n_layer, "n_heads": result.n_head, "parallel_attn_mlp": False, "d_model": d_model}
    return {"cfg": cfg, "nodes": {n: {"in_graph": n in used} for n in names}, "edges": edges}


def write_circuit(out: str | Path, result: CircuitResult, page: str, d_model: int | None = None) -> Path:
    """``out/circuit.json``, ``circuit.csv``, ``circuit.html`` (``page``) and, given the model's width for an
    ungrouped model, ``circuit.eap-ig.json`` (:func:`eap_ig_graph`), published together."""
    graph = eap_ig_graph(result, d_model) if d_model is not None else None
    with publish_folder(out, "circuit") as tmp:
        (tmp / "circuit.json").write_text(circuit_json(result), encoding="utf-8")
        (tmp / "circuit.csv").write_text(circuit_csv(result), encoding="utf-8")
        (tmp / "circuit.html").write_text(page, encoding="utf-8")
        if graph is not None:
            (tmp / "circuit.eap-ig.json").write_text(json.dumps(graph), encoding="utf-8")
    return Path(out)


def f_text(f: float, se: float | None) -> str:
    """A faithfulness with its bootstrap error where there is one."""
    return plus_minus(round(f, 3) + 0.0, se) if se is not None else f"{round(f, 3) + 0.0:+.3f}"


def circuit_lines(result: CircuitResult, top: int = 12) -> list[str]:
    """What ``storylens circuit`` prints: whether the model does the task first, then the curve, the circuit."""
    f = result.faithfulness
    rows = (
        f"{result.pairs} pair{'s' * (result.pairs != 1)}" if result.task == "pairs"
        else f"{result.stories:,} stor{'ies' if result.stories != 1 else 'y'} ({result.tokens:,} predicted tokens; {result.ablation} ablation)"
    )  # fmt: skip
    ablated = "corrupt" if result.task == "pairs" else "every edge ablated"
    unit = "pair" if result.task == "pairs" else "story"
    out = [
        result.verdict,
        f"{rows} on {result.model}; {result.n_edges:,} edges ({result.n_layer} blocks x {result.n_head} "
        f"heads, {result.n_kv_head} key/value heads); method {result.method}"
        + ("" if result.ig_steps is None else f" ({result.ig_steps} steps)"),
        f"clean {plus_minus(f.clean, f.clean_se, one=unit)}, {ablated} {plus_minus(f.corrupt, f.corrupt_se, one=unit)}",
        "faithfulness of the top edges (pruned), f = (m(circuit) - m(empty)) / (m(model) - m(empty)):",
    ]
    out += [
        f"  {p:>6.1%}  {k:>6,} edges  f {plus_minus(round(x, 3) + 0.0, se, one=unit)}"
        for p, k, x, se in zip(f.percentages, f.kept, f.f, f.f_se)
    ]
    cpr, cmd = plus_minus(f.cpr, f.cpr_se, one=unit), plus_minus(f.cmd, f.cmd_se, one=unit)
    out.append(f"CPR {cpr}, CMD {cmd} (areas over the edge fraction)")
    if result.circuit_size is None:
        out.append(f"no circuit size keeps {ENOUGH:.0%} of the metric")
    else:
        edges = sorted((e for e in result.edges if e.in_circuit), key=lambda e: -abs(e.score))
        out.append(
            f"the smallest circuit keeping {ENOUGH:.0%}: {len(edges)} edges (top {result.circuit_size} before pruning), "
            f"f {result.circuit_f:+.3f}; its largest edges:"
        )
        out += [f"  {e.writer:>6} -> {e.receiver:<10} {plus_minus(e.score, e.score_se, one=unit)}" for e in edges[:top]]
    if result.oracle is not None:
        o = result.oracle
        rho = "n/a" if o.rho is None else f"{o.rho:.3f}"
        out.append(
            f"oracle: {len(o.rows)} edges ablated alone and run; Spearman rho (score vs exact) {rho}"
            + (f"; opposite signs beyond both errors: {', '.join(o.disagree)}" if o.disagree else "")
        )
    if result.stability is not None:
        s = result.stability
        out.append(
            f"stability over {s.resamples} resamples of the {result.task}: Jaccard {s.jaccard:.3f} (sd {s.jaccard_sd:.3f}) "
            f"with the {s.kept}-edge circuit; {s.core} edges in every resample, keeping f {f_text(s.core_f, s.core_f_se)}"
        )
    if result.second is not None:
        t = result.second
        spread = "" if t.jaccard_sd is None else f" (sd {t.jaccard_sd:.3f} over {t.resamples} resamples of it)"
        out += [
            f"on the second pairs ({t.source}, {t.pairs} pairs): {t.verdict}",
            f"  its {t.kept}-edge circuit: Jaccard {t.jaccard:.3f}{spread} with this one's; the {t.shared} edges both "
            f"hold keep f {f_text(t.shared_f, t.shared_f_se)} here, its own circuit f {f_text(t.second_f, t.second_f_se)}",
        ]
    return out
