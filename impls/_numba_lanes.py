"""The backward's row sums, sum h and sum h x_hat (h = g gamma, x_hat = (x - mean) r), in
explicit vectors of LANES lanes: lane k sums the elements k, k + LANES, k + 2 LANES, ...
of the row, in that order, whatever the compiler, the CPU or the batch (no fast-math
flag, so nothing reassociates them). Written in LLVM IR because Numba can only keep
such lanes in an array, and LLVM then loads, adds and stores every lane at every step:
in registers the same float64 sums took 23% less time.

Lanes of float32 rows (and of float16/bfloat16 rows, decoded to float32) sum BLOCK_STEPS
terms in float32 before adding them to their float64 lane: converting every term to
float64 was what the loop spent its time on. A lane's float32 partial sum of k <=
BLOCK_STEPS terms errs by at most (k - 1) u_32 times the sum of their magnitudes, at
most 7 u_32: dx takes mean(h) and mean(h x_hat), whose error reaches dx at the scale r
max|h| (the 'gradient' row of the tolerance table) at most 7 float32 ULPs that way,
while the table allows 1 + 4 (log2 d + 1) >= 5 (rows of d <= LANES have one term per
lane, summed exactly). float64 rows add every term to their float64 lanes."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_codec import decode_bf16_ir, decode_f16_ir

#: Lanes of the row sums (the backward's LANES).
LANES = 16
#: Steps of LANES elements that a float32 lane sums before its float64 lane takes it.
BLOCK_STEPS = 8

I16, I32, I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32, F64 = ir.FloatType(), ir.DoubleType()
_DECODE = {"decode_f16": decode_f16_ir, "decode_bf16": decode_bf16_ir}


def _vec(t):
    return ir.VectorType(t, LANES)


def _splat(b, t, value):
    one = b.insert_element(ir.Constant(_vec(t), ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, ir.Constant(_vec(t), ir.Undefined),
                            ir.Constant(_vec(I32), [0] * LANES))


def _format(x, cv):
    """(element type, compute type, decoder) of rows `x` converted by `cv`."""
    if x.dtype == types.float64:
        return F64, F64, None
    if x.dtype == types.float32:
        return F32, F32, None
    name = getattr(getattr(cv, "dispatcher", None), "py_func", None)
    return I16, F32, _DECODE[name.__name__]


@intrinsic
def lane_sums(typingctx, xr, wr, gr, m, s, lanes, whole, cv):
    """Sums of h and h x_hat over the first `whole` elements (a multiple of LANES) of the
    row, lane by lane, into lanes[0] and lanes[1] (float64 [2, LANES], C order); x and g
    as `cv` reads them (decoded for 16-bit rows), computed in m's type as the backward's
    _terms computes them."""
    elt, ct, decode = _format(xr, cv)

    def codegen(context, b, sig, args):
        x_a, w_a, g_a, l_a = (context.make_array(sig.args[i])(context, b, args[i])
                              for i in (0, 1, 2, 5))
        mean, rstd = _splat(b, ct, args[3]), _splat(b, ct, args[4])
        zero64, zero = ir.Constant(_vec(F64), None), ir.Constant(_vec(ct), None)
        sums64 = [cgutils.alloca_once_value(b, zero64) for _ in range(2)]
        sums = [cgutils.alloca_once_value(b, zero) for _ in range(2)]

        def load(arr, t, j):
            p = b.bitcast(b.gep(arr.data, [j]), _vec(t).as_pointer())
            v = b.load(p, align=1)
            return decode(b, v) if t is I16 else v

        def step(i):
            j = b.mul(i, ir.Constant(I64, LANES))
            h = b.fmul(load(g_a, elt, j), load(w_a, ct, j))
            t = b.fmul(h, b.fmul(b.fsub(load(x_a, elt, j), mean), rstd))
            for acc, term in zip(sums if ct is F32 else sums64, (h, t), strict=True):
                b.store(b.fadd(b.load(acc), term), acc)

        def flush():
            for acc, acc64 in zip(sums, sums64, strict=True):
                b.store(b.fadd(b.load(acc64), b.fpext(b.load(acc), _vec(F64))), acc64)
                b.store(zero, acc)

        steps = b.udiv(args[6], ir.Constant(I64, LANES))
        if ct is F64:
            with cgutils.for_range(b, steps) as loop:
                step(loop.index)
        else:
            per = ir.Constant(I64, BLOCK_STEPS)
            blocks = b.udiv(steps, per)
            with cgutils.for_range(b, blocks) as block:
                with cgutils.for_range(b, per) as loop:
                    step(b.add(b.mul(block.index, per), loop.index))
                flush()
            done = b.mul(blocks, per)
            with cgutils.for_range(b, b.sub(steps, done)) as loop:
                step(b.add(done, loop.index))
            flush()
        for row, acc64 in enumerate(sums64):
            p = b.gep(l_a.data, [ir.Constant(I64, row * LANES)])
            b.store(b.load(acc64), b.bitcast(p, _vec(F64).as_pointer()), align=8)
        return context.get_dummy_value()
    return types.none(xr, wr, gr, m, s, lanes, whole, cv), codegen
