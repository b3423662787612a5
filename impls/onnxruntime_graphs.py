"""`onnxruntime`: each op as a small ONNX graph run by ONNX Runtime's CPU execution
provider: LayerNormalization (opset 17), RMSNormalization (opset 23), BatchNormalization
(opset 15; inference mode for eval, training_mode=1 for training), and QK-norm scores and
soft-capping as graphs of standard ops (RMSNormalization, Transpose, MatMul, Mul; Div,
Tanh, Mul).

Translations, and nothing else:
- axis: the trailing `normalized_shape` axes are `axis = -len(normalized_shape)`.
- absent gains: ONNX's Scale is a required input, so weight None is a Scale of ones
  (as exporters write it); bias None leaves the optional B out; BatchNorm without affine
  gets scale ones and bias zeros.
- momentum: ONNX's momentum weights the old running value, so ONNX gets 1 - a; the
  spec's momentum=None (a = 1/t at the t-th training forward) becomes 1 - 1/t, with t
  counted here, as PyTorch counts num_batches_tracked for the same purpose.
- modes: eval with running statistics is inference mode; training is training_mode=1,
  whose running-mean/variance outputs become the layer's state; track_running_stats=False
  runs training_mode=1 in both modes and keeps no statistics.
- scale and cap enter the QK and soft-capping graphs as scalars of the input's dtype,
  since ONNX's Mul and Div take operands of one type.
ONNX keeps epsilon and momentum as float32 attributes whatever the input dtype; ORT's
training-mode running variance is the biased one and it trains on one value per
channel: conventions declared, not corrected. No gradients: ORT here is inference.
"""

from __future__ import annotations

import numpy as np

from ._onnx_sessions import Sessions, import_onnxruntime
from .protocol import NORM_OPS, Backend, BatchNormLayer, Capabilities, Conventions, Result

ALL = {"float16", "bfloat16", "float32", "float64"}
NO_BF16 = {"float16", "float32", "float64"}  # ORT's CPU provider has no bfloat16 Mul,
# MatMul, Tanh or BatchNormalization kernel; LayerNormalization is the one it has


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    capabilities = Capabilities(
        ops=NORM_OPS, dtypes=NO_BF16, op_dtypes={"layer_norm": ALL},
        cumulative_momentum=True, untracked_stats=True)
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-5, "batch_norm": 1e-5},
        native_momentum="momentum=0.9 weights the old running value (1 - PyTorch's)",
        running_var_estimator="biased",
        half_compute_dtype="float32 for LayerNormalization/RMSNormalization (stash_type=1); "
                           "other float16 ops as ORT's CPU kernels (or inserted casts) do",
        parameter_dtype="float32",
        momentum_held_as="old",
        single_value_batch="accepts",
        reasons={
            "running_var_estimator": "ONNX Runtime's BatchNormalization in training mode "
                                     "updates the running variance with the batch variance "
                                     "it normalized with, divided by m, not m - 1.",
            "parameter_dtype": "ONNX declares epsilon and momentum as float attributes, so "
                               "a graph holds them in float32 whatever the input's dtype.",
            "single_value_batch": "ONNX Runtime's training-mode BatchNormalization has no "
                                  "check on the batch size: one value per channel gives a "
                                  "variance of 0 and trains without an error.",
        },
    )

    def __init__(self):
        onnx, ort = import_onnxruntime()
        self.sessions = Sessions(onnx, ort)
        self.helper = onnx.helper
        self.version = f"onnxruntime {ort.__version__}, onnx {onnx.__version__}"

    def compile_seconds(self) -> float:
        """Building sessions: graph checks, optimization and kernel setup per graph."""
        return self.sessions.seconds

    # ------------------------------------------------------------ helpers
    def _node(self, op, inputs, outputs, **attrs):
        return self.helper.make_node(op, inputs, outputs, **attrs)

    @staticmethod
    def _no_gradients(grad_output):
        if grad_output is not None:
            raise NotImplementedError("ONNX Runtime inference sessions return no gradients")

    @staticmethod
    def _gain(w, shape, dtype):
        return np.ones(shape, dtype) if w is None else w

    # ------------------------------------------------------------ ops
    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        self._no_gradients(grad_output)
        shape, dt = tuple(normalized_shape), x.dtype
        axis, has_bias = -len(shape), bias is not None
        names = ["x", "scale"] + (["bias"] if has_bias else [])

        def build():
            node = self._node("LayerNormalization", names, ["y"], axis=axis, epsilon=float(eps))
            return [node], [(n, dt) for n in names], [("y", dt)], 17

        s = self.sessions.get(("layer_norm", dt.name, axis, float(eps), has_bias), build)
        feeds = {"x": x, "scale": self._gain(weight, shape, dt)}
        if has_bias:
            feeds["bias"] = bias
        return Result(self.sessions.run(s, feeds, [("y", x.shape, dt)])[0])

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        self._no_gradients(grad_output)
        shape, dt = tuple(normalized_shape), x.dtype
        axis = -len(shape)

        def build():
            node = self._node("RMSNormalization", ["x", "scale"], ["y"], axis=axis,
                              epsilon=float(eps))
            return [node], [("x", dt), ("scale", dt)], [("y", dt)], 23

        s = self.sessions.get(("rms_norm", dt.name, axis, float(eps)), build)
        feeds = {"x": x, "scale": self._gain(weight, shape, dt)}
        return Result(self.sessions.run(s, feeds, [("y", x.shape, dt)])[0])

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        dt, d, rank = q.dtype, q.shape[-1], q.ndim
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]

        def build():
            nodes = [
                self._node("RMSNormalization", ["q", "q_scale"], ["q_hat"], axis=-1,
                           epsilon=float(eps)),
                self._node("RMSNormalization", ["k", "k_scale"], ["k_hat"], axis=-1,
                           epsilon=float(eps)),
                self._node("Transpose", ["k_hat"], ["k_hat_t"], perm=perm),
                self._node("MatMul", ["q_hat", "k_hat_t"], ["dots"]),
                self._node("Mul", ["dots", "scale"], ["scores"]),
            ]
            inputs = [(n, dt) for n in ("q", "k", "q_scale", "k_scale", "scale")]
            return nodes, inputs, [("scores", dt)], 23

        s = self.sessions.get(("qk_norm_scores", dt.name, rank, float(eps)), build)
        feeds = {"q": q, "k": k, "q_scale": self._gain(q_weight, (d,), dt),
                 "k_scale": self._gain(k_weight, (d,), dt), "scale": np.asarray(scale, dt)}
        out_shape = q.shape[:-1] + (k.shape[-2],)
        return self.sessions.run(s, feeds, [("scores", out_shape, dt)])[0]

    def softcap(self, scores, cap):
        dt = scores.dtype

        def build():
            nodes = [self._node("Div", ["s", "cap"], ["ratio"]),
                     self._node("Tanh", ["ratio"], ["t"]),
                     self._node("Mul", ["cap", "t"], ["capped"])]
            return nodes, [("s", dt), ("cap", dt)], [("capped", dt)], 17

        s = self.sessions.get(("softcap", dt.name), build)
        feeds = {"s": scores, "cap": np.asarray(cap, dt)}
        return self.sessions.run(s, feeds, [("capped", scores.shape, dt)])[0]

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        dt = np.dtype(dtype)
        if dt.name not in self.capabilities.dtypes_of("batch_norm"):
            raise NotImplementedError(f"no CPU BatchNormalization kernel for {dt.name}")
        w = self._gain(weight if affine else None, (num_features,), dt)
        b = np.zeros(num_features, dt) if bias is None or not affine else bias
        return OrtBatchNorm(self, num_features, dt, float(eps), momentum, w, b,
                            track_running_stats)

    def batch_norm_session(self, dt, eps, onnx_momentum):
        """Inference mode (onnx_momentum None) or training mode at that momentum."""
        names = ["x", "scale", "bias", "mean", "var"]
        training = onnx_momentum is not None

        def build():
            attrs = dict(epsilon=eps)
            outs = ["y"]
            if training:
                attrs.update(momentum=float(onnx_momentum), training_mode=1)
                outs += ["running_mean", "running_var"]
            node = self._node("BatchNormalization", names, outs, **attrs)
            return [node], [(n, dt) for n in names], [(o, dt) for o in outs], 15

        key = ("batch_norm", dt.name, eps, None if not training else float(onnx_momentum))
        return self.sessions.get(key, build)


