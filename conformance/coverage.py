"""Parameter coverage: which checks vary which parameter of which op.

A backend that ignores a parameter conforms to every check that never changes it (a QK-norm
that always multiplies by 1/sqrt(d_k) passes every check that only ever asks for
1/sqrt(d_k)). So every parameter of the protocol must be varied by at least one check.

The parameters come from the code, not from a list: the signatures of `Backend`'s op
methods (impls/protocol.py, OPS and OPTIONAL_METHODS), and of every public `BatchNormLayer` method that takes
arguments (`forward`, `forward_no_grad`), so a new parameter shows up here by itself.

How it is measured: every check (`all_checks()`) is run once through `runner.run_check` on
a recording wrapper around a correct backend that claims every capability. The wrapper
binds each call to the protocol's signature and records, per (op, parameter) and per
check, the distinct *values* the check passed. Only calls made through `Context.call` count:
that is the guarded path whose outputs the checks judge; a direct call made only to see
whether the backend raises (protocol.eps_zero, B3.batch_of_one_train) compares no value.

What a value is. Two arguments are the same value when a backend could not tell them
apart, or could have supplied the second itself:

* scalars, bools, None and tuples by equality (eps 1e-05 and 1e-05 are one value);
* arrays by shape and contents (compared in float64), None being a value of its own; a
  weight that is all ones (weight, q_weight, k_weight) counts as None and a bias that is
  all zeros counts as None, since that is what a backend ignoring them would use;
* `scale` relative to the head dimension: scale * sqrt(d_k), where d_k = q.shape[-1], so
  1/sqrt(d_k) at every d_k is one value ("1/sqrt(d_k)"), the one a backend can compute
  without being told;
* `normalized_shape` by its number of axes: its sizes are the trailing sizes of x, so the
  count of axes is all the information a backend could not read from x;
* a dtype by its name.

What "varied" means. A check varies a parameter when its calls give the parameter at
least two distinct values (a backend that ignores the parameter, using one fixed value or
one it derives from the other arguments, gets at least one of them wrong), or when it
gives the parameter a value that no other check gives while other checks give another
(the check contributes the variation the suite has). A parameter is covered when at least
one check varies it.

Data inputs (x, q, k, scores, grad_output) are arrays like any other: they are varied by
any check that calls twice on different data, which says little; they are listed so that
no parameter is left out, and for grad_output the values column shows what does matter,
that both None (no gradients asked for) and arrays are passed.

Dtypes. Everything is recorded in one dtype, float32 (a check restricted to other dtypes
in the first one it accepts): the parameters' values do not depend on it, except a
parameter whose type is a dtype (batch_norm's `dtype`), which *is* the dtype under test.
The checks that pass such a parameter are run once more, in float64 (or their next
dtype), and only that parameter is recorded there.

Regenerate the committed table with the command in `HEADER` (docs/coverage.md); the test
suite fails when it is stale or when a parameter is varied by no check.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType

import numpy as np
from normspec.impls import registry
from normspec.impls.protocol import (
    DTYPES,
    OPS,
    OPTIONAL_METHODS,
    Backend,
    BatchNormLayer,
    Capabilities,
)

from . import runner
from .checks import Check, all_checks
from .context import Context, seed_only_draws

#: Hypothesis examples per check: enough to draw several values of each drawn parameter,
#: few enough to keep the run (every check, once) to seconds on a NumPy backend.
EXAMPLES = 6
SEED = 0
PRIMARY_DTYPE = "float32"
SECOND_DTYPES = ("float64", "float32", "bfloat16", "float16")
LAYER = "BatchNormLayer"
DEFAULT_BACKEND = "oracle_backend:make_backend"
COMMAND = "PYTHONPATH=tests python -m normspec.conformance.coverage > docs/coverage.md"

#: Array parameters whose neutral value a backend ignoring them would use: weights (ones)
#: and biases (zeros); such an array counts as the same value as None.
NEUTRAL = {"weight": 1.0, "q_weight": 1.0, "k_weight": 1.0, "bias": 0.0}


# ---------------------------------------------------------------- the protocol's parameters
def protocol_parameters(backend_cls: type = Backend,
                        layer_cls: type = BatchNormLayer) -> dict[str, tuple[inspect.Parameter, ...]]:
    """op -> its parameters (self excluded), read from the signatures: every op in OPS
    and every optional method (OPTIONAL_METHODS) on `backend_cls`, then every public
    method of `layer_cls` that takes arguments, as "BatchNormLayer.<method>"."""
    out: dict[str, tuple[inspect.Parameter, ...]] = {}
    for op in OPS + OPTIONAL_METHODS:
        out[op] = _params(getattr(backend_cls, op))
    for name, member in vars(layer_cls).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        params = _params(member)
        if params:
            out[f"{LAYER}.{name}"] = params
    return out


def _params(fn) -> tuple[inspect.Parameter, ...]:
    return tuple(p for p in inspect.signature(fn).parameters.values() if p.name != "self")


def _is_dtype_parameter(p: inspect.Parameter) -> bool:
    return "dtype" in str(p.annotation)


# ---------------------------------------------------------------- values
def value_of(op: str, name: str, value, arguments: dict) -> str:
    """The value of one argument as coverage compares it (see the module docstring)."""
    if name == "scale" and value is not None and "q" in arguments:
        ratio = float(value) * float(np.sqrt(np.shape(arguments["q"])[-1]))
        return "1/sqrt(d_k)" if np.isclose(ratio, 1.0, rtol=1e-6, atol=0) else f"{ratio:.6g}/sqrt(d_k)"
    if name == "normalized_shape" and value is not None:
        n = len(value) if isinstance(value, (tuple, list)) else 1
        return f"{n} axis" if n == 1 else f"{n} axes"
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    if isinstance(value, np.ndarray):
        a = np.asarray(value, dtype=np.float64)
        if name in NEUTRAL and a.size and np.all(a == NEUTRAL[name]):
            return "None"
        digest = hashlib.sha1(a.tobytes() + repr(a.shape).encode()).hexdigest()[:10]
        return f"array{tuple(a.shape)}#{digest}"
    if isinstance(value, Mapping):
        # named arrays (encoder_layer's params, final_norm): their names and contents
        parts = [f"{k}={value_of(op, str(k), v, arguments)}" for k, v in sorted(value.items())]
        return f"{len(value)} arrays#{hashlib.sha1(repr(parts).encode()).hexdigest()[:10]}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, (list, tuple, np.ndarray))
                                                for v in value):
        # nested shards (data_parallel_batch_norm's steps[t][r]): their sizes and contents
        sizes = [value_of(op, name, v, arguments) for v in value]
        return f"[{', '.join(sizes)}]" if len(value) <= 4 else \
            f"{len(value)}x#{hashlib.sha1(repr(sizes).encode()).hexdigest()[:10]}"
    if isinstance(value, (list, tuple)):
        return repr(tuple(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    return repr(value)


def _sort_key(v: str):
    """Numbers (and "0.4/sqrt(d_k)") by their leading number, then everything else."""
    match = re.match(r"-?\d[\d.e+-]*", v)
    try:
        return (0, float(match.group(0) if match else v), v)
    except ValueError:
        return (1, 0.0, v)


# ---------------------------------------------------------------- recording
_CONTEXT_CALL = Context.call.__code__


def _calling_context() -> Context | None:
    """The Context whose `call` is on the stack (the check's guarded call), if any."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CONTEXT_CALL:
            ctx = frame.f_locals.get("self")
            return ctx if isinstance(ctx, Context) else None
        frame = frame.f_back
    return None


@dataclass
class Recording:
    """What the recording wrapper saw: (op, parameter) -> check id -> values."""

    parameters: dict[str, tuple[inspect.Parameter, ...]]
    primary: dict[str, str] = field(default_factory=dict)  # check id -> its recording dtype
    values: dict[tuple[str, str], dict[str, set[str]]] = field(default_factory=dict)

    def record(self, op: str, fn_params: tuple[inspect.Parameter, ...], args, kwargs) -> None:
        ctx = _calling_context()
        if ctx is None:
            return
        sig = inspect.Signature(list(fn_params))
        bound = sig.bind(*args, **kwargs)  # a check calling outside the protocol raises here
        bound.apply_defaults()
        primary = self.primary.get(ctx.check_id, PRIMARY_DTYPE) == ctx.dtype_name
        for p in fn_params:
            if primary or _is_dtype_parameter(p):
                key = (op, p.name)
                v = value_of(op, p.name, bound.arguments[p.name], bound.arguments)
                self.values.setdefault(key, {}).setdefault(ctx.check_id, set()).add(v)


class RecordingBackend:
    """A backend that passes every call to `backend` and tells `recording` what it was
    given. Everything else (name, capabilities, conventions, ...) is the backend's own."""

    def __init__(self, backend, recording: Recording):
        self._backend, self._recording = backend, recording

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        params = self._recording.parameters.get(name)
        if params is None or not callable(attr):
            return attr
        return _recorded(self._recording, name, params, attr,
                         wrap=(lambda layer: RecordingLayer(layer, self._recording))
                         if name == "batch_norm" else None)


class RecordingLayer:
    """A BatchNorm layer that records its method calls as "BatchNormLayer.<method>"."""

    def __init__(self, layer, recording: Recording):
        self._layer, self._recording = layer, recording

    def __getattr__(self, name):
        attr = getattr(self._layer, name)
        op = f"{LAYER}.{name}"
        params = self._recording.parameters.get(op)
        if params is None or not callable(attr):
            return attr
        return _recorded(self._recording, op, params, attr)


def _recorded(recording: Recording, op: str, params, fn, wrap: Callable | None = None):
    def call(*args, **kwargs):
        recording.record(op, params, args, kwargs)
        out = fn(*args, **kwargs)
        return wrap(out) if wrap is not None else out
    return call


# ---------------------------------------------------------------- running the checks
@dataclass
class Coverage:
    """The measurement: per (op, parameter), the values each check passed, and which
    checks vary the parameter (see the module docstring for the rule)."""

    backend: str
    parameters: dict[str, tuple[str, ...]]
    checks: list[str]
    values: dict[tuple[str, str], dict[str, set[str]]]
    problems: list[str]

    def varied_by(self, op: str, name: str) -> list[str]:
        per_check = self.values.get((op, name), {})
        out = []
        for check_id in self.checks:
            mine = per_check.get(check_id, set())
            others = set().union(*(v for c, v in per_check.items() if c != check_id))
            if len(mine) >= 2 or (mine - others and others):
                out.append(check_id)
        return out

    def all_values(self, op: str, name: str) -> list[str]:
        return sorted(set().union(*self.values.get((op, name), {}).values()), key=_sort_key)

    def unvaried(self) -> list[tuple[str, str]]:
        return [(op, name) for op, names in self.parameters.items() for name in names
                if not self.varied_by(op, name)]


def _claims_everything(caps: Capabilities) -> list[str]:
    full = Capabilities(ops=OPS, dtypes=DTYPES, gradients={"layer_norm", "rms_norm", "batch_norm"})
    missing = [f"{key} {sorted(set(want) - set(getattr(caps, key)))}"
               for key, want in (("ops", full.ops), ("dtypes", full.dtypes),
                                 ("gradients", full.gradients))
               if set(want) - set(getattr(caps, key))]
    missing += [flag for flag in ("no_grad_mode", "cumulative_momentum", "untracked_stats")
                if not getattr(caps, flag, False)]
    missing += [f"data_parallel {mode}" for mode in ("local", "sync")
                if mode not in getattr(caps, "data_parallel", ())]
    return missing


def _dtypes_for(check: Check) -> tuple[str, str | None]:
    domain = check.dtypes or runner.DEFAULT_DTYPES
    primary = PRIMARY_DTYPE if PRIMARY_DTYPE in domain else domain[0]
    second = next((d for d in SECOND_DTYPES if d in domain and d != primary), None)
    return primary, second


def measure(backend, *, checks: list[Check] | None = None, timeout: float = 120.0) -> Coverage:
    """Run every check once on a recording wrapper around `backend` (a correct backend
    claiming every capability) and return what each check varied."""
    missing = _claims_everything(backend.capabilities)
    if missing:
        raise ValueError(f"coverage needs a backend that claims every capability; "
                         f"{backend.name!r} lacks: {'; '.join(missing)}")
    checks = list(checks if checks is not None else all_checks())
    params = protocol_parameters()
    rec = Recording(parameters=params)
    loaded = registry.LoadedBackend(str(backend.name), "coverage",
                                    backend=RecordingBackend(backend, rec))
    problems: list[str] = []

    def run(check, dtype):
        for r in runner.run_check(loaded, check, dtype, seed=SEED, examples=EXAMPLES,
                                  timeout=timeout):
            if r.status != "pass":
                problems.append(f"{check.id} [{dtype}] {r.case}: {r.status}: {r.message[:200]}")

    dtype_params = [(op, p.name) for op, ps in params.items() for p in ps if _is_dtype_parameter(p)]
    with seed_only_draws():
        for check in checks:
            primary, _ = _dtypes_for(check)
            rec.primary[check.id] = primary
            run(check, primary)
        for check in checks:  # the dtype parameters: once more, in a second dtype
            _, second = _dtypes_for(check)
            if second and any(check.id in rec.values.get(key, {}) for key in dtype_params):
                run(check, second)
    return Coverage(backend=f"{backend.name} ({getattr(backend, 'version', '')})",
                    parameters={op: tuple(p.name for p in ps) for op, ps in params.items()},
                    checks=[c.id for c in checks], values=rec.values, problems=problems)


# ---------------------------------------------------------------- the table
def _summary(values: list[str], limit: int = 8) -> str:
    arrays = [v for v in values if v.startswith("array")]
    rest = [v for v in values if not v.startswith("array")]
    parts = rest[:limit] + ([f"... {len(rest) - limit} more"] if len(rest) > limit else [])
    if arrays:
        parts.append(f"{len(arrays)} array{'s' if len(arrays) != 1 else ''}")
    return ", ".join(parts) if parts else "never passed"


def markdown_rows(cov: Coverage) -> list[str]:
    """One Markdown table row per (op, parameter): the checks that vary it ("**none**"
    when no check does) and the values all checks passed."""
    rows = ["| op | parameter | varied by | values passed (all checks) |",
            "| --- | --- | --- | --- |"]
    for op, names in cov.parameters.items():
        for name in names:
            by = cov.varied_by(op, name)
            rows.append(f"| `{op}` | `{name}` | {', '.join(by) if by else '**none**'} | "
                        f"{_summary(cov.all_values(op, name))} |")
    return rows


def render(cov: Coverage) -> str:
    """docs/coverage.md: a header saying how it was made, then the table."""
    header = [
        "# Parameter coverage",
        "",
        f"Generated by `{COMMAND}`; do not edit by hand. "
        "`tests/test_coverage.py` fails when this file differs from what the code generates, "
        "or when a parameter is varied by no check.",
        "",
        f"Every check was run once ({EXAMPLES} Hypothesis examples, seed {SEED}, "
        f"{PRIMARY_DTYPE}) on a recording wrapper around the `{cov.backend}` backend. "
        "A check *varies* a parameter when it passes the parameter two distinct values, or a "
        "value no other check passes while others pass another. Values are compared as a "
        "backend would see them: arrays by shape and contents (all-ones weights and all-zero "
        "biases count as None), `scale` in units of 1/sqrt(d_k), `normalized_shape` by its "
        "number of axes. The full definition is in `conformance/coverage.py`.",
        "",
    ]
    return "\n".join(header + markdown_rows(cov)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normspec.conformance.coverage",
                                     description="Print the parameter-coverage table (Markdown).")
    parser.add_argument("--backend", default=DEFAULT_BACKEND,
                        help="a correct backend claiming every capability, as a name or "
                             f"module:factory (default {DEFAULT_BACKEND}, with tests/ on "
                             "PYTHONPATH)")
    args = parser.parse_args(argv)
    loaded = registry.load(args.backend)
    if not loaded.available:
        print(f"backend {args.backend!r} unavailable: {loaded.error}", file=sys.stderr)
        return 2
    cov = measure(loaded.backend)
    sys.stdout.write(render(cov))
    for p in cov.problems:
        print(f"warning: not every check passed, so coverage may be short: {p}", file=sys.stderr)
    for op, name in cov.unvaried():
        print(f"unvaried: {op}.{name}", file=sys.stderr)
    return 1 if cov.problems or cov.unvaried() else 0


if __name__ == "__main__":
    sys.exit(main())
