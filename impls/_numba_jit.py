"""How the numba kernels are compiled, in one place: parallel over rows, cached on disk
(a second process loads the machine code instead of compiling it again), fast-math
restricted to reassociation, contraction and no-signed-zeros, which lets LLVM vectorize
the reductions; 'nnan'/'ninf' are left out on purpose, so NaN and inf propagate as IEEE
arithmetic says (the F2/F3.nan_inf check). Imported only when the numba backend is made.

For whoever edits the kernels: Numba's cache is keyed on the file that defines a kernel
and not on the files it calls into, so after editing only _numba_codec.py the cached
kernels of _numba_rows.py/_numba_fused.py still run the old conversions: delete the
*.nbi/*.nbc files in impls/__pycache__ (or touch the kernel files)."""

from numba import njit

FASTMATH = {"reassoc", "contract", "nsz"}
jit = njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
inline = njit(fastmath=FASTMATH, inline="always", cache=True)
