"""Writing a finished row to memory with non-temporal (streaming) stores.

An ordinary store to a line that is not in cache first reads the line from memory (the
read-for-ownership), so a kernel that writes y while reading x moves three streams: x
in, y in, y out. A non-temporal store writes whole 64-byte lines without reading them,
and the kernel moves two. memcpy does the same for copies larger than the cache. The
float32/float64 forward computes each row into a scratch row, which stays in L1, and
streams that row out with `stream_row`. Measured here on 2 threads, [8192, 4096] and [4096, 4096]
float32, the two ways alternated in one process: LayerNorm went from 63-71% of a copy of
the same bytes to 77-87%, RMSNorm from 78-83% to 97-102%.

It does not pay everywhere:
- When the output fits in the last-level cache, a streamed row leaves the cache, and a
  later read of y has to fetch it again. A 1-4 MB output streamed at 30-39% of the copy,
  against 41-53% with ordinary stores.
- A row wider than L2 is read back from memory, not from the scratch row in cache. One
  row of 2^20 float32 streamed at 35%, against 53% unstreamed.
- In the 16-bit forward, compute is the limit, and the extra pass over a scratch row
  cost more than the reads it saved: LayerNorm at 58-59% of the copy against 71-73%
  unstreamed ([8192, 4096] float16 and bfloat16). That forward streams each line of y
  straight from its registers instead (_numba_half_norm), with no extra pass: 1.30-1.43x
  faster than ordinary stores there (both ops and formats, one process, the same arrays).

So the caller streams outputs of at least the last-level cache's size; float32/float64
ones only when their rows are at most STREAM_ROW_BYTES (numba_kernels.stream_rows). The
bytes written are the scratch row's (float32/float64) or the registers' the unstreamed
loop would store (16-bit), so a row's bits do not depend on whether it was streamed
(tests/test_numba_stream.py, tests/test_numba_half_norm.py)."""

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
#: The cache line: a non-temporal store writes one whole, aligned.
LINE = 64
#: Rows wider than this are not streamed: their scratch row would not stay in cache.
STREAM_ROW_BYTES = 1 << 16
X86 = llvm.get_process_triple().startswith(("x86_64", "i386", "i686"))


def _copy_bytes(b, dst, src, start, count):
    with cgutils.for_range(b, count) as loop:
        k = b.add(start, loop.index)
        b.store(b.load(b.gep(src, [k])), b.gep(dst, [k]))


@intrinsic
def stream_row(typingctx, dst, src):
    """dst[:] = src[:] for two C-contiguous 1-D arrays of one dtype and length, which must
    not overlap. The whole aligned lines of dst are written with non-temporal stores,
    the bytes before the first and after the last with ordinary ones. Streaming stores
    are weakly ordered: the caller must call `store_fence` before another thread reads
    dst (once after its last row: a fence after every row made the [8192, 4096] float32
    LayerNorm 10% slower, 78% of the copy instead of 87%)."""
    if not (isinstance(dst, types.Array) and dst == src and dst.ndim == 1
            and dst.layout == "C"):
        return None

    def codegen(context, b, sig, args):
        d_arr = context.make_array(sig.args[0])(context, b, args[0])
        s_arr = context.make_array(sig.args[1])(context, b, args[1])
        item = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
        n = b.mul(b.extract_value(d_arr.shape, 0), ir.Constant(I64, item))
        d8 = b.bitcast(d_arr.data, I8.as_pointer())
        s8 = b.bitcast(s_arr.data, I8.as_pointer())
        head = b.and_(b.sub(ir.Constant(I64, 0), b.ptrtoint(d8, I64)),
                      ir.Constant(I64, LINE - 1))
        head = b.select(b.icmp_unsigned("<", n, head), n, head)
        lines = b.udiv(b.sub(n, head), ir.Constant(I64, LINE))
        _copy_bytes(b, d8, s8, ir.Constant(I64, 0), head)
        line_t = ir.VectorType(I8, LINE).as_pointer()
        nontemporal = b.module.add_metadata([ir.Constant(I32, 1)])
        with cgutils.for_range(b, lines) as loop:
            at = b.add(head, b.mul(loop.index, ir.Constant(I64, LINE)))
            v = b.load(b.bitcast(b.gep(s8, [at]), line_t), align=1)
            store = b.store(v, b.bitcast(b.gep(d8, [at]), line_t), align=LINE)
            store.set_metadata("nontemporal", nontemporal)
        tail = b.add(head, b.mul(lines, ir.Constant(I64, LINE)))
        _copy_bytes(b, d8, s8, tail, b.sub(n, tail))
        return context.get_dummy_value()
    return types.none(dst, src), codegen


@intrinsic
def store_fence(typingctx):
    """Every streamed store before it is visible to other threads before any store after
    it (x86 `sfence`; a sequentially consistent fence elsewhere)."""
    def codegen(context, b, sig, args):
        if X86:
            sfence = cgutils.get_or_insert_function(
                b.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence")
            b.call(sfence, [])
        else:
            b.fence("seq_cst")
        return context.get_dummy_value()
    return types.none(), codegen
