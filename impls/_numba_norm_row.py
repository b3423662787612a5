"""The forward's normalize loop, in LLVM IR: a row of float16/bfloat16 bits decoded,
normalized in float32 and encoded, or a float32/float64 row normalized in its dtype,

    y = enc(fmuladd((dec(x) - mean) r, gamma, beta))   (LayerNorm)
    y = enc((dec(x) r) gamma)                          (RMSNorm),

every operation in the order written, in the fast-math kernel that calls it as well
(see _Row.value; fmuladd is one fused rounding where the CPU has FMA, as LLVM contracted
the compiled Python loops this replaced), one 64-byte line of output a step. What
those loops could not do:

- With `stream`, each whole aligned line of y is written with a non-temporal store
  straight from the registers (_numba_stream says why, and what that replaced).
- bfloat16 is rounded by the CPU's own instruction where it has one (x86 AVX512-BF16,
  `vcvtneps2bf16`, one instruction for the integer codec's nine operations), and a
  step of bfloat16 row and parameters is read as 32-bit pairs, not widened lane by
  lane (see _Row.pairs). The instruction flushes subnormal inputs to zero, which IEEE
  rounding does not: a step holding one is encoded again by the integer codec, whose
  bits are the instruction's for every other input, NaN included.
- Each step can prefetch a line of the row to be normalized next (`ahead`).

Measured in one process on the same arrays, against the loops it replaced (two
threads): 16-bit rows, [8192, 4096] 1.13-1.22x (float16) and 1.14-1.44x (bfloat16),
rows in cache 0.97-1.01x (float16) and 1.12-1.24x (bfloat16); float32/float64 rows
streamed, see _numba_stream; float32 rows in cache 1.00-1.12x (see UNROLL).

The elements before y's first aligned line and after its last whole step go by 8 and
then one at a time through the same operations, so an element's bits depend neither on
where the row lies nor on whether it was streamed (tests/test_numba_norm_row.py)."""

import functools

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _numba_codec as codec
from ._numba_codec import F32, F64, I1, I16, I32, I64, i64
from ._numba_stream import LINE

I8P = ir.IntType(8).as_pointer()
#: Lines a pass of the main loop writes: one a pass took 1.03-1.15x the time of LLVM's
#: own vectorized loop on float32 rows in cache, four 0.89-1.00x (one process).
UNROLL = 4
#: Elements a step of the row's ends: before its first aligned line, after its last step.
SHORT = 8
#: llvm.is.fpclass's test bits for negative and positive subnormals.
SUBNORMAL = 0x10 | 0x80


def _bfloat_type():
    """LLVM's `bfloat`, which llvmlite.ir does not name (made as its HalfType is): fptrunc
    to it is what LLVM lowers to vcvtneps2bf16. None where this llvmlite cannot make it."""
    base = getattr(ir.types, "_BaseFloatType", None)
    if base is None or not hasattr(base, "_create_instance"):
        return None

    class BFloat(base):
        null = "0.0"
        intrinsic_name = "bf16"

        def __str__(self):
            return "bfloat"

    BFloat._create_instance()
    return BFloat()


#: The oldest LLVM the bfloat16 instruction path is used with: 22 is the one it was
#: built and tested on; LLVM 14 (Numba 0.60) aborts on it (no llvm.is.fpclass, no
#: bfloat fptrunc on x86), and the versions between are untested, so they take the
#: integer codec.
BF16_HW_LLVM = (20,)


def _host_has_bf16_rounding() -> bool:
    """Whether this CPU rounds float32 to bfloat16 in one instruction (AVX512-BF16), which
    LLVM then emits for a vector fptrunc to bfloat (elsewhere it would call a runtime
    helper Numba may not link), and this LLVM is one that does so (BF16_HW_LLVM). Numba
    compiles for the host and keys its disk cache on it, as _numba_codec.F16C says."""
    try:
        return (tuple(llvm.llvm_version_info) >= BF16_HW_LLVM
                and bool(llvm.get_host_cpu_features().get("avx512bf16")))
    except Exception:  # noqa: BLE001 - a host LLVM cannot describe: the integer codec
        return False


BFLOAT = _bfloat_type()
BF16_HW = BFLOAT is not None and _host_has_bf16_rounding()


def _encode_bf16_hw(b, vs):
    """float32 vectors `vs` (a list, all of one length) -> their bfloat16 bits by the
    instruction; when any of them holds a subnormal, all by the integer codec, which
    gives the instruction's bits for every other float32 (NaN included)."""
    i16 = codec._like(vs[0].type, I16)
    hw = [b.bitcast(b.fptrunc(v, codec._like(v.type, BFLOAT)), i16) for v in vs]
    is_class = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ir.VectorType(I1, vs[0].type.count), [vs[0].type, I32]),
        f"llvm.is.fpclass.v{vs[0].type.count}f32")
    sub = [b.call(is_class, [v, ir.Constant(I32, SUBNORMAL)]) for v in vs]
    any_sub = b.call(cgutils.get_or_insert_function(
        b.module, ir.FunctionType(I1, [sub[0].type]), f"llvm.vector.reduce.or.v{vs[0].type.count}i1"),
        [functools.reduce(b.or_, sub)])
    out = [cgutils.alloca_once_value(b, h) for h in hw]
    with b.if_then(any_sub, likely=False):
        for v, o in zip(vs, out, strict=True):
            b.store(codec.encode_bf16_ir(b, v), o)
    return [b.load(o) for o in out]


