"""The inductor backend, kept short (a first Inductor compile takes ~15 s here): it loads,
it is opt-in (listed and runnable by name, left out of a run without --backend), and its
compiled LayerNorm and RMSNorm reproduce the worked examples E1/E2."""

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
