"""Streaming (non-temporal) stores: why the forward writes large outputs with them, and
the fence that must follow them.

An ordinary store to a line that is not in cache first reads the line from memory (the
read-for-ownership), so a kernel that writes y while reading x moves three streams: x
in, y in, y out. A non-temporal store writes whole 64-byte lines without reading them,
and the kernel moves two. memcpy does the same for copies larger than the cache. The
forward's normalize loop (_numba_norm_row) stores each whole aligned line of a row so,
straight from its registers. History, measured here on 2 threads, one process:

- First the float32 forward normalized each row into a scratch row in L1 and copied
  that out with streaming stores: LayerNorm went from 63-71% of a copy of the same bytes
  to 77-87%, RMSNorm from 78-83% to 97-102% ([8192, 4096] and [4096, 4096]). But a row
  wider than L2 was read back from memory, not from the scratch row (one row of 2^20
  float32: 35% of the copy, against 53% unstreamed), and in the compute-bound 16-bit
  forward the extra pass cost more than it saved (LayerNorm 58-59% against 71-73%).
- Streamed from the registers, with no extra pass, the same bits: [8192, 4096]
  1.12-1.21x faster than through the scratch row (float32, float64) and 1.30-1.43x than
  ordinary stores (float16, bfloat16); rows of 16384 and 2^20 elements 1.31-1.79x
  faster than ordinary stores (float32, float64).

It does not pay where the output fits in the last-level cache: a streamed row leaves the
cache, and a later read of y has to fetch it again (a 1-4 MB output streamed at 30-39%
of the copy, against 41-53% with ordinary stores). So the forward streams outputs of at
least the last-level cache's size, of any row width (numba_kernels.stream_rows)."""

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: The cache line: a non-temporal store writes one whole, aligned.
LINE = 64
X86 = llvm.get_process_triple().startswith(("x86_64", "i386", "i686"))


@intrinsic
def store_fence(typingctx):
    """Every streamed store before it is visible to other threads before any store after
    it (x86 `sfence`; a sequentially consistent fence elsewhere): streaming stores are
    weakly ordered, so a kernel that made them calls this before another thread reads
    what they wrote (once, after its last row: a fence after every row made the
    [8192, 4096] float32 LayerNorm 10% slower)."""
    def codegen(context, b, sig, args):
        if X86:
            sfence = cgutils.get_or_insert_function(
                b.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence")
            b.call(sfence, [])
        else:
            b.fence("seq_cst")
        return context.get_dummy_value()
    return types.none(), codegen
