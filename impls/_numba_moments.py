"""The forward's row sums, sum (x - k) and sum (x - k)^2, in one fixed order written in
LLVM IR: the same bits in every process.

Why not loops LLVM vectorizes: it may only do so when the kernel lets it reassociate
the sums (fast-math 'reassoc'), and then the order is whatever each optimization of the
loop picks. Numba optimizes a parallel kernel's body twice: once on its own, the copy
that runs in the process that compiles it, and once linked into the kernel, the copy
its disk cache keeps and every later process runs. The two summed float64 rows in
different orders: a process that compiled the kernels and one that loaded them from the
cache gave float64 LayerNorm outputs 1 ULP apart (one row in seven, d = 1000; rows of
d = 33, 4096 and 70003 too), so the bits of a run depended on whether Numba's cache
was warm. Without 'reassoc' the two copies agreed
(measured); here there is nothing to reassociate, and _numba_jit.FASTMATH no longer
allows it anywhere.

moment_sums (float32/float64 rows, and 16-bit rows with float64 sums): LANES float64
lanes, lane l summing elements l, l + LANES, l + 2 LANES, ... of the row in turn (x
decoded and converted to float64 first, then x - k; the square added with one
rounding, a fused multiply-add); the last n mod LANES elements go in one masked step,
each into its own lane (the others add +0.0, which changes no lane: a lane starts at
+0.0, and a sum never becomes -0.0 in round-to-nearest); then the lanes are added
pairwise: the vectors as a tree, then the lanes of the one left, by halves.

block_sums (16-bit rows): the same in float32, over blocks of `block` elements from the
row's start, HALF_LANES lanes; each block's lanes added pairwise to one float32 sum,
converted to float64 and added to the row's float64 sums in block order (float32 has no
conversion per element, which made float64 sums of 16-bit rows cost as much as the
rest of the forward). A block's float32 sum then rounds at most block / HALF_LANES - 1
times in its lane (its first addition, to +0.0, is exact) and log2(HALF_LANES) times
more in the tree: 13 for blocks of 512 (_numba_rows._half_sums32 adds the terms' own).

Every operation is flagged 'contract', which none of them can use, so that Numba's
fast-math pass (it flags the float operations that have none) leaves them as written."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_codec import DECODE_IR, F32, F64, I1, I16, I32, I64, c_row, format_of, i64, splat

#: float64 lanes of moment_sums: four vectors of eight, so four additions are in flight
#: (eight vectors were 0.87-1.0x as fast on float64 rows in cache).
LANES = 32
#: float32 lanes of block_sums: four vectors of sixteen.
HALF_LANES = 64
#: Elements (and float64 lanes) of head_sum.
HEAD = 16
FLAGS = ("contract",)


def _vec(t, n):
    return ir.VectorType(t, n)


def _fma(b, ty):
    bits = 64 if ty.element == F64 else 32
    return cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ty, [ty] * 3), f"llvm.fma.v{ty.count}f{bits}")


def _masked_load(b, ptr, vt, mask):
    kind = {F32: "f32", F64: "f64", I16: "i16"}[vt.element]
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(vt, [vt.as_pointer(), I32, _vec(I1, vt.count), vt]),
        f"llvm.masked.load.v{vt.count}{kind}.p0")
    align = {F32: 4, F64: 8, I16: 2}[vt.element]
    return b.call(fn, [ptr, ir.Constant(I32, align), mask, ir.Constant(vt, None)])


def _fold(b, vectors):
    """The vectors added pairwise as a tree, then the lanes of the last by halves."""
    while len(vectors) > 1:
        vectors = [b.fadd(vectors[i], vectors[i + 1], flags=FLAGS)
                   for i in range(0, len(vectors), 2)]
    v = vectors[0]
    n = v.type.count
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), list(range(n))))
        hi = b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), list(range(n, 2 * n))))
        v = b.fadd(lo, hi, flags=FLAGS)
    return b.extract_element(v, ir.Constant(I32, 0))


class _Sums:
    """The IR of the lane sums of one row: `groups` vectors of `width` lanes of `acc`
    (F32 or F64) per sum, elements of type `elt` (F32, F64, or I16 decoded by `decode`)."""

    def __init__(self, b, x_a, elt, decode, acc, width, k, groups):
        self.b, self.x, self.elt, self.decode, self.acc, self.width = b, x_a, elt, decode, acc, width
        self.groups = groups
        vt = _vec(acc, width)
        self.zero = ir.Constant(vt, None)
        self.k = splat(b, k, width)
        self.s1 = [cgutils.alloca_once_value(b, self.zero) for _ in range(self.groups)]
        self.s2 = [cgutils.alloca_once_value(b, self.zero) for _ in range(self.groups)]
        self.fma = _fma(b, vt)

    @property
    def step(self):
        return self.groups * self.width

    def _value(self, raw):
        b = self.b
        v = self.decode(b, raw) if self.elt is I16 else raw
        if v.type.element != self.acc:
            v = b.fpext(v, _vec(self.acc, self.width))
        return b.fsub(v, self.k, flags=FLAGS)

    def _add(self, g, v):
        b = self.b
        b.store(b.fadd(b.load(self.s1[g]), v, flags=FLAGS), self.s1[g])
        b.store(b.call(self.fma, [v, v, b.load(self.s2[g])]), self.s2[g])

    def _ptr(self, j):
        vt = _vec(self.elt, self.width)
        return self.b.bitcast(self.b.gep(self.x.data, [j]), vt.as_pointer())

    def steps(self, start, count):
        """`count` whole steps from element `start`."""
        b = self.b
        with cgutils.for_range(b, count) as loop:
            base = b.add(start, b.mul(loop.index, i64(self.step)))
            for g in range(self.groups):
                raw = b.load(self._ptr(b.add(base, i64(g * self.width))),
                             align={F32: 4, F64: 8, I16: 2}[self.elt])
                self._add(g, self._value(raw))

    def rest(self, start, end):
        """Elements start .. end - 1 (fewer than a step), each into its own lane."""
        b = self.b
        with b.if_then(b.icmp_unsigned("<", start, end)):
            index = b.add(splat(b, start, self.width),
                          ir.Constant(_vec(I64, self.width), list(range(self.width))))
            limit = splat(b, end, self.width)
            for g in range(self.groups):
                first = b.add(start, i64(g * self.width))
                mask = b.icmp_unsigned("<", b.add(index, ir.Constant(
                    _vec(I64, self.width), [g * self.width] * self.width)), limit)
                raw = _masked_load(b, self._ptr(first), _vec(self.elt, self.width), mask)
                self._add(g, b.select(mask, self._value(raw), self.zero))

    def folded(self):
        """The two sums, each folded to a scalar; the lanes reset to zero."""
        out = []
        for acc in (self.s1, self.s2):
            out.append(_fold(self.b, [self.b.load(a) for a in acc]))
            for a in acc:
                self.b.store(self.zero, a)
        return out


def _row(x):
    """(element type, decoder) of row type `x`, None for others (the decoder is chosen
    at the call, by the jitted wrapper passed)."""
    return {types.float32: F32, types.float64: F64, types.uint16: I16}.get(
        getattr(x, "dtype", None))


def _decoder(xr, dec):
    """The IR decoder of 16-bit rows `xr` as `dec` names it; False where they do not match."""
    if xr.dtype != types.uint16:
        return None if dec is None or isinstance(dec, types.NoneType) else False
    fmt = format_of(dec)
    return False if fmt is None else DECODE_IR[fmt]


@intrinsic
def moment_sums(typingctx, xr, k, dec):
    """(sum (x - k), sum (x - k)^2) in float64 over the C-contiguous row `xr`: float32 or
    float64 (dec None), or 16-bit patterns decoded by `dec` (_numba_rows.decode_f16 or
    decode_bf16); k is a float64. The order is the module doc's."""
    decode = _decoder(xr, dec)
    if not (c_row(xr, types.float32, types.float64, types.uint16) and k == types.float64
            and decode is not False):
        return None
    elt = _row(xr)

    def codegen(context, b, sig, args):
        x_a = context.make_array(sig.args[0])(context, b, args[0])
        n = b.extract_value(x_a.shape, 0)
        sums = _Sums(b, x_a, elt, decode, F64, 8, args[1], groups=LANES // 8)
        whole = b.udiv(n, i64(sums.step))
        sums.steps(i64(0), whole)
        sums.rest(b.mul(whole, i64(sums.step)), n)
        return context.make_tuple(b, sig.return_type, sums.folded())
    return types.UniTuple(types.float64, 2)(xr, k, dec), codegen


@intrinsic
def block_sums(typingctx, xr, k, dec, block):
    """(sum (x - k), sum (x - k)^2) in float64 over the C-contiguous 16-bit row `xr`
    decoded by `dec`, each block of `block` elements (a constant multiple of HALF_LANES)
    summed in float32 first (the module doc's order); k is a float32."""
    decode = _decoder(xr, dec)
    if not (c_row(xr, types.uint16) and k == types.float32 and decode
            and isinstance(block, types.IntegerLiteral)
            and block.literal_value % HALF_LANES == 0 and block.literal_value > 0):
        return None
    per_block = block.literal_value // HALF_LANES

    def codegen(context, b, sig, args):
        x_a = context.make_array(sig.args[0])(context, b, args[0])
        n = b.extract_value(x_a.shape, 0)
        sums = _Sums(b, x_a, I16, decode, F32, 16, args[1], groups=HALF_LANES // 16)
        total = [cgutils.alloca_once_value(b, ir.Constant(F64, 0.0)) for _ in range(2)]

        def flush():
            for t, s in zip(total, sums.folded(), strict=True):
                b.store(b.fadd(b.load(t), b.fpext(s, F64), flags=FLAGS), t)

        size = i64(block.literal_value)
        blocks = b.udiv(n, size)
        with cgutils.for_range(b, blocks) as loop:
            sums.steps(b.mul(loop.index, size), i64(per_block))
            flush()
        start = b.mul(blocks, size)
        with b.if_then(b.icmp_unsigned("<", start, n)):
            whole = b.udiv(b.sub(n, start), i64(sums.step))
            sums.steps(start, whole)
            sums.rest(b.add(start, b.mul(whole, i64(sums.step))), n)
            flush()
        return context.make_tuple(b, sig.return_type, [b.load(t) for t in total])
    return types.UniTuple(types.float64, 2)(xr, k, dec, block), codegen


@intrinsic
def head_sum(typingctx, xr, dec):
    """The sum in float64 of the first min(n, HEAD) elements of the C-contiguous 16-bit
    row `xr` decoded by `dec`: element i in lane i, the lanes added pairwise (the module
    doc's order, in HEAD lanes): the shift of a 16-bit row's sums (_numba_rows._shift),
    at a fraction of moment_sums' cost on a row of 64."""
    decode = _decoder(xr, dec)
    if not (c_row(xr, types.uint16) and decode):
        return None

    def codegen(context, b, sig, args):
        x_a = context.make_array(sig.args[0])(context, b, args[0])
        n = b.extract_value(x_a.shape, 0)
        end = b.select(b.icmp_unsigned("<", n, i64(HEAD)), n, i64(HEAD))
        sums = _Sums(b, x_a, I16, decode, F64, 8, ir.Constant(F64, 0.0), groups=HEAD // 8)
        sums.rest(i64(0), end)
        return sums.folded()[0]
    return types.float64(xr, dec), codegen
