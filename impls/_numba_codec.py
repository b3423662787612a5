"""float16 / bfloat16 in the kernel: 16-bit patterns in, 16-bit patterns out, float32 in
between, rounded to nearest even, so a half-precision row is read and written once.

Each conversion is written directly in LLVM IR (a Numba intrinsic) in 32-bit integer
operations, float comparisons and selects, with no branch: Numba widens uint32
arithmetic to 64 bits, and a branch per element keeps a loop scalar, either of which
halved or worse the throughput of the loops that call them. Written this way LLVM
vectorizes those loops as it does the float32 ones. The float operations carry no
fast-math flag, so no rounding step can be reassociated away and NaN/inf are handled as
the bits say (callers must not add 'nnan' either, which would fold encode_bf16's NaN
test away: _numba_jit.FASTMATH leaves it out). Checked against NumPy's and ml_dtypes'
casts on every 16-bit pattern and millions of float32 (tests/test_numba_codec.py); a
NaN's payload bits are not compared, only that it stays a NaN of its sign."""

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._numba_jit import inline

#: The LLVM types the IR kernels (_numba_codec, _numba_lanes, _numba_moments,
#: _numba_norm_row) are written in.
I1, I16, I32, I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()


def i64(v):
    """An LLVM 64-bit integer constant (the IR kernels' indices and counts)."""
    return ir.Constant(I64, v)


def _host_has_f16c() -> bool:
    """Whether this CPU converts float16 in hardware (x86 F16C: vcvtph2ps/vcvtps2ph,
    IEEE conversions rounding to nearest even). Numba compiles for the host CPU and keys
    its disk cache on it, so the choice made here is the one the cached code was made
    with. Elsewhere the integer versions below are used (an LLVM half conversion there
    would call a runtime helper Numba may not link)."""
    try:
        return bool(llvm.get_host_cpu_features().get("f16c"))
    except Exception:  # noqa: BLE001 - a host LLVM cannot describe: the portable path
        return False


F16C = _host_has_f16c()


def _like(ty, scalar):
    """`scalar` (an LLVM scalar type) shaped as `ty`: itself, or a vector of as many."""
    return ir.VectorType(scalar, ty.count) if isinstance(ty, ir.VectorType) else scalar


def splat(b, value, width):
    """A vector of `width` lanes, each `value` (an LLVM scalar)."""
    vt = ir.VectorType(value.type, width)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, width), [0] * width))


def _k(ty, v):
    """The constant v of type `ty`, every lane of it when `ty` is a vector."""
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


def decode_f16_ir(b, h):
    """float16 bits (i16, or a vector of them) -> float32 (of the same shape), the IR of
    decode_f16, which vector kernels call as well (_numba_lanes)."""
    i32, f32 = _like(h.type, I32), _like(h.type, F32)
    if F16C:
        return b.fpext(b.bitcast(h, _like(h.type, F16)), f32)
    h32 = b.zext(h, i32)
    sign = b.shl(b.and_(h32, _k(i32, 0x8000)), _k(i32, 16))
    mag = b.shl(b.and_(h32, _k(i32, 0x7FFF)), _k(i32, 13))
    scaled = b.bitcast(b.fmul(b.bitcast(mag, f32), _k(f32, 2.0**112)), i32)
    special = b.or_(mag, _k(i32, 0x7F800000))
    out = b.select(b.icmp_unsigned(">=", mag, _k(i32, 0x0F800000)), special, scaled)
    return b.bitcast(b.or_(sign, out), f32)


def decode_bf16_ir(b, h):
    """bfloat16 bits (i16, or a vector of them) -> float32, the IR of decode_bf16."""
    i32 = _like(h.type, I32)
    return b.bitcast(b.shl(b.zext(h, i32), _k(i32, 16)), _like(h.type, F32))


def decode_bf16_pairs_ir(b, pairs):
    """A vector of 32-bit pairs of bfloat16 bits -> two float32 vectors as long, of the
    pairs' low (even) and high (odd) elements: a shift and a mask, where widening each
    16-bit lane to 32 bits takes a shuffle (the caller puts the elements back in order,
    as _numba_norm_row interleaves its two halves' results)."""
    f32 = _like(pairs.type, F32)
    return (b.bitcast(b.shl(pairs, _k(pairs.type, 16)), f32),
            b.bitcast(b.and_(pairs, _k(pairs.type, 0xFFFF0000)), f32))


#: The decoders' IR by format (0 float16, 1 bfloat16).
DECODE_IR = (decode_f16_ir, decode_bf16_ir)


def c_row(a, *dtypes):
    """Whether Numba type `a` is a C-contiguous 1-D array (of one of `dtypes`, if given):
    the rows the vector kernels load whole vectors from."""
    return (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
            and (not dtypes or a.dtype in dtypes))


def format_of(dec):
    """The format (0 float16, 1 bfloat16) a jitted wrapper of decode_f16/decode_bf16
    decodes, as a vector kernel's typing sees it (by the name of the function it wraps,
    _numba_rows.decode_f16/decode_bf16); None for any other function."""
    name = getattr(getattr(getattr(dec, "dispatcher", None), "py_func", None), "__name__", None)
    return {"decode_f16": 0, "decode_bf16": 1}.get(name)


