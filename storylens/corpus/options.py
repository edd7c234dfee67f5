"""What ``storylens score`` is asked (:class:`ScoreOptions`), checked once before the first story, and the
checks the report shares (``--examples``, ``--graph-memory``)."""

from __future__ import annotations

from dataclasses import dataclass

from storylens.core.errors import UsageError
from storylens.effects.estimators import ESTIMATORS, IG_STEPS
from storylens.effects.exact import EXACT_MODES
from storylens.engine.encode import BATCH_STORIES, CHUNK_STORIES
from storylens.engine.gradients import GRAPH_BYTES
from storylens.looking.detectors import BUILTIN_DETECTORS, Detector

EXAMPLES = 8  # queries kept per head and detector, where it fires most (examples.json)


# examples kept in all (heads x detectors x K), each about 1 KB in memory and again in examples.json
# and explore.html (0.74 KB held, 0.62 KB of JSON: the shipped model, K = 200): about 0.5 GB at most,
# and room for the default K on a model of 80 x 64 heads (286,720)
EXAMPLES_BUDGET = 500_000


def check_graph_memory(mb) -> None:
    """``--graph-memory MB``: a whole number of MiB, 0 or more (0: one block's activations at a time)."""
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise UsageError(f"--graph-memory: a whole number of MiB, 0 or more (got {mb!r})")


