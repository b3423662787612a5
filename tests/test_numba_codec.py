"""The numba kernels' in-kernel float16/bfloat16 conversions against NumPy's and
ml_dtypes' casts: every 16-bit pattern decoded, and float32 values around every
rounding boundary that matters (subnormal, normal, overflow, inf, NaN) plus random bit
patterns encoded. The conversions are branch-free bit tricks (or F16C instructions):
one wrong constant would shift a whole binade, which the conformance checks' inputs
might not reach."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

numba = pytest.importorskip("numba")

from portable_codec import portable  # noqa: E402

FORMATS = [(0, np.float16), (1, ml_dtypes.bfloat16)]


@pytest.fixture(scope="module", params=["host", "portable", "kernels"])
def codec(request):
    """The conversions as compiled here (F16C where the CPU has it) and the portable
    integer ones, which every CPU without F16C uses (chosen when the code is generated,
    so the functions below compile each way: each is called under its choice); and the
    backend's own whole-array kernels (_numba_rows.decode_all / encode_all, the
    parameters and dgamma/dbeta of a 16-bit call), as compiled here."""
    from normspec.impls import _numba_codec as c
    from normspec.impls import _numba_rows as rows

    if request.param == "kernels":
        return rows.decode_all, rows.encode_all

    @numba.njit
    def decode(a, fmt, out):
        for j in range(a.shape[0]):
            out[j] = c.decode_f16(a[j]) if fmt == 0 else c.decode_bf16(a[j])

    @numba.njit
    def encode(a, fmt, out):
        for j in range(a.shape[0]):
            out[j] = c.encode_f16(a[j]) if fmt == 0 else c.encode_bf16(a[j])
    def under_choice(fn):  # every call runs under the choice (see portable_codec)
        def call(*args):
            with portable(request.param == "portable"):
                return fn(*args)
        return call
    return under_choice(decode), under_choice(encode)


@pytest.mark.parametrize(("fmt", "dt"), FORMATS, ids=["float16", "bfloat16"])
def test_decode_every_pattern(codec, fmt, dt):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(bits.shape, np.float32)
    codec[0](bits, fmt, got)
    want = bits.view(dt).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"decoding {bits[~same][:5]} differs"


@pytest.mark.parametrize(("fmt", "dt"), FORMATS, ids=["float16", "bfloat16"])
def test_encode_rounds_to_nearest_even(codec, fmt, dt):
    rng = np.random.default_rng(0)
    sweep = np.arange(0x33000000 - 64, 0x48000000, 211, dtype=np.uint32)  # f16 range
    edges = np.array([0, 0x7F800000, 0x7F7FFFFF, 0x477FEFFF, 0x477FF000, 0x38800000,
                      0x387FFFFF, 0x33000000, 0x33000001, 0x00000001, 0x3F808000,
                      0x3F818000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF], np.uint32)
    bits = np.concatenate([sweep, edges, rng.integers(0, 1 << 32, 200_000, dtype=np.uint64)
                           .astype(np.uint32)])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    v = bits.view(np.float32)
    got = np.empty(v.shape, np.uint16)
    codec[1](v, fmt, got)
    with np.errstate(all="ignore"):
        want = v.astype(dt).view(np.uint16)
    nan = np.isnan(v)
    wrong = (got != want) & ~nan
    assert not wrong.any(), f"encoding {[hex(b) for b in bits[wrong][:5]]} differs"
    back = got[nan].view(dt).astype(np.float32)
    assert np.isnan(back).all() and (np.signbit(back) == np.signbit(v[nan])).all()
