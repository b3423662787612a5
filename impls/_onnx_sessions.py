"""Small ONNX graphs and the ONNX Runtime sessions that run them, for the `onnxruntime`
adapter: one session per graph, cached, and NumPy arrays in and out (bfloat16 too).

A graph is rank-generic where its ops allow it (inputs declared with no shape), so one
session serves every input rank and size; attributes (axis, epsilon, momentum) are
baked into the graph, so each distinct value gets its own session. Session creation is
counted and timed (`created`, `seconds`) so its cost can be reported.

The Python binding has no NumPy type for bfloat16: such arrays cross as their uint16
bits through OrtValue and IOBinding, into output buffers allocated here, which is exact.
"""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np

from .protocol import BackendUnavailable

BF16 = np.dtype(ml_dtypes.bfloat16)


def import_onnxruntime():
    """(onnx, onnxruntime), or BackendUnavailable when either is missing."""
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable(f"onnx/onnxruntime is not installed: {exc}") from exc
    return onnx, onnxruntime


class Sessions:
    """A cache of CPU inference sessions keyed by whatever identifies a graph."""

    def __init__(self, onnx, ort):
        self.onnx, self.ort = onnx, ort
        from onnx import TensorProto

        self.elem = {np.dtype(np.float16): TensorProto.FLOAT16, BF16: TensorProto.BFLOAT16,
                     np.dtype(np.float32): TensorProto.FLOAT,
                     np.dtype(np.float64): TensorProto.DOUBLE}
        self._cache: dict = {}
        self.created = 0
        self.seconds = 0.0

    def get(self, key, build):
        """The session for `key`; `build()` returns (nodes, inputs, outputs, opset), where
        inputs and outputs are (name, numpy dtype) pairs, when it is not cached yet."""
        session = self._cache.get(key)
        if session is None:
            start = time.perf_counter()
            session = self._cache[key] = self._create(*build())
            self.seconds += time.perf_counter() - start
            self.created += 1
        return session

    def _create(self, nodes, inputs, outputs, opset):
        onnx, ort = self.onnx, self.ort
        h = onnx.helper

        def value_infos(pairs):
            # shape None: any rank, so one session serves every input shape
            return [h.make_tensor_value_info(n, self.elem[np.dtype(dt)], None) for n, dt in pairs]

        graph = h.make_graph(nodes, "normspec", value_infos(inputs), value_infos(outputs))
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)],
                             ir_version=h.find_min_ir_version_for([h.make_opsetid("", opset)]))
        options = ort.SessionOptions()
        options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
        if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
            # ORT's own thread pool spins after each op as OpenMP's does, but does not read
            # OMP_WAIT_POLICY: a process that asked for passive waiting (normspec's backend
            # processes do) gets ORT's equivalent. It changes no result, only who holds a core.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            return ort.InferenceSession(model.SerializeToString(), options,
                                        providers=["CPUExecutionProvider"])
        except Exception as exc:
            # ORT's NOT_IMPLEMENTED: no CPU kernel for this op in this dtype -> unsupported
            if type(exc).__name__ == "NotImplemented":
                raise NotImplementedError(str(exc)) from exc
            raise

    def run(self, session, feeds: dict[str, np.ndarray],
            outputs: list[tuple[str, tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        """Run with NumPy feeds; `outputs` names each output with its shape and dtype
        (needed to allocate bfloat16 outputs, which the binding cannot create)."""
        if not any(np.dtype(dt) == BF16 for *_, dt in outputs) and \
                not any(a.dtype == BF16 for a in feeds.values()):
            got = session.run([n for n, *_ in outputs],
                              {k: np.ascontiguousarray(v) for k, v in feeds.items()})
            return [np.asarray(a) for a in got]
        ov, binding = self.ort.OrtValue, session.io_binding()
        for name, a in feeds.items():
            binding.bind_ortvalue_input(name, self._ortvalue(ov, np.ascontiguousarray(a)))
        buffers = []
        for name, shape, dt in outputs:
            buf = np.empty(shape, dt)
            buffers.append(buf)
            binding.bind_ortvalue_output(name, self._ortvalue(ov, buf))
        session.run_with_iobinding(binding)
        return buffers

    def _ortvalue(self, ov, a):
        if a.dtype == BF16:
            # the bits as uint16, typed bfloat16 for ORT; shares memory with `a`
            return ov.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), self.elem[BF16])
        return ov.ortvalue_from_numpy(a)
