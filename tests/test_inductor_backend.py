"""The inductor backend, kept short (a first Inductor compile takes ~15 s here): it loads,
it is opt-in (listed and runnable by name, left out of a run without --backend), and its
compiled LayerNorm and RMSNorm reproduce the worked examples E1/E2, and its BatchNorm is
Inductor's arithmetic, never eager torch's."""

from __future__ import annotations

import numpy as np
import pytest
from normspec.impls import registry

pytest.importorskip("torch")


def test_inductor_is_known_but_opt_in():
    assert "inductor" in registry.discover()
    assert "inductor" in registry.OPT_IN and registry.OPT_IN["inductor"]
    assert "inductor" not in registry.default_backends()
    assert {"numpy", "torch", "onnxruntime"} <= set(registry.default_backends())


def test_E1_E2_through_compiled_modules():
    loaded = registry.load("inductor")
    assert loaded.available, loaded.error
    backend = loaded.backend
    x = np.array([[1.0, 3.0], [11.0, 13.0]], dtype=np.float32)
    np.testing.assert_allclose(backend.layer_norm(x, (2,), None, None, 0.0).output,
                               [[-1.0, 1.0], [-1.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(backend.rms_norm(x, (2,), None, 0.0).output,
                               [[0.4472136, 1.3416408], [0.9135003, 1.0795912]], rtol=1e-6)
    stats = backend.compile_stats()
    assert stats["graphs"] >= 2 and stats["calls"] == 2  # compiled, never run eagerly


def test_batch_norm_is_inductors_own_arithmetic_not_eager_torchs():
    """A bfloat16 batch whose correctly rounded output eager torch misses by one step
    (it keeps the batch statistics in bfloat16); Inductor computes them in float32. After
    a cumulative-average layer is asked for (refused: its graph break once left every
    later BatchNorm of the process running eager kernels), the compiled layer still
    gives Inductor's answer, not eager torch's."""
    import normspec.spec as spec
    from normspec.conformance.cases import ArraySpec

    backend = registry.load("inductor").backend
    eager = registry.load("torch").backend
    with pytest.raises(NotImplementedError, match="cumulative average"):
        backend.batch_norm(3, eps=1e-5, momentum=None, affine=False, track_running_stats=True,
                           dtype="bfloat16")
    x0 = ArraySpec((4, 3), 0, 1.0, 2.0).build("bfloat16")
    x1 = ArraySpec((4, 3), 1, 2.0, 2.0).build("bfloat16")

    def second_step(b):
        layer = b.batch_norm(3, eps=1e-5, momentum=0.3, affine=False, track_running_stats=True,
                             dtype="bfloat16")
        layer.forward(x0)
        return layer.forward(x1).output.astype(np.float64)

    want = spec.round_to(spec.batch_norm_train(x1.astype(np.float64), None, None, None, None,
                                               0.3, 1e-5)[0], x1.dtype).astype(np.float64)
    assert not np.array_equal(second_step(eager), want)  # the case tells them apart
    np.testing.assert_array_equal(second_step(backend), want)
