"""Old import paths, kept for one release: the modules that moved when the package was regrouped into its
wings (``storylens.analysis.scores`` is now :mod:`storylens.table.scores`, and so on) still import from
their old names, with a :class:`DeprecationWarning` that names the new home. A module split in two or more
is read back as one module that reads and sets each name in the part that holds it (so a test's monkeypatch
on the old path still reaches the code). Removed in the release after this one."""

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


# names that left a module which is still there: module -> {name: its new module}
MOVED_NAMES: dict[str, dict[str, str]] = {
    "storylens.viz.figures": {
        "name_head_figure": "storylens.viz.name_head",
        "name_attention_profile": "storylens.viz.name_head",
        "name_even_share": "storylens.viz.name_head",
        "head_heatmap_figure": "storylens.viz.score_figures",
        "name_mass_bar_figure": "storylens.viz.score_figures",
    },
}


def _caller_level() -> int:
    """The stack level of the code that asked for the import or the name: this module's frames and a
    module's ``__getattr__`` counted, importlib's not (``warnings.warn`` skips those itself)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (_skipped(frame.f_code.co_filename) or frame.f_code.co_name == "__getattr__"):
        level += frame.f_code.co_filename == __file__ or frame.f_code.co_name == "__getattr__"
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


class Merged(types.ModuleType):
    """An old module split in ``parts``: each name read from, and set in, the first part that holds it. Its
    own namespace holds a copy of every name too (tools such as pytest's monkeypatch read it to restore a
    name), kept in step when a name is set or deleted through it."""

    def __init__(self, name: str, parts: Sequence[str]):
        super().__init__(name, f"Moved: {', '.join(parts)}.")
        modules = tuple(importlib.import_module(p) for p in parts)
        for part in reversed(modules):
            vars(self).update({k: v for k, v in vars(part).items() if not k.startswith("__")})
        vars(self)["_parts"] = modules

    def __getattribute__(self, name: str):
        if not name.startswith("__"):
            for part in types.ModuleType.__getattribute__(self, "__dict__").get("_parts", ()):
                if name in vars(part):
                    return vars(part)[name]
        return super().__getattribute__(name)

    def _holder(self, name: str) -> types.ModuleType | None:
        return next((p for p in vars(self)["_parts"] if name in vars(p)), None)

    def __setattr__(self, name: str, value) -> None:
        holder = None if name.startswith("__") else self._holder(name)
        if holder is not None:
            setattr(holder, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        holder = self._holder(name)
        if holder is not None:
            delattr(holder, name)
        super().__delattr__(name)


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of :data:`MOVED` and hands its new module (or the merged parts)."""

    def __init__(self) -> None:
        self._specs: dict[str, tuple] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        parts = MOVED[spec.name]
        warn_moved(spec.name, parts)
        if len(parts) > 1:
            return Merged(spec.name, parts)
        module = importlib.import_module(parts[0])
        self._specs[module.__name__] = (module.__spec__, module.__loader__)  # importlib sets the old path's
        return module

    def exec_module(self, module) -> None:
        if module.__name__ in self._specs:  # the new module itself: its own spec and loader back
            module.__spec__, module.__loader__ = self._specs.pop(module.__name__)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def moved_attribute(package: str, name: str):
    """For a package's ``__getattr__``: an old submodule ``package.name``, imported (with its warning)."""
    if f"{package}.{name}" not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")


def moved_name(module: str, name: str):
    """For a module's ``__getattr__``: a name of :data:`MOVED_NAMES` that left ``module``, from its new
    module (with the warning)."""
    new = MOVED_NAMES.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warn_moved(f"{module}.{name}", [f"{new}.{name}"])
    return getattr(importlib.import_module(new), name)
