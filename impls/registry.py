"""Finding backends: the built-ins, the `normspec.backends` entry-point group, and
`module:factory` strings. Loading never raises for a backend's own failure: a missing
framework or a broken factory makes that backend unavailable, with the reason.

Opt-in built-ins: `OPT_IN` names built-ins that are too slow for every run (`inductor`
compiles a graph per configuration). They are known like any other backend (`discover`,
`load`, `load_all`: `normspec backends` lists them, `--backend NAME` runs them, tox has
an env for each), but `default_backends()`, the set a run or a bench without --backend
uses, leaves them out; `OPT_IN[name]` says why."""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import Any

import tomllib

from .protocol import MEMBERS, OPS, Backend

ENTRY_POINT_GROUP = "normspec.backends"

BUILTINS = {
    "numpy": "normspec.impls.numpy_ref:make_backend",
    "torch": "normspec.impls.torch_nn:make_backend",
    "jax": "normspec.impls.flax_nnx:make_backend",
    "numba": "normspec.impls.numba_kernels:make_backend",
    "triton": "normspec.impls.triton_kernels:make_backend",
    "onnxruntime": "normspec.impls.onnxruntime_graphs:make_backend",
    "inductor": "normspec.impls.torch_inductor:make_backend",
}

#: built-ins a run without --backend skips, with the reason (see the module docstring)
OPT_IN = {
    "inductor": "torch.compile compiles a graph per dtype, rank, eps and mode: every "
                "check in float32 alone compiled 345 Inductor graphs in 6.5 min with a cold "
                "cache (2 CPU cores); all four dtypes need about four times that. Run it "
                "with --backend inductor",
}



class UnknownBackend(LookupError):
    pass


@dataclass
class LoadedBackend:
    """A backend as the harness sees it: the object, or why there is none."""

    name: str
    source: str
    backend: Any | None = None
    error: str | None = None
    deviations: list[dict[str, str]] = field(default_factory=list)
    requested: str = ""  # what the user typed (a name or module:factory), for repro snippets

    def __post_init__(self):
        self.requested = self.requested or self.name

    @property
    def available(self) -> bool:
        return self.backend is not None


def discover() -> dict[str, str]:
    """Every backend name normspec can find, mapped to its `module:factory`."""
    found = dict(BUILTINS)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def default_backends() -> list[str]:
    """The backends a run without --backend uses: every one found but the OPT_IN ones."""
    return [name for name in discover() if name not in OPT_IN]


def _import_factory(source: str):
    module_name, _, attr = source.partition(":")
    if not module_name or not attr:
        raise UnknownBackend(f"backend spec {source!r} is not of the form module:factory")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UnknownBackend(f"module {module_name!r} has no factory {attr!r}") from None


def adapter_problems(obj: Any) -> list[str]:
    """What makes an object not a backend (missing attributes, unknown op names)."""
    problems = [f"missing attribute {a!r} (subclass normspec.impls.protocol.Backend for the "
                f"defaults)" for a in MEMBERS if not hasattr(obj, a)]
    caps = getattr(obj, "capabilities", None)
    ops = getattr(caps, "ops", None)
    if caps is not None and ops is None:
        problems.append("capabilities has no 'ops'")
    for op in ops or ():
        if op not in OPS:
            problems.append(f"capabilities names unknown op {op!r} (known: {', '.join(OPS)})")
        elif not callable(getattr(obj, op, None)):
            problems.append(f"capabilities claims {op!r} but the backend has no method {op}()")
    limit = getattr(caps, "max_rows", None)
    # (a str was a TypeError in the checks that compare it: a red team)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        problems.append(f"capabilities has max_rows = {limit!r}; it must be a Python int, at "
                        "least 1, or None (no limit)")
    return problems


def builtin_deviations(name: str) -> list[dict[str, str]]:
    path = resources.files("normspec.impls").joinpath("deviations", f"{name}.toml")
    if not path.is_file():
        return []
    return list(tomllib.loads(path.read_text(encoding="utf-8")).get("deviation", []))


def load(name_or_source: str) -> LoadedBackend:
    """Load a backend by built-in or entry-point name, or by `module:factory`.

    Raises UnknownBackend for a name nobody registered; everything that goes wrong inside
    the backend (ImportError, a raising factory, a non-backend object) is returned as an
    unavailable LoadedBackend with the message.
    """
    known = discover()
    if ":" in name_or_source:
        source = name_or_source
    elif name_or_source in known:
        source = known[name_or_source]
    else:
        raise UnknownBackend(
            f"unknown backend {name_or_source!r}; known: {', '.join(sorted(known))} "
            f"(or give module:factory)"
        )
    label = name_or_source
    try:
        factory = _import_factory(source)
        obj = factory()
    except UnknownBackend as exc:
        return LoadedBackend(label, source, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - any failure of third-party code is reported
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({last.filename}:{last.lineno})" if last else ""
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and \
                source.split(":")[0].split(".")[0] == exc.name.split(".")[0]:
            hint = (f" (is the folder holding {exc.name} on PYTHONPATH, or the current "
                    "folder?)")
        return LoadedBackend(label, source, error=f"{type(exc).__name__}: {exc}{where}{hint}")
    try:
        # its declarations, read here first: one that raises (a property over a broken
        # probe) makes the backend unusable, said why, rather than ending the process
        # that loads it (found by a review)
        problems = adapter_problems(obj)
        if problems:
            return LoadedBackend(label, source,
                                 error="not a normspec backend: " + "; ".join(problems))
        name = str(getattr(obj, "name", label))
        deviations = builtin_deviations(name) if source == BUILTINS.get(name) else []
        deviations += [dict(d) for d in getattr(obj, "deviations", ())]
    except Exception as exc:  # noqa: BLE001 - any failure of third-party code is reported
        return LoadedBackend(label, source, error=f"reading its declarations raised "
                                                  f"{type(exc).__name__}: {exc}")
    return LoadedBackend(name, source, backend=obj, deviations=deviations, requested=label)


def load_all() -> list[LoadedBackend]:
    return [load(name) for name in discover()]


__all__ = ["OPT_IN", "Backend", "LoadedBackend", "UnknownBackend", "default_backends", "discover",
           "load", "load_all"]