def check_examples(k, heads: int | None = None, detectors: int | None = None) -> None:
    """``k`` examples per head and detector: a whole number, 0 or more, and (given the model's
    ``heads`` and the ``detectors``) within :data:`EXAMPLES_BUDGET` kept in all."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UsageError(f"--examples: a whole number, 0 or more (got {k!r})")
    if heads is not None and detectors is not None and k * heads * detectors > EXAMPLES_BUDGET:
        raise UsageError(
            f"--examples {k:,}: {heads:,} heads x {detectors} detectors x {k:,} = {k * heads * detectors:,} "
            f"examples, past the budget of {EXAMPLES_BUDGET:,} kept in all (about 1 KB each in memory, and "
            f"again in examples.json and explore.html); at most {EXAMPLES_BUDGET // (heads * detectors):,} here"
        )


@dataclass(frozen=True)
class ScoreOptions:
    """How ``storylens score`` runs, built once (by the command line, or from :func:`score_corpus`'s
    keywords) and checked once, here, before the first story.

    ``batch_size`` stories a batch, ``chunk_stories`` a chunk (the unit of a checkpoint and of a Ray
    task); a checkpoint every ``checkpoint_every`` batches, gone on from with ``resume``; ``engine``
    "local" or "ray" (``workers`` actors, on the cluster at ``address``, each loading ``model_source``:
    a folder or hub id, None for the shipped model); ``detectors``: every detector scored;
    ``examples``: the queries kept per head and detector where it fires most (0: none); ``causal``:
    every head's AtP and DLA too (:mod:`storylens.effects.attribution`, ``--causal``), the gradient pass
    holding at most ``graph_memory`` MiB of kept graphs (``--graph-memory``); ``audit``: K > 0
    (with ``causal``) audits AtP by exact ablation after the scoring, the K heads of largest |AtP| and K
    drawn at random (``seed``) on ``audit_stories`` first stories (None: as many as the ablation budget
    allows, :func:`~storylens.effects.audit.audit_budget_stories`), refused past
    :data:`~storylens.effects.cost.ABLATION_LIMIT_FLOPS` unless ``over_budget``; ``exact``: modes of
    :data:`~storylens.effects.exact.EXACT_MODES` in which every head's exact effect is measured in the same pass
    (:mod:`storylens.effects.exact`), on the first ``exact_stories`` stories (None: all), refused past the same
    budget unless ``over_budget``; mean ablation's means over the same stories (a pass of their own before the
    scoring); resample's donors drawn with ``seed``. With ``causal`` and no ``exact``, the exact effect in mean
    ablation on ``exact_stories`` first stories (None: as many as the report's ablation budget allows) and AtP
    again there, its audit (:mod:`storylens.corpus.exact_plan`)."""

    batch_size: int = BATCH_STORIES
    chunk_stories: int = CHUNK_STORIES
    checkpoint_every: int = 50
    resume: bool = False
    engine: str = "local"
    workers: int = 2
    address: str | None = None
    model_source: str | None = None
    detectors: tuple[Detector, ...] = BUILTIN_DETECTORS
    progress: bool = True
    examples: int = EXAMPLES
    causal: bool = False
    graph_memory: int = GRAPH_BYTES >> 20
    audit: int = 0
    audit_stories: int | None = None
    seed: int = 0
    over_budget: bool = False
    exact: tuple[str, ...] = ()
    exact_stories: int | None = None
    estimator: str | None = None
    ig_steps: int = IG_STEPS
    backups: int = 0
    composition: bool = False  # composition.csv whatever its cost (storylens.circuits.composition)

    def __post_init__(self) -> None:
        object.__setattr__(self, "detectors", tuple(self.detectors))
        object.__setattr__(self, "exact", tuple(self.exact))
        bad = [m for m in self.exact if m not in EXACT_MODES]
        if bad or len(set(self.exact)) != len(self.exact):
            raise UsageError(f"--exact: modes among {', '.join(EXACT_MODES)}, each once (got {','.join(self.exact)})")
        n = self.exact_stories
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1 or not self.exact_modes):
            raise UsageError(f"--exact-stories: a whole number, 1 or more, with --exact or --causal (got {n!r})")
        if self.estimator is not None and self.estimator not in ESTIMATORS:
            raise UsageError(f"--estimator: one of {', '.join(ESTIMATORS)} (got {self.estimator!r})")
        if self.estimator is not None and not self.exact_modes:
            raise UsageError(
                "--estimator: an estimate is shown beside its audit against the exact effect: pass --exact or "
                "--causal too (with --exact-stories N to measure that on the first N stories only)"
            )
        if isinstance(self.backups, bool) or not isinstance(self.backups, int) or self.backups < 0:
            raise UsageError(f"--backups: a whole number of heads, 0 or more (got {self.backups!r})")
        if self.backups and not self.exact_modes:
            raise UsageError("--backups: switches off the heads of largest exact effect: pass --exact or --causal too")
        if isinstance(self.ig_steps, bool) or not isinstance(self.ig_steps, int) or self.ig_steps < 1:
            raise UsageError(f"--ig-steps: a whole number, 1 or more (got {self.ig_steps!r})")
        check_examples(self.examples)
        if isinstance(self.audit, bool) or not isinstance(self.audit, int) or self.audit < 0:
            raise UsageError(f"--audit: a whole number of heads, 0 or more (got {self.audit!r})")
        check_graph_memory(self.graph_memory)
        if self.audit and not self.causal:
            raise UsageError("--audit: only with --causal (it audits the causal columns)")
        n = self.audit_stories
        if n is not None and not self.audit:
            raise UsageError("--audit-stories: only with --audit (the audit's stories)")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"--audit-stories: a whole number, 1 or more (got {n!r})")
        if self.batch_size < 1 or self.chunk_stories < 1 or self.checkpoint_every < 1:
            raise UsageError("--batch-size, --chunk-stories and --checkpoint-every: must be at least 1")
        if self.engine not in ("local", "ray"):
            raise UsageError(f"--engine: local or ray (got {self.engine!r})")
        if self.workers < 1:
            raise UsageError(f"--workers: must be at least 1 (got {self.workers})")

    @property
    def exact_modes(self) -> tuple[str, ...]:
        """The exact effect's modes: ``exact``'s, else mean ablation with ``causal`` (its default, on the first
        stories the budget allows: :mod:`storylens.corpus.exact_plan`); none without either."""
        return self.exact or (("mean",) if self.causal else ())
