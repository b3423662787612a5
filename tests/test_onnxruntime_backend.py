"""The onnxruntime backend: unavailable (never an ImportError) without ONNX Runtime, its
translations (momentum, bfloat16 through OrtValue), its sessions cached per graph, and a
short conformance run with no `error` record."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest
from normspec.conformance import runner
from normspec.impls import registry
from normspec.impls.protocol import BackendUnavailable

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def ort_backend():
    loaded = registry.load("onnxruntime")
    assert loaded.available, loaded.error
    return loaded.backend


def test_missing_onnxruntime_makes_the_backend_unavailable(monkeypatch):
    from normspec.impls import onnxruntime_graphs

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    with pytest.raises(BackendUnavailable, match="onnxruntime is not installed"):
        onnxruntime_graphs.make_backend()
    loaded = registry.load("onnxruntime")
    assert not loaded.available and "BackendUnavailable" in loaded.error


def test_momentum_is_translated_and_the_variance_is_biased(ort_backend):
    layer = ort_backend.batch_norm(1, eps=1e-5, momentum=0.1, affine=False,
                                   track_running_stats=True, dtype=np.float32)
    layer.forward(np.array([[9.0], [11.0]], dtype=np.float32))
    np.testing.assert_allclose(layer.running_mean, [1.0], rtol=1e-6)  # 0.9 * 0 + 0.1 * 10
    np.testing.assert_allclose(layer.running_var, [1.0], rtol=1e-6)  # 0.9 * 1 + 0.1 * 1


def test_cumulative_momentum_averages_the_batches(ort_backend):
    layer = ort_backend.batch_norm(1, eps=1e-5, momentum=None, affine=False,
                                   track_running_stats=True, dtype=np.float64)
    for v in (2.0, 4.0, 9.0):
        layer.forward(np.array([[v - 1], [v + 1]]))
    np.testing.assert_allclose(layer.running_mean, [5.0], rtol=1e-6)


def test_bfloat16_layer_norm_crosses_as_its_bits(ort_backend):
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = np.array([[1.0, 3.0], [11.0, 13.0]], dtype=bf16)
    out = ort_backend.layer_norm(x, (2,), None, None, 0.0).output
    assert out.dtype == bf16
    np.testing.assert_array_equal(out.astype(np.float32), [[-1.0, 1.0], [-1.0, 1.0]])


def test_no_kernel_is_unsupported_not_an_error(ort_backend):
    x = np.ones((2, 4), dtype=ml_dtypes.bfloat16)
    with pytest.raises(NotImplementedError):
        ort_backend.rms_norm(x, (4,), None, 1e-5)


def test_sessions_are_reused_across_shapes(ort_backend):
    before = ort_backend.sessions.created
    for shape in ((2, 8), (3, 5, 8), (1, 2, 3, 8)):
        ort_backend.layer_norm(np.ones(shape, np.float32), (8,), None, None, 1e-3)
    assert ort_backend.sessions.created - before == 1


def test_short_conformance_run_has_no_errors():
    checks = ["F2.values", "F3.values", "F1.values", "F5.values", "F6.values", "F7.softcap",
              "F4.declared_estimator", "F4.momentum_meaning", "protocol.shape_dtype_inputs"]
    doc = runner.run(["onnxruntime"], checks=checks, dtypes=["float32"], seed=0, examples=4)
    records = doc["records"]
    assert [] == [f"{r['check']}: {r['message'][:200]}" for r in records if r["status"] == "error"]
    status = {r["check"]: r["status"] for r in records}
    # the declared biased estimator is the one ORT uses, and momentum is translated
    assert status["F4.declared_estimator"] == status["F4.momentum_meaning"] == "pass"
    assert status["F2.values"] == status["F7.softcap"] == "pass"


@pytest.mark.parametrize("policy, spinning", [("PASSIVE", "0"), ("ACTIVE", None)])
def test_sessions_wait_passively_where_the_process_asks(monkeypatch, policy, spinning):
    """normspec's backend processes set OMP_WAIT_POLICY=PASSIVE; ORT's thread pool does
    not read it, so the adapter turns ORT's spinning off itself (and only then)."""
    import onnx
    import onnxruntime
    from normspec.impls._onnx_sessions import Sessions

    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    sessions = Sessions(onnx, onnxruntime)
    node = onnx.helper.make_node("Identity", ["x"], ["y"])
    session = sessions.get("identity", lambda: ([node], [("x", np.float32)],
                                                [("y", np.float32)], 17))
    options = session.get_session_options()
    try:
        got = options.get_session_config_entry("session.intra_op.allow_spinning")
    except RuntimeError:  # "does not have configuration with key": ORT's default (spins)
        got = None
    assert got == spinning
