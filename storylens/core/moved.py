"""Old import paths, kept for one release: the modules that moved when the package was regrouped into its
wings (``storylens.table.scores`` is now :mod:`storylens.table.scores`, and so on) still import from
their old names, with a :class:`DeprecationWarning` that names the new home. A module split in two or more
is read back as one module holding the names of its parts. Removed in the release after this one."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

# old module -> its new home (several: the module was split; the first holds what the rest does not)
MOVED: dict[str, tuple[str, ...]] = {
    "storylens.analysis.accumulate": ("storylens.engine.accumulate",),
    "storylens.analysis.encode": ("storylens.engine.encode",),
    "storylens.analysis.gradients": ("storylens.engine.gradients",),
    "storylens.analysis.record": ("storylens.engine.record",),
    "storylens.analysis.names": ("storylens.data.names",),
    "storylens.analysis.detectors": (
        "storylens.looking.detectors",
        "storylens.engine.masks",
        "storylens.looking.patterns",
        "storylens.looking.reads",
    ),
    "storylens.analysis.faithful": ("storylens.looking.faithful", "storylens.engine.images", "storylens.engine.ranks"),
    "storylens.analysis.examples": (
        "storylens.looking.examples",
        "storylens.looking.example_store",
        "storylens.looking.example_select",
    ),
    "storylens.analysis.sinks": ("storylens.looking.sinks",),
    "storylens.analysis.position": ("storylens.looking.position",),
    "storylens.analysis.pronouns": ("storylens.looking.pronouns",),
    "storylens.analysis.induction": ("storylens.looking.induction",),
    "storylens.analysis.causal": ("storylens.effects.attribution",),
    "storylens.analysis.ablation": ("storylens.effects.ablation", "storylens.table.name_ablation"),
    "storylens.analysis.audit": ("storylens.effects.audit",),
    "storylens.analysis.patching": ("storylens.effects.patching",),
    "storylens.analysis.scores": ("storylens.table.scores", "storylens.table.accumulator"),
    "storylens.analysis.truth": ("storylens.table.truth", "storylens.effects.cost"),
    "storylens.analysis.run_info": ("storylens.table.run_info",),
    "storylens.analysis.grid_html": ("storylens.viz.grid_html",),
    "storylens.analysis.perplexity": ("storylens.lm.perplexity",),
    "storylens.lm.interface": (
        "storylens.lm.loader",
        "storylens.lm.hooks",
        "storylens.lm.native",
        "storylens.lm.transformers_lm",
    ),
}


def _caller_level() -> int:
    """The stack level of the code that asked for the import: this module's frames counted, importlib's
    not (``warnings.warn`` skips those itself)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _skipped(frame.f_code.co_filename):
        level += frame.f_code.co_filename == __file__
        frame = frame.f_back
    return level


def _skipped(filename: str) -> bool:
    return filename == __file__ or (
        filename.startswith("<frozen importlib") or ("importlib" in filename and "_bootstrap" in filename)
    )


def _listed(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def warn_moved(old: str, new: Sequence[str]) -> None:
    warnings.warn(
        f"{old} has moved to {_listed(new)}; the old path works for this release only",
        DeprecationWarning,
        stacklevel=_caller_level(),
    )


def merged(name: str, parts: Sequence[str]) -> types.ModuleType:
    """One module holding every public and private name of ``parts`` (the first part's where names clash)."""
    module = types.ModuleType(name, f"Moved: {', '.join(parts)}.")
    for part in reversed(parts):
        source = importlib.import_module(part)
        module.__dict__.update({k: v for k, v in vars(source).items() if not (k.startswith("__") and k.endswith("__"))})
    return module


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of :data:`MOVED` and hands its new module (or the merged parts)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        parts = MOVED[spec.name]
        warn_moved(spec.name, parts)
        return importlib.import_module(parts[0]) if len(parts) == 1 else merged(spec.name, parts)

    def exec_module(self, module) -> None:
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def moved_attribute(package: str, name: str):
    """For a package's ``__getattr__``: an old submodule ``package.name``, imported (with its warning)."""
    if f"{package}.{name}" not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")
