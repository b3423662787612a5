"""Tests that compile the numba kernels' codec the portable way (the integer float16 /
bfloat16 conversions every CPU without F16C or AVX512-BF16 uses), without leaving that
code in Numba's on-disk cache.

The choice is read from module flags when the IR is generated, and Numba's cache cannot
see it: a cached kernel compiled while the flags were patched is saved as if compiled
here, and every later process loads it. That happened: test_numba_norm_row patched the
flags for the life of a module-scoped fixture, a test in between compiled the backend's
half forward, and on a fresh cache every later float16 forward (a bench run after the
tests included) ran the portable codec, 2.1-2.4x as slow (same bits). So a test patches
the flags only around its own calls (`portable`), and hands the kernels uncached
decoders (`decoders`), never the backend's cached ones."""

from __future__ import annotations

import contextlib

import numba
import pytest


@contextlib.contextmanager
def portable(active: bool = True):
    """The codec flags patched to the portable choice while the block runs (no-op when
    not `active`)."""
    from normspec.impls import _numba_codec as codec
    from normspec.impls import _numba_norm_row as hn

    with pytest.MonkeyPatch.context() as mp:
        if active:
            mp.setattr(codec, "F16C", False)
            mp.setattr(hn, "BF16_HW", False)
        yield


def decoders():
    """Uncached wrappers of the codec's decoders, under the names the kernels' typing
    tells the format by (_numba_codec.format_of), compiled as _numba_rows' are (its
    fast-math flags), in this process only: (float16 decoder, bfloat16 decoder)."""
    from normspec.impls import _numba_codec as codec
    from normspec.impls._numba_jit import FASTMATH

    @numba.njit(fastmath=FASTMATH, inline="always")
    def decode_f16(h):
        return codec.decode_f16(h)

    @numba.njit(fastmath=FASTMATH, inline="always")
    def decode_bf16(h):
        return codec.decode_bf16(h)

    return decode_f16, decode_bf16
