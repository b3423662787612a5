"""The backward's row sums, sum h and sum h x_hat (h = g gamma, x_hat = (x - mean) r), in
explicit vectors of LANES lanes: lane k sums the elements k, k + LANES, k + 2 LANES, ...
of the row, in that order, whatever the compiler, the CPU or the batch (no fast-math
flag, so nothing reassociates them). Written in LLVM IR because Numba can only keep
such lanes in an array, and LLVM then loads, adds and stores every lane at every step:
in registers the same float64 sums took 23% less time.

Lanes of float32 rows (and of float16/bfloat16 rows, decoded to float32) sum
`block_steps` terms in float32 before adding them to their float64 lane: converting every
term to float64 was what the loop spent its time on. The error this adds: a lane's
float32 sum of k terms errs by at most (k - 1) u_32 times their magnitudes, with k <=
min(BLOCK_STEPS, d // LANES): none for rows of d < 2 LANES (one term per lane), at most
7 u_32 relative to sum |h| and sum |h x_hat| otherwise. That shifts dx_j = r (h_j -
mean(h) - x_hat_j mean(h x_hat)) by at most 7 u_32 r (mean|h| + |x_hat_j| mean|h x_hat|),
within the scale the tolerance table measures dL/dx at (conformance/tolerances.py,
grad_input_scale: r (max|h| + max|x_hat| mean|h x_hat| + mean|h|)), where its
'gradient' row allows at least 1 + 4 (log2 32 + 1) = 25 float32 ULPs for d >= 32 (more
for LayerNorm, kappa >= 1; for 16-bit rows the allowance is in their own, larger ULPs).
A float32 partial sum can overflow where the float64 sums do not (terms near float32's
largest, as bfloat16 and float32 rows have): the caller sums such a row again with
block_steps 1, every term straight into float64 (_numba_backward.row_sums). float64 rows
always add every term to their float64 lanes, and so do float32 rows given a float64 mean
and rstd (the BatchNorm backward): their terms are computed in float64."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_codec import DECODE_IR, F32, F64, I16, c_row, format_of, i64, splat

#: Lanes of the row sums (the backward's LANES).
LANES = 16
#: Steps of LANES elements that a float32 lane sums before its float64 lane takes it.
BLOCK_STEPS = 8


def _vec(t):
    return ir.VectorType(t, LANES)


def _format(x, cv, m):
    """(element type, compute type, decoder) of rows `x` converted by `cv`, with the mean
    `m` of the compute type; None for rows this does not know. float32 rows compute in
    float32, or in float64 with a float64 mean (the BatchNorm backward's, whose old
    float64 kernel gave finite sums where a float32 term g x_hat overflows)."""
    if x.dtype == types.float64:
        return F64, F64, None
    if x.dtype == types.float32:
        return F32, (F64 if m == types.float64 else F32), None
    fmt = format_of(cv)
    if x.dtype == types.uint16 and fmt is not None:
        return I16, F32, DECODE_IR[fmt]
    return None


@intrinsic
def lane_sums(typingctx, xr, wr, gr, m, s, lanes, whole, block_steps, cv, accumulate):
    """Sums of h and h x_hat over the first `whole` elements (a multiple of LANES) of the
    row, lane by lane, into lanes[0] and lanes[1] (float64 [2, LANES], C order): written
    over them, or with `accumulate` (a constant, 0 or 1) added to them, which is how
    several short rows share one set of lanes (the BatchNorm backward); x and g as `cv`
    reads them (decoded for 16-bit rows), computed in m's
    type as the backward's _terms computes them; float32 lanes flushed into the float64
    ones every `block_steps` steps (a constant >= 1). Rows, gamma and lanes must be
    C-contiguous, of one element type, gamma and m of the compute type: anything else
    does not type."""
    fmt = _format(xr, cv, m)
    if fmt is None or not (c_row(xr) and c_row(gr, xr.dtype) and isinstance(lanes, types.Array)
                           and lanes.ndim == 2 and lanes.layout == "C"
                           and lanes.dtype == types.float64):
        return None
    elt, ct, decode = fmt
    compute = types.float64 if ct is F64 else types.float32
    if not (c_row(wr, compute) and m == compute and s == compute
            and isinstance(block_steps, types.IntegerLiteral) and block_steps.literal_value >= 1
            and isinstance(accumulate, types.IntegerLiteral)
            and accumulate.literal_value in (0, 1)):
        return None
    per_block = block_steps.literal_value  # a constant: a run-time count cost 18% (float16)

    def codegen(context, b, sig, args):
        x_a, w_a, g_a, l_a = (context.make_array(sig.args[i])(context, b, args[i])
                              for i in (0, 1, 2, 5))
        mean, rstd = splat(b, args[3], LANES), splat(b, args[4], LANES)
        zero64, zero = ir.Constant(_vec(F64), None), ir.Constant(_vec(ct), None)

        def row_of_lanes(row):
            p = b.gep(l_a.data, [i64(row * LANES)])
            return b.bitcast(p, _vec(F64).as_pointer())
        start = ([b.load(row_of_lanes(row), align=8) for row in range(2)]
                 if accumulate.literal_value else [zero64, zero64])
        sums64 = [cgutils.alloca_once_value(b, v) for v in start]
        sums = [cgutils.alloca_once_value(b, zero) for _ in range(2)]

        def load(arr, t, j):
            p = b.bitcast(b.gep(arr.data, [j]), _vec(t).as_pointer())
            v = b.load(p, align=1)
            if t is I16:
                return decode(b, v)
            return b.fpext(v, _vec(F64)) if t is F32 and ct is F64 else v

        def step(i):
            j = b.mul(i, i64(LANES))
            h = b.fmul(load(g_a, elt, j), load(w_a, ct, j))
            t = b.fmul(h, b.fmul(b.fsub(load(x_a, elt, j), mean), rstd))
            for acc, term in zip(sums if ct is F32 else sums64, (h, t), strict=True):
                b.store(b.fadd(b.load(acc), term), acc)

        def flush():
            for acc, acc64 in zip(sums, sums64, strict=True):
                b.store(b.fadd(b.load(acc64), b.fpext(b.load(acc), _vec(F64))), acc64)
                b.store(zero, acc)

        steps = b.udiv(args[6], i64(LANES))
        if ct is F64:
            with cgutils.for_range(b, steps) as loop:
                step(loop.index)
        else:
            per = i64(per_block)
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
            b.store(b.load(acc64), row_of_lanes(row), align=8)
        return context.get_dummy_value()
    return types.none(xr, wr, gr, m, s, lanes, whole, block_steps, cv, accumulate), codegen
