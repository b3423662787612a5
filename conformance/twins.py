"""The copies of its inputs a backend is called with (context.Context.call): the
originals stay the oracle's, untouched whatever the backend does, and what it wrote
into its copies is found afterwards, bit for bit, in the whole buffer a view lies in."""

from __future__ import annotations

import numpy as np


def _root(a: np.ndarray) -> np.ndarray:
    """The array whose memory `a` views (`a` itself when it owns its memory)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def twin(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(twin, its buffer, the original buffer): a copy of `a` laid out exactly as `a` is
    (the same strides, and for a view the same offset into a copy of the whole buffer it
    views, gaps included, which a check may have filled with NaN), for the backend to be
    called with. The original is never handed over, so the oracle reads the inputs as
    they were whatever the backend does to its twin, then or later (found by a review: a
    backend rewrote x after the inputs had been compared, from code the harness runs
    afterwards, and the oracle then read the rewritten x); and a write anywhere in the
    buffer, outside the view's elements too, is seen. A subclass (a masked array, a
    matrix) is handed over as a plain array: the checks pass plain arrays."""
    root = _root(a)
    if not (root.flags.c_contiguous or root.flags.f_contiguous):
        # memory this cannot copy whole (an as_strided or broadcast view, whose base is no
        # array): the elements alone, compact, and no check of the memory between them
        copy = np.array(a, order="K", subok=False)
        if not a.flags.writeable:
            copy.flags.writeable = False
        return copy, copy, None
    buffer = root.copy(order="K")
    offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    # a view of the copied buffer, as `a` is of its own (its base is the buffer: code
    # that looks for the memory a view lies in finds it as it would for `a`)
    copy = buffer if root is a else np.ndarray(a.shape, a.dtype, buffer=buffer, offset=offset,
                                               strides=a.strides)
    if not a.flags.writeable:
        copy.flags.writeable = False
    return copy, buffer, root


def modified(a: np.ndarray, copy: np.ndarray, buffer: np.ndarray,
             root: np.ndarray | None) -> str:
    """How the backend changed `copy`, a's twin, bit for bit: "" (not at all), "elements"
    (an element's bits), "memory" (the buffer's bytes outside the view's elements; not
    looked at where twin() copied the elements alone, `root` None)."""
    if np.ascontiguousarray(copy).tobytes() != np.ascontiguousarray(a).tobytes():
        return "elements"
    if root is not None and not np.array_equal(buffer.ravel(order="K").view(np.uint8),
                                               root.ravel(order="K").view(np.uint8)):
        return "memory"
    return ""
