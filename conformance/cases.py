"""Inputs as recipes: every array a check feeds a backend is built from a small,
printable recipe, so a failure's repro snippet rebuilds exactly the same input."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from normspec.impls.protocol import np_dtype
from normspec.spec import round_to

dtype_of = np_dtype  # np.dtype for a name, bfloat16 included


def _transposed(a):
    """The last two axes swapped in memory (a no-op below rank 2)."""
    if a.ndim < 2:
        return a
    return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)


def _poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


def _strided(a):
    """Last axis with stride 2 elements: every other element of a buffer twice as wide."""
    if a.ndim < 1:
        return a
    buf = _poisoned(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    buf[..., ::2] = a
    return buf[..., ::2]


def _sliced(a):
    """A slice with an offset, as q = qkv[1:, ..., 2:] is: the view starts one leading
    row and two columns into a buffer whose rows are two elements longer than the view's
    (so the row stride is not the row length either)."""
    if a.ndim < 1:
        return a
    lead = (a.shape[0] + 1,) + a.shape[1:-1] if a.ndim >= 2 else ()
    buf = _poisoned(lead + (a.shape[-1] + 2,), a.dtype)
    view = buf[1:, ..., 2:] if a.ndim >= 2 else buf[2:]
    view[...] = a
    return view


def _split_heads(a):
    """Leading axes whose strides do not collapse to one row stride, with a unit last
    stride: [..., m, n, d] as q = qkv[..., 0, :, :].transpose(-2, -3) is, from a buffer
    [..., n, 2, m, d] (Qwen3's QK-norm input): row (i, j) lies at i d + 2 j m d, not at
    (i n + j) times any one stride. A kernel that checks only the last stride and walks
    rows at stride(-2) reads the NaN of the other half (a no-op below rank 3)."""
    if a.ndim < 3:
        return a
    *lead, m, n, d = a.shape
    buf = _poisoned((*lead, n, 2, m, d), a.dtype)
    view = np.swapaxes(buf[..., 0, :, :], -2, -3)
    view[...] = a
    return view


def _channels_last(a):
    """Axis 1 (the channel axis of BatchNorm's [N, C, ...]) innermost in memory, as
    torch's channels_last memory format stores [N, C, H, W] (a no-op below rank 3)."""
    if a.ndim < 3:
        return a
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1)


#: layout name -> how an array of the recipe's values is laid out in memory
LAYOUTS = {
    "contiguous": lambda a: a,
    "transposed": _transposed,
    "strided": _strided,
    "sliced": _sliced,
    "split_heads": _split_heads,
    "channels_last": _channels_last,
}


#: draws kept for the next use (the same recipe recurs in every dtype of a check and in
#: several cases), newest last, up to this many float64 values in all
_DRAWS_KEPT = 8 << 20
_draws: OrderedDict[tuple, np.ndarray] = OrderedDict()
_kept = [0]  # values in _draws
_draws_lock = threading.Lock()  # the pytest plugin's checks run in threads


def _normal(seed: int, shape: tuple[int, ...], mean: float, spread: float) -> np.ndarray:
    """The seeded normal draw of a recipe (read-only: callers get factor * draw, a copy)."""
    key = (seed, shape, float(mean), float(spread))
    with _draws_lock:
        draw = _draws.get(key)
        if draw is not None:
            _draws.move_to_end(key)
            return draw
    draw = np.random.default_rng(seed).normal(mean, spread, size=shape)
    draw.flags.writeable = False
    with _draws_lock:
        if key not in _draws:
            _draws[key] = draw
            _kept[0] += draw.size
        while _kept[0] > _DRAWS_KEPT and len(_draws) > 1:
            _kept[0] -= _draws.popitem(last=False)[1].size
    return draw


@dataclass(frozen=True)
class ArraySpec:
    """A seeded normal array: N(mean, spread) of `shape`, rounded once to the dtype.

    `layout` says how the same values sit in memory (see LAYOUTS); every layout but
    "contiguous" hands the backend a view, and the elements of the buffer that are not
    part of the view hold NaN, so a kernel that reads outside the view (ignoring a
    stride or an offset) gets NaN instead of a plausible number.
    """

    shape: tuple[int, ...]
    seed: int
    mean: float = 0.0
    spread: float = 1.0
    layout: str = "contiguous"
    factor: float = 1.0  # applied in float64 before rounding: the same draw, scaled

    def values64(self) -> np.ndarray:
        return self.factor * _normal(self.seed, tuple(self.shape), self.mean, self.spread)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")

    def build(self, dtype) -> np.ndarray:
        return LAYOUTS[self.layout](round_to(self.values64(), dtype_of(dtype)))

    def code(self, dtype_name: str) -> str:
        extra = f", layout={self.layout!r}" if self.layout != "contiguous" else ""
        extra += f", factor={self.factor!r}" if self.factor != 1.0 else ""
        return (f"ArraySpec(shape={tuple(self.shape)!r}, seed={self.seed}, mean={self.mean!r}, "
                f"spread={self.spread!r}{extra}).build({dtype_name!r})")


@dataclass(frozen=True)
class Literal:
    """A literal array (the document's worked examples, NaN rows, all-zero rows)."""

    values: tuple

    @property
    def shape(self):
        return np.asarray(self.values).shape

    def values64(self) -> np.ndarray:
        return np.asarray(self.values, dtype=np.float64)

    def build(self, dtype) -> np.ndarray:
        return round_to(self.values64(), dtype_of(dtype))

    def code(self, dtype_name: str) -> str:
        text = np.array2string(self.values64(), separator=", ", threshold=10**6)
        text = text.replace("nan", "np.nan").replace("inf", "np.inf")
        return f"Literal(values={text}).build({dtype_name!r})"

    @classmethod
    def of(cls, array) -> Literal:
        return cls(values=np.asarray(array, dtype=np.float64).tolist())


@dataclass(frozen=True)
class RowsAt:
    """One sample placed in a batch of others (B9): `base` with the single leading-axis
    row of `row` written at each position of `at`. Built in the dtype like its parts, so
    the placed rows are bit for bit the sample built alone."""

    base: ArraySpec
    row: ArraySpec
    at: tuple[int, ...]

    @property
    def shape(self):
        return tuple(self.base.shape)

    def values64(self) -> np.ndarray:
        v = self.base.values64()
        v[list(self.at)] = self.row.values64()[0]
        return v

    def build(self, dtype) -> np.ndarray:
        return round_to(self.values64(), dtype_of(dtype))

    def code(self, dtype_name: str) -> str:
        return f"RowsAt(base={self.base!r}, row={self.row!r}, at={tuple(self.at)!r}).build({dtype_name!r})"


def repro_snippet(*, backend_source: str, dtype_name: str, inputs: dict[str, Any],
                  calls: list[str], finding: str = "") -> str:
    """A copy-pasteable script that rebuilds the inputs and repeats the calls; it opens
    with `finding` (what the record says, as comment lines) and, for a backend loaded
    from a module of the user's, with where it must run."""
    lines = [f"# {line}" for line in finding.splitlines()]
    if ":" in backend_source:
        module = backend_source.split(":")[0]
        lines.append(f"# load({backend_source!r}) imports {module}: run this where that import "
                     "works (its folder on PYTHONPATH), as the run did")
    lines += [
        "import numpy as np",
        "import normspec.spec as spec",
        "from normspec.conformance.cases import ArraySpec, Literal, RowsAt",
        "from normspec.conformance.repro import show",
        "from normspec.impls.registry import load",
        f"loaded = load({backend_source!r})",
        "assert loaded.available, loaded.error",
        "backend = loaded.backend",
    ]
    for name, recipe in inputs.items():
        lines.append(f"{name} = {recipe.code(dtype_name) if recipe is not None else 'None'}")
    lines += calls
    return "\n".join(lines)