class OrtBatchNorm(BatchNormLayer):
    """The layer's state (gains, running statistics) lives here as NumPy arrays and is fed
    to each call; training-mode calls return the new running statistics."""

    def __init__(self, backend, c, dt, eps, momentum, weight, bias, track):
        self.b, self.c, self.dt, self.eps, self.momentum = backend, c, dt, eps, momentum
        self.weight, self.bias, self.track = weight, bias, track
        self.mean = np.zeros(c, dt)
        self.var = np.ones(c, dt)
        self.steps = 0  # training forwards so far: momentum=None needs a = 1 / t
        self.training = True

    def _onnx_momentum(self):
        a = 1.0 / (self.steps + 1) if self.momentum is None else self.momentum
        return 1.0 - a  # ONNX weights the old running value

    def forward(self, x, grad_output=None):
        self.b._no_gradients(grad_output)
        use_batch = self.training or not self.track
        feeds = {"x": x, "scale": self.weight, "bias": self.bias, "mean": self.mean,
                 "var": self.var}
        run = self.b.sessions.run
        if not use_batch:
            s = self.b.batch_norm_session(self.dt, self.eps, None)
            return Result(run(s, feeds, [("y", x.shape, self.dt)])[0])
        s = self.b.batch_norm_session(self.dt, self.eps, self._onnx_momentum())
        stat = (self.c,)
        y, mean, var = run(s, feeds, [("y", x.shape, self.dt), ("running_mean", stat, self.dt),
                                      ("running_var", stat, self.dt)])
        if self.training and self.track:
            self.mean, self.var = mean, var
            self.steps += 1
        return Result(y)

    @property
    def running_mean(self):
        return self.mean.copy() if self.track else None

    @property
    def running_var(self):
        return self.var.copy() if self.track else None


def make_backend() -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend()


__all__ = ["OnnxRuntimeBackend", "make_backend"]
