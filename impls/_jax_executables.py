"""The `jax` adapter's compiled XLA executables, kept on disk under what determines them,
so a second run neither traces nor lowers Flax's modules again for every input shape.

Why not JAX's persistent compilation cache alone: it keys an executable on the lowered
module, so to find one JAX must first trace the Flax module and lower it to StableHLO
(~25 ms an input shape here; a full run meets ~1400 shapes, which made those two steps
most of the jax backend's time). This cache keys an executable on what the lowered module
is a function of, all of it known before tracing:

- the software: jax, jaxlib and flax versions, the source of the adapter and of this
  file, flax's configuration, every XLA_*/JAX_*/TF_*/FLAX_* environment variable, and
  every JAX configuration value as it is at each new argument signature;
- the machine: the devices JAX sees, the runtime's platform version, the CPU's model and
  feature flags (XLA compiles for the host's instruction set);
- the function: what the adapter compiles (a name and its static values) and the Flax
  module's GraphDef, which holds every static attribute (epsilon, dtypes, axes,
  use_fast_variance, ...), with object addresses taken out of its text;
- the arguments: their tree structure and every leaf's shape, dtype and weak type.

A miss compiles with `jax.jit(f).lower(*args).compile()`, the same lowering and options a
call of the jitted function uses, and stores the serialized executable. JAX's own cache
is not used beside it: an executable that JAX loaded from its cache serializes into one
that cannot run here ("Function ... not found" at the first call; measured with jaxlib
0.10.2), so every executable stored here is compiled in the process that stores it.

Nothing read from here can change a result silently: a file that cannot be read or
loaded is a miss, and an executable loaded from disk that raises when called is dropped,
its file deleted, and the call made again on a fresh compilation (the error of that
second call, if any, is the backend's). Files are written whole (a temporary file
renamed), so processes sharing the folder never read half a file. `NORMSPEC_JAX_CACHE=off`
turns the cache off (every shape compiles, as JAX without a cache does).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: the files most recently used are kept up to this size in all (a full run of the jax
#: backend, four dtypes, writes ~1400 files, ~20 MB)
MAX_BYTES = 256 << 20

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def default_directory() -> Path | None:
    """$NORMSPEC_JAX_CACHE, else ~/.cache/normspec/jax ($XDG_CACHE_HOME honoured); None
    when the variable says "off"."""
    chosen = os.environ.get("NORMSPEC_JAX_CACHE")
    if chosen and chosen.lower() == "off":
        return None
    base = chosen or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "normspec", "jax")
    return Path(base) / "executables"


#: NumPy's default print options, under which stable_text writes every repr: a scalar's
#: text depends on them (legacy="1.25" prints np.float32(1e-5) as the float 1e-5 prints,
#: so the two keyed one executable: found by a review), and a backend may set them
PRINT_OPTIONS = dict(precision=8, threshold=1000, edgeitems=3, linewidth=75, suppress=False,
                     nanstr="nan", infstr="inf", sign="-", floatmode="maxprec", legacy=False,
                     formatter=None)


def stable_text(obj) -> str:
    """repr(obj) under PRINT_OPTIONS, without object addresses, which differ from process
    to process."""
    with np.printoptions(**PRINT_OPTIONS):
        return _ADDRESS.sub("", repr(obj))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


def software_and_machine(jax, flax, *more_sources: str) -> str:
    """Everything outside the function and its arguments that an executable depends on;
    `more_sources`: files besides the adapter whose code is traced."""
    import jaxlib

    here = Path(__file__)
    sources = [p.read_bytes() for p in (here.with_name("flax_nnx.py"), here, *map(Path, more_sources))]
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("XLA_", "JAX_", "TF_", "FLAX_")))
    flax_config = sorted((k, repr(v)) for k, v in vars(getattr(flax, "config", object())).items()
                         if not k.startswith("_"))
    backend = jax.extend.backend.get_backend() if hasattr(jax, "extend") else None
    return "\n".join([
        f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}",
        *(hashlib.sha256(s).hexdigest() for s in sources), repr(env), stable_text(flax_config),
        stable_text(jax.devices()), str(getattr(backend, "platform_version", "")), _cpu()])


def jax_config(jax) -> str:
    """JAX's configuration values now (read at every new signature: a context manager
    such as jax.default_matmul_precision may change them between calls)."""
    return repr(sorted((k, repr(v)) for k, v in jax.config.values.items()))


class Executables:
    """Compiled functions by (salt, function, arguments), in memory and on disk."""

    def __init__(self, jax, salt: str, directory: Path | None):
        self.jax, self.salt, self.directory = jax, salt, directory
        self._pruned = False
        self.seconds = 0.0  # spent compiling or loading executables, for the time table

    def function(self, static: str, build: Callable[[], Callable]) -> Callable:
        """A callable like jax.jit(build()) whose executables come from this cache;
        `static` names the function and every value baked into it (stable_text of its
        GraphDef and Python constants). Arrays must be arguments, never baked in: their
        text is abbreviated (8 digits, "..." past 1000 elements), so it cannot key them."""
        if "rray(" in static or "..." in static:
            raise ValueError("an array in the static text of a cached function: pass it "
                             "as an argument (its repr cannot tell values apart)")
        return _Cached(self, static, build)

    # ---------------------------------------------------------------- disk
    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.xla"

    def load(self, key: str):
        path = self._path(key)
        if path is None:
            return None
        try:
            payload = pickle.loads(zlib.decompress(path.read_bytes()))
            from jax.experimental.serialize_executable import deserialize_and_load

            exe = deserialize_and_load(*payload)
            os.utime(path)  # used: the newest are kept (prune)
            return exe
        except Exception:  # noqa: BLE001 - absent, partial, stale: a miss either way
            return None

    def store(self, key: str, compiled) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            from jax.experimental.serialize_executable import serialize

            blob = zlib.compress(pickle.dumps(serialize(compiled)), 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            if not self._pruned:
                self._pruned = True
                prune(path.parent, MAX_BYTES)
        except Exception:  # noqa: BLE001 - an unwritable cache costs time, never a result
            pass

    def forget(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            path.unlink(missing_ok=True)


def prune(directory: Path, max_bytes: int) -> None:
    """Delete the files least recently used until the folder holds at most max_bytes,
    and temporary files an hour old (a write cut short)."""
    for p in directory.glob("*.tmp"):
        try:
            if time.time() - p.stat().st_mtime > 3600:
                p.unlink(missing_ok=True)
        except OSError:
            continue
    files = []
    for p in directory.glob("*.xla"):
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        p.unlink(missing_ok=True)
        total -= size


class _Cached:
    def __init__(self, cache: Executables, static: str, build: Callable[[], Callable]):
        self.cache, self.static, self.build = cache, static, build
        self._jitted: Callable | None = None
        self._by_signature: dict = {}

    def _compile(self, args):
        if self._jitted is None:
            self._jitted = self.cache.jax.jit(self.build())
        return self._jitted.lower(*args).compile()

    def _compiled_and_stored(self, key: str, args):
        exe = self._compile(args)
        self.cache.store(key, exe)
        return exe

    def __call__(self, *args):
        jax = self.cache.jax
        leaves, tree = jax.tree.flatten(args)
        signature = (tree, tuple((tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))
                                 for a in leaves))
        found = self._by_signature.get(signature)
        if found is None:
            start = time.perf_counter()
            key = hashlib.sha256("\n".join(
                [self.cache.salt, jax_config(jax), self.static,
                 stable_text(signature)]).encode()).hexdigest()
            exe = self.cache.load(key)
            loaded = exe is not None
            if exe is None:
                exe = self._compiled_and_stored(key, args)
            found = self._by_signature[signature] = [exe, loaded, key]
            self.cache.seconds += time.perf_counter() - start
        exe, loaded, key = found
        if not loaded:
            return exe(*args)
        try:
            return exe(*args)
        except Exception:  # noqa: BLE001 - a stored executable that cannot run: compile afresh
            self.cache.forget(key)
            start = time.perf_counter()
            exe = self._compiled_and_stored(key, args)
            self.cache.seconds += time.perf_counter() - start
            found[:] = [exe, False, key]
            return exe(*args)
