"""How the numba kernels are compiled, in one place: parallel over rows, cached on disk
(a second process loads the machine code instead of compiling it again), fast-math
restricted to contraction (a multiply and an add fused into one rounding). No
reassociation: with it, the order of a sum was whatever each optimization of a loop
picked, and Numba optimizes a parallel kernel's body twice (alone, the copy the
compiling process runs, and linked into the kernel, the copy its cache keeps), so a run
that compiled the kernels and one that loaded them gave different bits; every sum is
written out in one order instead (_numba_moments, _numba_lanes) or runs element by
element. 'nnan'/'ninf' are left out on purpose, so NaN and inf propagate as IEEE
arithmetic says (the F2/F3.nan_inf check), and 'nsz', so the sign of a zero does too.
Imported only when the numba backend is made.

Numba keys a cached kernel on the source file that defines it, not on the files it calls
into: after an edit of _numba_codec.py alone (or an upgrade that changes only it), the
cached kernels of _numba_rows.py and _numba_fused.py would still run the old inlined
conversions. So normspec's kernels get cache locators of their own (the places Numba
would use) whose source stamp is a hash of every _numba_*.py file: any edit of any of
them recompiles all. Other code's numba caches are untouched."""

import hashlib
import os
import threading
import time

from numba import njit

FASTMATH = {"contract"}
KERNEL_MODULES = __name__.rsplit(".", 1)[0] + "._numba_"
HERE = os.path.dirname(os.path.abspath(__file__))


def kernel_sources_stamp(folder: str = HERE) -> str:
    """SHA-256 of every _numba_*.py file in `folder`, in name order."""
    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(folder) if n.startswith("_numba_")
                       and n.endswith(".py")):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


class _WholeKernelStamp:
    """Locator mixin: normspec's kernels only, stamped with all their sources."""

    stamp = ""

    def get_source_stamp(self):
        return ("normspec kernel sources", self.stamp)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not getattr(py_func, "__module__", "").startswith(KERNEL_MODULES):
            return None
        return super().from_function(py_func, py_file)


def _install_locators() -> bool:
    """Put the stamped locators in front of Numba's own, in Numba's order (a
    user-provided NUMBA_CACHE_DIR first, then beside the source, then user-wide).
    Numba 0.60 names those classes with a leading underscore. False (Numba's
    default behaviour kept) where this Numba lacks them."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None)
    bases = [getattr(caching, n, None) or getattr(caching, "_" + n, None) for n in
             ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
    if impl is None or None in bases:
        return False
    if any(isinstance(c, type) and issubclass(c, _WholeKernelStamp)
           for c in impl._locator_classes):
        return True
    _WholeKernelStamp.stamp = kernel_sources_stamp()
    impl._locator_classes[:0] = [type(f"NormspecKernels{b.__name__}", (_WholeKernelStamp, b), {})
                                 for b in bases]
    return True


LOCATORS_INSTALLED = _install_locators()
jit = njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)
inline = njit(fastmath=FASTMATH, inline="always", cache=True)
#: Kernels whose arithmetic must happen in the order written, whatever LLVM makes of
#: the loops (vectorized, scalar, versioned on how far apart the arrays lie): no
#: fast-math flag at all. It has to be the parallel kernel's own: a function it calls
#: is compiled with the kernel's flags when the kernel is what first compiles it (seen
#: here: a strict-declared span function, compiled first from inside a fast-math
#: prange, cached a contracted, reassociated version of itself).
jit_strict = njit(parallel=True, cache=True, nogil=True)
#: Functions called from jit_strict kernels (compiled without fast-math flags there).
strict = njit(cache=True, nogil=True)
strict_inline = njit(inline="always", cache=True)


class CompileTimer:
    """Seconds this process spent in the `compile` of the dispatchers it times: a kernel
    loaded from Numba's cache or compiled, for a new signature (the numba backend's
    compile_seconds). Numba's own "numba:compile" event misses cache loads."""

    def __init__(self):
        self.seconds = 0.0
        # per thread: a kernel's compile compiles the kernels it calls, counted once
        self._local = threading.local()

    def time(self, dispatcher):
        """`dispatcher`, its compile timed from now on (once, however often asked)."""
        if getattr(dispatcher, "_normspec_timed", False):
            return dispatcher
        compile_ = dispatcher.compile

        def timed(sig):
            local = self._local
            local.depth = getattr(local, "depth", 0) + 1
            start = time.perf_counter()
            try:
                return compile_(sig)
            finally:
                local.depth -= 1
                if local.depth == 0:
                    self.seconds += time.perf_counter() - start

        dispatcher.compile = timed
        dispatcher._normspec_timed = True
        return dispatcher


COMPILING = CompileTimer()
