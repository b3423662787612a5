"""How the numba kernels are compiled, in one place: parallel over rows, cached on disk
(a second process loads the machine code instead of compiling it again), fast-math
restricted to reassociation, contraction and no-signed-zeros, which lets LLVM vectorize
the reductions; 'nnan'/'ninf' are left out on purpose, so NaN and inf propagate as IEEE
arithmetic says (the F2/F3.nan_inf check). Imported only when the numba backend is made."""

from numba import njit

FASTMATH = {"reassoc", "contract", "nsz"}
jit = njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
inline = njit(fastmath=FASTMATH, inline="always", cache=True)