def encode_vector(b, v, fmt):
    """float32 vector -> 16-bit patterns of format `fmt` (0 float16, 1 bfloat16), rounded
    to nearest even as the codec's scalar encoders round."""
    if fmt == 0:
        return codec.encode_f16_ir(b, v)
    if BF16_HW:
        return _encode_bf16_hw(b, [v])[0]
    return codec.encode_bf16_ir(b, v)


#: (LLVM element type, compute type, Numba compute type, bytes) of the rows norm_row takes.
_FLOAT_ROWS = {types.float32: (F32, F32, types.float32, 4),
               types.float64: (F64, F64, types.float64, 8)}


@intrinsic
def norm_row(typingctx, xr, w, b, m, s, yr, centre, stream, ahead, dec):
    """yr[:] = the normalized xr (see the module doc). xr, yr: float32 or float64 rows, or
    16-bit patterns of the format `dec` decodes (_numba_rows.decode_f16 / decode_bf16;
    `dec` is not read for float rows); gamma `w` and beta `b` of the row's dtype (float32
    or patterns of its format for 16-bit rows; RMSNorm, `centre` False, does not read
    b); m and s in the compute dtype (float64 for float64 rows, else float32); all rows
    C-contiguous of one length. `ahead`: how many elements after xr's start the row to
    be normalized next starts (0: none), which each step prefetches a line of.
    Anything else does not type."""
    fmt = codec.format_of(dec) if codec.c_row(xr, types.uint16) else None
    if fmt is not None:
        elt, ct, compute, size = I16, F32, types.float32, 2
        params_ok = codec.c_row(w, types.uint16, types.float32)
    elif codec.c_row(xr) and xr.dtype in _FLOAT_ROWS:
        elt, ct, compute, size = _FLOAT_ROWS[xr.dtype]
        params_ok = codec.c_row(w, xr.dtype)
    else:
        return None
    # dtypes and layouts, not whole types: those tell read-only arrays from writable ones
    if not (params_ok and codec.c_row(yr, xr.dtype) and yr.mutable and codec.c_row(b, w.dtype)
            and m == compute and s == compute
            and isinstance(ahead, types.Integer)
            and isinstance(centre, types.Boolean) and isinstance(stream, types.Boolean)):
        return None
    step = LINE // size
    params_16 = w.dtype == types.uint16

    def codegen(context, bd, sig, args):
        pairs = fmt == 1 and params_16 and BF16_HW  # as compiled now
        x_a, w_a, b_a, y_a = (context.make_array(sig.args[i])(context, bd, args[i])
                              for i in (0, 1, 2, 5))
        row = _Row(bd, fmt, ct, params_16, x_a, w_a, b_a, args[3], args[4])
        centre_v, stream_v, ahead_v = (context.cast(bd, args[i], sig.args[i], t) for i, t in
                                       ((6, types.boolean), (7, types.boolean), (8, types.int64)))
        n = bd.extract_value(x_a.shape, 0)
        addr = bd.ptrtoint(y_a.data, I64)
        aligned = bd.and_(stream_v, bd.icmp_unsigned("==", bd.and_(addr, i64(size - 1)),
                                                     i64(0)))
        head = bd.lshr(bd.and_(bd.sub(i64(0), addr), i64(LINE - 1)),
                       i64(size.bit_length() - 1))
        head = bd.select(aligned, bd.select(bd.icmp_unsigned("<", n, head), n, head), i64(0))
        whole = bd.udiv(bd.sub(n, head), i64(step))
        tail = bd.add(head, bd.mul(whole, i64(step)))
        fetch = bd.icmp_signed("!=", ahead_v, ir.Constant(ahead_v.type, 0))

        def body(j, width, ln, nontemporal, prefetch):
            if prefetch:
                _prefetch(bd, bd.gep(x_a.data, [bd.add(j, ahead_v)]))
            y = row.pairs(j, ln) if pairs and width == step else row.plain(j, width, ln)
            p = bd.bitcast(bd.gep(y_a.data, [j]), ir.VectorType(elt, width).as_pointer())
            st = bd.store(y, p, align=LINE if nontemporal else size)
            if nontemporal:
                st.set_metadata("nontemporal", bd.module.add_metadata([ir.Constant(I32, 1)]))

        def steps(start, count, width, ln, nontemporal=False, prefetch=False):
            unroll = UNROLL if width == step else 1
            with cgutils.for_range(bd, bd.udiv(count, i64(unroll))) as loop:
                for u in range(unroll):
                    j = bd.add(start, bd.mul(bd.add(bd.mul(loop.index, i64(unroll)), i64(u)),
                                             i64(width)))
                    body(j, width, ln, nontemporal, prefetch)
            if unroll > 1:
                done = bd.mul(bd.udiv(count, i64(unroll)), i64(unroll))
                with cgutils.for_range(bd, bd.sub(count, done)) as loop:
                    body(bd.add(start, bd.mul(bd.add(done, loop.index), i64(width))), width, ln,
                         nontemporal, prefetch)

        def few(start, count, ln):
            short = bd.udiv(count, i64(SHORT))
            steps(start, short, SHORT, ln)
            done = bd.mul(short, i64(SHORT))
            steps(bd.add(start, done), bd.sub(count, done), 1, ln)

        # one loop per (op, store, prefetch): a branch inside a step cost up to 13%
        for ln in (True, False):
            with bd.if_then(bd.icmp_unsigned("==", centre_v, ir.Constant(centre_v.type, ln))):
                few(i64(0), head, ln)
                for nt in (True, False):
                    with bd.if_then(bd.icmp_unsigned("==", aligned, ir.Constant(I1, nt))):
                        with bd.if_else(fetch) as (then, otherwise):
                            with then:
                                steps(head, whole, step, ln, nt, prefetch=True)
                            with otherwise:
                                steps(head, whole, step, ln, nt)
                few(tail, bd.sub(n, tail), ln)
        return context.get_dummy_value()
    return types.none(xr, w, b, m, s, yr, centre, stream, ahead, dec), codegen