def encode_f16_ir(b, v):
    """float32 (or a vector of them) -> float16 bits of the same shape, the IR of
    encode_f16."""
    i32, i16 = _like(v.type, I32), _like(v.type, I16)
    if F16C:
        return b.bitcast(b.fptrunc(v, _like(v.type, F16)), i16)
    bits = b.bitcast(v, i32)
    sign = b.and_(b.lshr(bits, _k(i32, 16)), _k(i32, 0x8000))
    a = b.and_(bits, _k(i32, 0x7FFFFFFF))
    odd = b.and_(b.lshr(a, _k(i32, 13)), _k(i32, 1))
    normal = b.lshr(b.add(b.add(b.sub(a, _k(i32, 0x38000000)), _k(i32, 0xFFF)), odd),
                    _k(i32, 13))
    half = b.fadd(b.bitcast(a, v.type), _k(v.type, 0.5))
    sub = b.sub(b.bitcast(half, i32), _k(i32, 0x3F000000))
    big = b.select(b.icmp_unsigned(">", a, _k(i32, 0x7F800000)), _k(i32, 0x7E00), _k(i32, 0x7C00))
    out = b.select(b.icmp_unsigned("<", a, _k(i32, 0x38800000)), sub, normal)
    out = b.select(b.icmp_unsigned(">=", a, _k(i32, 0x47800000)), big, out)
    return b.trunc(b.or_(sign, out), i16)


def encode_bf16_ir(b, v):
    """float32 (or a vector of them) -> bfloat16 bits of the same shape, the IR of
    encode_bf16."""
    i32 = _like(v.type, I32)
    bits = b.bitcast(v, i32)
    top = b.lshr(bits, _k(i32, 16))
    rounded = b.lshr(b.add(bits, b.add(b.and_(top, _k(i32, 1)), _k(i32, 0x7FFF))), _k(i32, 16))
    is_nan = b.fcmp_unordered("uno", v, v)
    return b.trunc(b.select(is_nan, b.or_(top, _k(i32, 0x0040)), rounded), _like(v.type, I16))


@intrinsic
def decode_f16(typingctx, h):
    """float16 bits (uint16) -> float32. Moving the exponent and mantissa 13 bits up leaves
    the exponent biased by 15: multiplying by 2^112 rebiases normals and subnormals
    alike, exactly; an all-ones exponent (inf, NaN) is set to all ones instead."""
    if h != types.uint16:
        return None

    def codegen(context, b, sig, args):
        return decode_f16_ir(b, args[0])
    return types.float32(types.uint16), codegen


@intrinsic
def decode_bf16(typingctx, h):
    """bfloat16 bits (uint16) -> float32: they are the top half of the float32's bits."""
    if h != types.uint16:
        return None

    def codegen(context, b, sig, args):
        return decode_bf16_ir(b, args[0])
    return types.float32(types.uint16), codegen


@intrinsic
def encode_f16(typingctx, v):
    """float32 -> float16 bits, rounded to nearest, ties to even. A normal result rounds
    in the integer bits (rebias 127 -> 15, add half an ulp less one plus the kept low
    bit); a subnormal one is |v| + 0.5, whose ulp (2^-24) is the float16 subnormal
    spacing, so the hardware's addition rounds it; |v| >= 65520 becomes inf (by the
    rounding carry, or the select at 65536), NaN a quiet NaN of the same sign."""
    if v != types.float32:
        return None

    def codegen(context, b, sig, args):
        return encode_f16_ir(b, args[0])
    return types.uint16(types.float32), codegen


@intrinsic
def encode_bf16(typingctx, v):
    """float32 -> bfloat16 bits, rounded to nearest, ties to even (add 0x7FFF plus the
    kept low bit, keep the top half); NaN stays a NaN of the same sign, its top half with
    the quiet bit set (the rounding carry would turn some NaNs into inf). NaN is found by
    a float comparison and keeps its own top bits: two integer operations fewer than
    masking the magnitude and building a canonical NaN, which made the bfloat16 forward's
    normalize loop 14% faster in L1 (it is integer-bound: 5.5 -> 6.3 G elements/s a core)."""
    if v != types.float32:
        return None

    def codegen(context, b, sig, args):
        return encode_bf16_ir(b, args[0])
    return types.uint16(types.float32), codegen


@inline
def decode_row(src, dst, fmt):
    """A row of 16-bit patterns (fmt 0: float16, 1: bfloat16) into float32 `dst`; the
    loop per format, so each vectorizes."""
    if fmt == 0:
        for j in range(src.shape[0]):
            dst[j] = decode_f16(src[j])
    else:
        for j in range(src.shape[0]):
            dst[j] = decode_bf16(src[j])


@inline
def encode_row(src, dst, fmt):
    """A float32 row into 16-bit patterns, rounded to nearest even."""
    if fmt == 0:
        for j in range(src.shape[0]):
            dst[j] = encode_f16(src[j])
    else:
        for j in range(src.shape[0]):
            dst[j] = encode_bf16(src[j])
