"""The jax adapter's executable cache (impls/_jax_executables.py) changes no result: an
executable loaded from disk gives the bits a fresh compilation gives, every value the
trace depends on is in the key, and a bad file or a stored executable that cannot run
costs a compilation, never a result."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from normspec.impls import _jax_executables as cache_module  # noqa: E402
from normspec.impls.flax_nnx import FlaxBackend  # noqa: E402

RNG = np.random.default_rng(0)


def _backend(monkeypatch, directory) -> FlaxBackend:
    monkeypatch.setenv("NORMSPEC_JAX_CACHE", str(directory))
    return FlaxBackend()


def _calls(b: FlaxBackend, dtype=np.float32, eps=1e-5):
    """Every compiled entry point of the adapter, on a fixed input: their outputs."""
    x = (RNG.standard_normal((5, 8)) * 3 + 100).astype(dtype)
    g = RNG.standard_normal((5, 8)).astype(dtype)
    w = (1 + 0.5 * RNG.standard_normal(8)).astype(dtype)
    bias = (0.5 * RNG.standard_normal(8)).astype(dtype)
    out = [b.layer_norm(x, (8,), w, bias, eps, grad_output=g),
           b.layer_norm(x, (8,), None, None, eps),
           b.rms_norm(x, (8,), w, eps, grad_output=g),
           b.fused_add_norm(x, g, "layer_norm", (8,), w, bias, eps, grad_outputs=(g, x)),
           b.qk_norm_scores(x[None], g[None], w, None, eps, 0.25)]
    bn = b.batch_norm(8, eps=eps, momentum=0.1, affine=True, track_running_stats=True,
                      dtype=dtype, weight=w, bias=bias)
    out += [bn.forward(x, grad_output=g), bn.running_mean, bn.running_var]
    bn.training = False
    out.append(bn.forward(x))
    return out


def _flat(results) -> list[np.ndarray]:
    flat = []
    for r in results:
        items = r if isinstance(r, tuple) else [r]
        flat += [np.asarray(a) for a in items if a is not None]
    return flat


def _same_bits(a, b) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b, strict=True))


def _seeded_calls(b, **kw):
    global RNG
    RNG = np.random.default_rng(0)
    return _flat(_calls(b, **kw))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loaded_executables_give_the_bits_of_fresh_ones(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("NORMSPEC_JAX_CACHE", "off")
    fresh = _seeded_calls(FlaxBackend(), dtype=dtype)
    stored = _seeded_calls(_backend(monkeypatch, tmp_path), dtype=dtype)
    files = sorted((tmp_path / "executables").glob("*.xla"))
    assert len(files) >= 7  # one per entry point and input signature
    loaded_backend = _backend(monkeypatch, tmp_path)
    compiled = []
    monkeypatch.setattr(cache_module._Cached, "_compile",
                        lambda self, args: compiled.append(self.static) or pytest.fail(
                            "compiled although every executable was on disk"))
    loaded = _seeded_calls(loaded_backend, dtype=dtype)
    assert compiled == []
    assert _same_bits(fresh, stored)
    assert _same_bits(fresh, loaded)


def test_every_static_value_and_argument_is_in_the_key(tmp_path, monkeypatch):
    b = _backend(monkeypatch, tmp_path)
    x, w = np.ones((3, 4), np.float32), np.ones(4, np.float32)
    d = tmp_path / "executables"

    def count():
        return len(list(d.glob("*.xla")))

    b.layer_norm(x, (4,), w, w, 1e-5)
    n = count()
    b.layer_norm(x, (4,), w, w, 1e-5)
    assert count() == n  # the same call: no new executable
    for call in (lambda: b.layer_norm(x, (4,), w, w, 1e-3),  # eps, a static attribute
                 lambda: b.layer_norm(x, (4,), w, None, 1e-5),  # no bias: another module
                 lambda: b.layer_norm(np.ones((5, 4), np.float32), (4,), w, w, 1e-5),
                 lambda: b.layer_norm(x.astype(np.float64), (4,), w.astype(np.float64),
                                      w.astype(np.float64), 1e-5),
                 lambda: b.layer_norm(x, (4,), w, w, 1e-5, grad_output=x)):
        call()
        assert count() == n + 1, "a different computation found an existing executable"
        n += 1


def test_the_salt_holds_versions_sources_config_and_environment(monkeypatch):
    import flax
    import jax

    salt = cache_module.software_and_machine(jax, flax)
    assert jax.__version__ in salt and flax.__version__ in salt
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert cache_module.software_and_machine(jax, flax) != salt


def test_a_bad_file_is_a_miss(tmp_path, monkeypatch):
    b = _backend(monkeypatch, tmp_path)
    x, w = np.full((3, 4), 2.0, np.float32), np.ones(4, np.float32)
    x[:, 0] = 1.0
    want = b.layer_norm(x, (4,), w, w, 1e-5).output
    for f in (tmp_path / "executables").glob("*.xla"):
        f.write_bytes(b"not an executable")
    again = _backend(monkeypatch, tmp_path).layer_norm(x, (4,), w, w, 1e-5).output
    assert again.tobytes() == want.tobytes()


def test_a_stored_executable_that_cannot_run_is_replaced(tmp_path, monkeypatch):
    x, w = np.full((3, 4), 2.0, np.float32), np.ones(4, np.float32)
    x[:, 0] = 1.0
    want = _backend(monkeypatch, tmp_path).layer_norm(x, (4,), w, w, 1e-5).output

    class Broken:
        def __call__(self, *args):
            raise RuntimeError("NOT_FOUND: Function multiply_reduce_fusion.3 not found")

    monkeypatch.setattr(cache_module.Executables, "load", lambda self, key: Broken())
    got = _backend(monkeypatch, tmp_path).layer_norm(x, (4,), w, w, 1e-5).output
    assert got.tobytes() == want.tobytes()


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMSPEC_JAX_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    FlaxBackend().layer_norm(np.ones((2, 4), np.float32), (4,), None, None, 1e-5)
    assert list(tmp_path.rglob("*.xla")) == []


def test_prune_keeps_the_newest(tmp_path):
    import os

    for i in range(5):
        p = tmp_path / f"{i}.xla"
        p.write_bytes(b"x" * 100)
        os.utime(p, (i, i))
    cache_module.prune(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.glob("*.xla")) == ["3.xla", "4.xla"]


def test_loaded_executables_give_the_bits_of_plain_jit(tmp_path, monkeypatch):
    """The reference without the cache at all: jax.jit(f)(*args), as a user calls it."""
    import jax

    monkeypatch.setattr(cache_module.Executables, "function",
                        lambda self, static, build: jax.jit(build()))
    plain = _seeded_calls(FlaxBackend())
    monkeypatch.undo()
    _seeded_calls(_backend(monkeypatch, tmp_path))  # stores
    loaded = _seeded_calls(_backend(monkeypatch, tmp_path))
    assert _same_bits(plain, loaded)


def test_module_state_is_an_argument_not_a_baked_constant(tmp_path, monkeypatch):
    """State beside the parameters (here an offset) is passed to the executable, so two
    arrays that print alike (an array's repr keeps 8 digits) give their own results."""
    from flax import nnx

    b = _backend(monkeypatch, tmp_path)

    class Offset(nnx.Module):
        def __init__(self, value):
            self.norm = nnx.RMSNorm(4, use_scale=False, rngs=nnx.Rngs(0))
            self.offset = nnx.Variable(np.array([1.0, 2.0, 3.0, value]))

        def __call__(self, x):
            return self.norm(x) + self.offset[...]

    x = np.ones((2, 4))
    first = b._apply(Offset(1.0), x, None, [], (4,)).output
    second = _backend(monkeypatch, tmp_path)._apply(Offset(1.000000001), x, None, [], (4,)).output
    assert second[0, 3] - first[0, 3] == pytest.approx(1e-9, rel=1e-3)


def test_an_array_in_the_static_text_is_refused():
    import jax

    cache = cache_module.Executables(jax, "salt", None)
    with pytest.raises(ValueError, match="pass it as an argument"):
        cache.function(cache_module.stable_text(np.arange(3.0)), lambda: (lambda x: x))


def test_static_text_does_not_depend_on_numpy_print_options():
    """Under legacy="1.25" NumPy prints np.float32(1e-5) as the float 1e-5 prints: a
    GraphDef holding either keyed one executable on disk, and a process then ran the
    other's (found by a review). stable_text writes under NumPy's default options."""
    values = (np.float32(1e-5), 1e-5, np.arange(3.0))
    default = [cache_module.stable_text(v) for v in values]
    with np.printoptions(legacy="1.25", precision=3, floatmode="fixed", sign="+"):
        assert [cache_module.stable_text(v) for v in values] == default
    assert default[0] != default[1]