class _Row:
    """The IR of one step of the formula over a row (see the module doc): 16-bit patterns
    of format `fmt` (None: float rows), computed in `ct`; gamma and beta 16-bit patterns
    too when `params_16`."""

    def __init__(self, b, fmt, ct, params_16, x_a, w_a, b_a, mean, rstd):
        self.b, self.fmt, self.ct, self.params_16 = b, fmt, ct, params_16
        self.x, self.w, self.beta, self.mean, self.rstd = x_a, w_a, b_a, mean, rstd

    def load(self, arr, j, t, width):
        p = self.b.bitcast(self.b.gep(arr.data, [j]), ir.VectorType(t, width).as_pointer())
        return self.b.load(p, align={F32: 4, F64: 8}.get(t, 2))  # pairs of halves: 2

    def element(self, arr, j, width, params=False):
        """Elements j .. j + width - 1 of a row (`params`: of gamma or beta), as `ct`."""
        if self.fmt is None or (params and not self.params_16):
            return self.load(arr, j, self.ct, width)
        return codec.DECODE_IR[self.fmt](self.b, self.load(arr, j, I16, width))

    def value(self, ln, xv, wv, bv, width):
        # flagged 'contract', which no operation here can use, so that Numba's fast-math
        # pass (it flags the float operations that have no flag, these included, in a
        # kernel compiled with fast-math) leaves them as written
        b, s_v, f = self.b, codec.splat(self.b, self.rstd, width), ("contract",)
        if not ln:
            return b.fmul(b.fmul(xv, s_v, flags=f), wv, flags=f)
        t = b.fmul(b.fsub(xv, codec.splat(b, self.mean, width), flags=f), s_v, flags=f)
        return b.call(_fmuladd(b, t.type), [t, wv, bv])

    def plain(self, j, width, ln):
        """Elements j .. j + width - 1: decoded, normalized and encoded as vectors."""
        bv = self.element(self.beta, j, width, params=True) if ln else None
        v = self.value(ln, self.element(self.x, j, width),
                       self.element(self.w, j, width, params=True), bv, width)
        return v if self.fmt is None else encode_vector(self.b, v, self.fmt)

    def pairs(self, j, ln):
        """The same for a whole step of bfloat16 row and parameters, read as 32-bit
        pairs: the even elements are a pair's low 16 bits moved up, the odd ones its high
        16 bits masked (two operations, where widening 16-bit lanes takes two shuffles);
        the two halves' encodings are interleaved back."""
        half = LINE // 4
        x2, w2 = (codec.decode_bf16_pairs_ir(self.b, self.load(a, j, I32, half))
                  for a in (self.x, self.w))
        b2 = (codec.decode_bf16_pairs_ir(self.b, self.load(self.beta, j, I32, half)) if ln
              else (None, None))
        v = [self.value(ln, x2[k], w2[k], b2[k], half) for k in (0, 1)]
        return _interleave(self.b, *_encode_bf16_hw(self.b, v))


def _prefetch(b, ptr):
    """Fetch the line at `ptr` into cache (a hint: it never faults)."""
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ir.VoidType(), [I8P, I32, I32, I32]), "llvm.prefetch.p0")
    b.call(fn, [b.bitcast(ptr, I8P), ir.Constant(I32, 0), ir.Constant(I32, 3),
                ir.Constant(I32, 1)])


def _interleave(b, lo, hi):
    n = lo.type.count
    return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 2 * n),
                                                [k // 2 + (k % 2) * n for k in range(2 * n)]))


def _fmuladd(b, ty):
    """llvm.fmuladd: one rounding where the CPU has a fused multiply-add (what 'contract'
    gave the loop this replaced), a multiply and an add where it has not."""
    bits = 64 if ty.element == F64 else 32
    return cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ty, [ty] * 3), f"llvm.fmuladd.v{ty.count}f{bits}")
