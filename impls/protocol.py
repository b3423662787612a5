"""The backend protocol: the one interface between normspec and a normalization backend.

A backend is an object with four attributes (`name`, `version`, `capabilities`,
`conventions`) and up to seven methods (`layer_norm`, `rms_norm`, `qk_norm_scores`,
`batch_norm`, `softcap`, and for the F8 wirings `encoder_layer`, a whole Transformer
encoder layer, and `fused_add_norm`, the residual add and norm that inference engines
fuse); `capabilities.ops` says which it has. One more method is
optional: `data_parallel_batch_norm` (claim family DP, BatchNorm trained on R replicas
with the framework's own collectives), offered where `capabilities.data_parallel`
names its modes. Arrays cross the
boundary as NumPy arrays in the dtype under test (bfloat16 as `ml_dtypes.bfloat16`);
devices and framework dtypes are the adapter's business. Subclass `Backend` for the
defaults, or write the attributes yourself.

Raising NotImplementedError from an op or a layer method means "not offered for these
arguments" (a dtype the kernel lacks, say): the record is `unsupported`, never a fail,
in every check. Any other exception is an `error`, or `refused` where the backend's
conventions declare that refusal (eps = 0).

Parameter conventions are the spec's (PyTorch's): `momentum` weights the *new* batch,
`momentum=None` is a cumulative average, `eps` sits inside the square root. An adapter
translates these into its framework's terms and nothing else: it never adjusts outputs
or statistics to agree with the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import ml_dtypes
import numpy as np

#: The normalization ops.
NORM_OPS = ("layer_norm", "rms_norm", "qk_norm_scores", "batch_norm", "softcap")
#: Whole blocks built around a normalization (F8's Post-LN / Pre-LN wirings), and the
#: residual add fused with the norm that follows it (F8's Pre-LN as inference engines run it).
BLOCK_OPS = ("encoder_layer", "fused_add_norm")
OPS = NORM_OPS + BLOCK_OPS
#: The dtypes arrays cross the boundary in, in the order runs and reports list them.
DTYPES = ("float32", "float16", "bfloat16", "float64")
#: Optional methods beyond OPS, each offered where its capability says so.
OPTIONAL_METHODS = ("data_parallel_batch_norm",)
#: BatchNorm under data parallelism: "local" (each replica normalizes its own shard,
#: only the gradients are all-reduced) and "sync" (cross-replica statistics).
DATA_PARALLEL_MODES = ("local", "sync")
#: What replicas do with BatchNorm's running statistics (buffers) between forwards.
DATA_PARALLEL_BUFFERS = ("per_replica", "broadcast_rank0")
#: The two arithmetic contracts of fused_add_norm (Conventions.fused_residual_sum).
FUSED_RESIDUAL_SUMS = ("rounded", "float32")
#: The half-precision ones: a conforming kernel computes them in float32.
HALF_DTYPES = ("float16", "bfloat16")


def np_dtype(name) -> np.dtype:
    """The NumPy dtype for a name of DTYPES (bfloat16 is ml_dtypes')."""
    return np.dtype(ml_dtypes.bfloat16) if str(name) == "bfloat16" else np.dtype(name)


def compute_dtype(dtype) -> np.dtype:
    """The precision a conforming kernel computes `dtype` inputs in: float32 for the
    half dtypes, the dtype itself otherwise."""
    dt = np_dtype(dtype)
    return np.dtype(np.float32) if dt.name in HALF_DTYPES else dt


class BackendUnavailable(RuntimeError):
    """Raised by a factory whose framework cannot be imported or used here."""


class DataParallelResult(NamedTuple):
    """What `data_parallel_batch_norm` returns. Every field is indexed [step][replica]
    (None where no grad_outputs were given, for the gradient fields).

    replica_grad_weight / replica_grad_bias: each replica's dL/dgamma, dL/dbeta before
    the gradient all-reduce (from its own shard's forward and backward); grad_weight /
    grad_bias: what each replica holds after it, the mean over replicas
    (DistributedDataParallel's average). running_mean / running_var: each replica's
    buffers after the step."""

    output: list
    grad_input: list | None
    replica_grad_weight: list | None
    replica_grad_bias: list | None
    grad_weight: list | None
    grad_bias: list | None
    running_mean: list
    running_var: list


class Result(NamedTuple):
    """What an op returns: the output and, when a grad_output was given, the gradients
    with respect to the input, the weight and the bias (None where not applicable)."""

    output: np.ndarray
    grad_input: np.ndarray | None = None
    grad_weight: np.ndarray | None = None
    grad_bias: np.ndarray | None = None


class FusedAddNormResult(NamedTuple):
    """What `fused_add_norm` returns: `output` (the normalized sum) and `residual` (the sum
    x + residual written back in x's dtype) and, when grad_outputs were given, dL/dx,
    dL/dresidual (the same value, as the sum passes its gradient to both addends; both
    are returned because a kernel writes both), dL/dgamma and dL/dbeta (None where the
    parameter is)."""

    output: np.ndarray
    residual: np.ndarray
    grad_input: np.ndarray | None = None
    grad_residual: np.ndarray | None = None
    grad_weight: np.ndarray | None = None
    grad_bias: np.ndarray | None = None


def _names(values, known: tuple[str, ...], what: str) -> frozenset[str]:
    if isinstance(values, str):
        raise TypeError(f"{what} takes a set of names, got the string {values!r}")
    names = frozenset(values)
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(f"{what} names unknown {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(known)})")
    return names


@dataclass(frozen=True)
class Capabilities:
    """What a backend implements. Anything outside is reported as `unsupported`, and
    the defaults claim nothing: a backend lists what it offers.

    ops: subset of OPS. dtypes: the dtypes of every op (subset of DTYPES). gradients: ops
    whose VJPs it returns (in the op's dtypes).
    op_dtypes: per op, dtypes that replace `dtypes` for that op, e.g.
        {"layer_norm": {"float32", "bfloat16"}} for a runtime with bfloat16 LayerNorm only.
    gradient_dtypes: per op, the dtypes its gradients come in, where fewer than the op's.
    max_rows: the most rows (normalized groups of LayerNorm and RMSNorm, q and k rows of
        QK-norm) one call takes in reasonable time, where the backend has such a limit
        (an interpreter that runs every kernel program as Python); None: no limit. Cases
        with more rows are recorded unsupported with `max_rows_reason`, never skipped
        silently.
    no_grad_mode: BatchNorm has a forward under the framework's no-grad switch (B6).
    cumulative_momentum: BatchNorm accepts momentum=None. untracked_stats: BatchNorm
    accepts track_running_stats=False.
    data_parallel: modes of `data_parallel_batch_norm` it offers (subset of
    DATA_PARALLEL_MODES); empty: no data-parallel BatchNorm (the DP checks are
    unsupported).
    Sets may be given as any iterable of names; unknown names raise at once.
    """

    ops: frozenset[str] = frozenset()
    dtypes: frozenset[str] = frozenset()
    gradients: frozenset[str] = frozenset()
    op_dtypes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    gradient_dtypes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    no_grad_mode: bool = False
    cumulative_momentum: bool = False
    untracked_stats: bool = False
    max_rows: int | None = None
    max_rows_reason: str = ""
    data_parallel: frozenset[str] = frozenset()

    def __post_init__(self):
        fix = partial(object.__setattr__, self)
        fix("data_parallel", _names(self.data_parallel, DATA_PARALLEL_MODES,
                                    "capabilities.data_parallel"))
        fix("ops", _names(self.ops, OPS, "capabilities.ops"))
        fix("dtypes", _names(self.dtypes, DTYPES, "capabilities.dtypes"))
        fix("gradients", _names(self.gradients, OPS, "capabilities.gradients"))
        for key in ("op_dtypes", "gradient_dtypes"):
            table = dict(getattr(self, key))
            _names(table, OPS, f"capabilities.{key}")
            fix(key, MappingProxyType({op: _names(v, DTYPES, f"capabilities.{key}[{op!r}]")
                                       for op, v in table.items()}))

    def dtypes_of(self, op: str) -> frozenset[str]:
        """The dtypes `op` runs in (none if the backend lacks the op)."""
        if op not in self.ops:
            return frozenset()
        return self.op_dtypes.get(op, self.dtypes)

    def supports(self, op: str, dtype: str) -> bool:
        return dtype in self.dtypes_of(op)

    def has_gradient(self, op: str, dtype: str) -> bool:
        return (op in self.gradients and self.supports(op, dtype)
                and dtype in self.gradient_dtypes.get(op, self.dtypes_of(op)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": sorted(self.ops), "dtypes": sorted(self.dtypes),
            "gradients": sorted(self.gradients),
            "op_dtypes": {op: sorted(v) for op, v in self.op_dtypes.items()},
            "gradient_dtypes": {op: sorted(v) for op, v in self.gradient_dtypes.items()},
            "no_grad_mode": self.no_grad_mode,
            "cumulative_momentum": self.cumulative_momentum,
            "untracked_stats": self.untracked_stats,
            "max_rows": self.max_rows, "max_rows_reason": self.max_rows_reason,
            "data_parallel": sorted(self.data_parallel),
        }


@dataclass(frozen=True)
class Conventions:
    """What a backend says about itself.

    Verified by contract checks; where a verified convention contradicts the spec, the
    records it explains are `deviation` with the reason given in `reasons`, and only
    those (records it does not explain stay `fail`):
      running_var_estimator: "unbiased" (m - 1, as F4 says) or "biased" (m).
      eps_zero: per op, whether eps = 0 is accepted ("batch_norm" meaning training); a
        declared refusal turns those records into `refused`.
      parameter_dtype: the dtype eps and momentum are held in where coarser than the
        input's (ONNX keeps them as float32 attributes); None: as given. The oracle is
        then evaluated at the rounded values, and the record says so.
      momentum_held_as: "new" if the framework's momentum weights the new batch (held as
        a, PyTorch) or "old" if it weights the old value (held as 1 - a: ONNX, Keras,
        Flax); with parameter_dtype, a momentum held as 1 - a rounds to 1 - round(1 - a).
      single_value_batch: "raises" (B3: training on one value per channel is an error)
        or "accepts".
      batch_invariant: a sample's output is bit for bit the same whatever else is in its
        batch (B9), for every op without batch statistics.
      deterministic: the same call twice gives the same bits.
      data_parallel_buffers: what data-parallel replicas do with BatchNorm's running
        statistics (DP3): "per_replica" (each keeps its own and continues from it) or
        "broadcast_rank0" (at the start of every forward each replica's buffers are
        replaced by replica 0's: DistributedDataParallel's broadcast_buffers=True).
      sync_batch_norm_refused: cross-replica BatchNorm raises here (torch's
        SyncBatchNorm on CPU); a declared refusal turns those records into `refused`.
      fused_residual_sum: which arithmetic contract `fused_add_norm` follows (F8), given
        s = x + residual, written back as residual' = round_T(s) in both:
        "rounded": the norm is taken of round_T(s), the sum rounded to the activation
          dtype T: what eager framework code runs (`r = x + residual; y = norm(r)`), and
          what vLLM's fused CUDA kernel did until vllm #52104 was fixed;
        "float32": the norm (statistics and the normalized values alike) is taken of the
          unrounded sum, as vLLM's native IR computes it (x and residual upcast to
          float32, added, only the residual written back rounded), and its CUDA kernel
          since that fix.
        Both are conforming; the checks compare against the declared one, so a backend
        that follows the other contract (or mixes them) fails in float16 and bfloat16,
        where the two differ. In float32 and float64 they differ by one rounding in the
        compute precision, which no bound tells apart.
    Declared, not verified (shown in the report as the backend's word):
      default_eps (per op, a number or a description), native_momentum (in words),
      half_compute_dtype (what float16/bfloat16 inputs are computed in).
    reasons: per convention name, why the backend does it; the report shows it with
      every record that convention explains.
    """

    default_eps: dict[str, Any] = field(default_factory=dict)
    native_momentum: str = "weight of the new batch (PyTorch's meaning)"
    running_var_estimator: str = "unbiased"
    eps_zero: dict[str, bool] = field(default_factory=lambda: {op: True for op in OPS})
    half_compute_dtype: str = "float32"
    parameter_dtype: str | None = None
    momentum_held_as: str = "new"
    single_value_batch: str = "raises"
    batch_invariant: bool = True
    deterministic: bool = True
    data_parallel_buffers: str = "per_replica"
    sync_batch_norm_refused: bool = False
    fused_residual_sum: str = "rounded"
    reasons: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.running_var_estimator not in ("unbiased", "biased"):
            raise ValueError("conventions.running_var_estimator must be 'unbiased' or "
                             f"'biased', got {self.running_var_estimator!r}")
        if self.single_value_batch not in ("raises", "accepts"):
            raise ValueError("conventions.single_value_batch must be 'raises' or 'accepts', "
                             f"got {self.single_value_batch!r}")
        if self.momentum_held_as not in ("new", "old"):
            raise ValueError("conventions.momentum_held_as must be 'new' or 'old', got "
                             f"{self.momentum_held_as!r}")
        if self.data_parallel_buffers not in DATA_PARALLEL_BUFFERS:
            raise ValueError(f"conventions.data_parallel_buffers must be one of "
                             f"{DATA_PARALLEL_BUFFERS}, got {self.data_parallel_buffers!r}")
        if self.fused_residual_sum not in FUSED_RESIDUAL_SUMS:
            raise ValueError(f"conventions.fused_residual_sum must be one of "
                             f"{FUSED_RESIDUAL_SUMS}, got {self.fused_residual_sum!r}")
        if self.parameter_dtype not in (None, *DTYPES):
            raise ValueError(f"conventions.parameter_dtype must be None or one of {DTYPES}, "
                             f"got {self.parameter_dtype!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "default_eps": dict(self.default_eps), "native_momentum": self.native_momentum,
            "running_var_estimator": self.running_var_estimator,
            "eps_zero": dict(self.eps_zero), "half_compute_dtype": self.half_compute_dtype,
            "parameter_dtype": self.parameter_dtype,
            "momentum_held_as": self.momentum_held_as,
            "single_value_batch": self.single_value_batch,
            "batch_invariant": self.batch_invariant, "deterministic": self.deterministic,
            "data_parallel_buffers": self.data_parallel_buffers,
            "sync_batch_norm_refused": self.sync_batch_norm_refused,
            "fused_residual_sum": self.fused_residual_sum,
            "reasons": dict(self.reasons),
        }


class BatchNormLayer:
    """A stateful BatchNorm, channel axis 1, for inputs [N, C], [N, C, L] or [N, C, H, W].

    Starts in training mode with running_mean = 0 and running_var = 1 (None, None when
    created with track_running_stats=False).
    """

    training: bool = True

    def train(self) -> None:
        self.training = True

    def eval(self) -> None:
        self.training = False

    def forward(self, x: np.ndarray, grad_output: np.ndarray | None = None) -> Result:
        """One forward in the current mode; in training mode it updates the running
        statistics (B5). With grad_output, returns the gradients too."""
        raise NotImplementedError

    def forward_no_grad(self, x: np.ndarray) -> np.ndarray:
        """One forward under the framework's no-grad switch, mode unchanged (B6)."""
        raise NotImplementedError

    @property
    def running_mean(self) -> np.ndarray | None:
        raise NotImplementedError

    @property
    def running_var(self) -> np.ndarray | None:
        raise NotImplementedError


class NormalizationBackend(Protocol):
    """The typed interface a backend object satisfies, for a type checker to hold a
    third-party backend against. Subclassing `Backend` satisfies it with defaults; the
    ops themselves are optional and listed in `capabilities.ops` (see Backend)."""

    name: str
    version: str
    capabilities: Capabilities
    conventions: Conventions
    deviations: tuple[dict[str, str], ...]
    benchmark_skip_reason: str | None

    def prepare_benchmark(self, op: str, x: np.ndarray, normalized_shape: tuple[int, ...],
                          weight: np.ndarray | None, bias: np.ndarray | None, eps: float,
                          grad_output: np.ndarray | None = None) -> Callable[[], object] | None:
        ...


#: What a backend object must have, whether or not it subclasses Backend.
MEMBERS = ("name", "version", "capabilities", "conventions", "deviations",
           "benchmark_skip_reason", "prepare_benchmark")


class Backend:
    """Base class for a backend; override the ops it supports and say so in
    `capabilities`. The defaults claim nothing."""

    name: str = "unnamed"
    version: str = "unknown"
    capabilities: Capabilities = Capabilities()
    conventions: Conventions = Conventions()
    #: Known deviations from the spec, as data: [{"check": id, "reason": text}, ...].
    #: Built-in backends keep theirs in impls/deviations/<name>.toml instead.
    deviations: tuple[dict[str, str], ...] = ()
    #: Optional: why `normspec bench` must not time this backend here (e.g. Triton in its
    #: interpreter), or None.
    benchmark_skip_reason: str | None = None

    def prepare_benchmark(self, op, x, normalized_shape, weight, bias, eps, grad_output=None):
        """Optional: a zero-argument callable that runs `op` (forward, or forward and
        backward with grad_output) on arrays already in the backend's own format, so
        `normspec bench` times the kernel without conversions; None times the protocol
        call instead."""
        return None

    def compile_seconds(self) -> float | None:
        """Optional: seconds this process has spent compiling so far (JIT compilation,
        building sessions or graphs, loading compiled code from a cache). The time table
        at the end of a run splits each check family's time into compile and the rest
        with it; None (the default) when the backend cannot tell. Never part of a verdict."""
        return None

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None) -> Result:
        """F2 over the trailing `normalized_shape` axes; weight and bias have that shape
        or are None (bias only together with weight)."""
        raise NotImplementedError

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None) -> Result:
        """F3 over the trailing `normalized_shape` axes."""
        raise NotImplementedError

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale) -> np.ndarray:
        """F6: [..., heads, tq, d] and [..., heads, tk, d] to [..., heads, tq, tk] scores."""
        raise NotImplementedError

    def softcap(self, scores, cap) -> np.ndarray:
        """F7: cap * tanh(scores / cap), as the framework's attention code writes it."""
        raise NotImplementedError

    def encoder_layer(self, x, params, num_heads, *, norm_first: bool, activation: str,
                      eps: float, num_layers: int = 1, final_norm=None,
                      grad_output=None) -> Result:
        """F8: the framework's own Transformer encoder layer (self-attention and a
        feed-forward network, dropout 0), x [batch, tokens, d_model] with the batch first.
        norm_first=False is Post-LN (LayerNorm after each residual add), True is Pre-LN
        (LayerNorm on each sublayer's input). `params` maps torch's state_dict names
        (normspec.spec.ENCODER_LAYER_PARAMS: in_proj packs q, k, v; a linear computes
        x W^T + b) to arrays in x's dtype; activation is "relu" or "gelu" (exact erf).
        num_layers > 1 stacks that many copies of the layer (same weights), and
        final_norm, when given as {"weight", "bias"}, adds a final LayerNorm on top, as
        torch.nn.TransformerEncoder(norm=...) does. Returns Result(output) and, with
        grad_output, grad_input; parameter gradients are not asked for."""
        raise NotImplementedError

    def fused_add_norm(self, x, residual, norm: str, normalized_shape, weight, bias, eps,
                       grad_outputs=None) -> FusedAddNormResult:
        """F8 Pre-LN as inference engines fuse it: s = x + residual, written back as the
        new residual in x's dtype, and y = norm(s) over the trailing `normalized_shape`
        axes, norm "rms_norm" (bias is then None) or "layer_norm"; x and residual have
        the same shape and dtype. Which s the norm sees (the sum rounded to the dtype, or
        the unrounded one) is the backend's declared `conventions.fused_residual_sum`.
        grad_outputs, when given, is (dL/doutput, dL/dresidual'), the upstream gradients
        of both outputs. Returns a FusedAddNormResult."""
        raise NotImplementedError

    def batch_norm(self, num_features: int, *, eps: float, momentum: float | None,
                   affine: bool, track_running_stats: bool, dtype: np.dtype,
                   weight: np.ndarray | None = None,
                   bias: np.ndarray | None = None) -> BatchNormLayer:
        """A new BatchNorm layer; with affine, weight and bias are the initial gamma and
        beta (ones and zeros when None)."""
        raise NotImplementedError

    def data_parallel_batch_norm(self, steps, *, sync: bool, eps: float, momentum: float,
                                 dtype: np.dtype, weight: np.ndarray, bias: np.ndarray,
                                 grad_outputs=None) -> DataParallelResult:
        """Optional (DP): train one affine BatchNorm layer (channel axis 1, running
        statistics tracked from 0 and 1, gamma = weight, beta = bias) replicated over
        R = len(steps[0]) replicas, with the framework's own data-parallel machinery.

        steps[t][r] is replica r's shard [N_r, C, ...] of training step t (shards may
        differ along the batch axis; raise NotImplementedError where the framework
        cannot split unequally); grad_outputs, when given, has the same structure and
        each step runs its backward and the gradient all-reduce. sync=False: plain
        BatchNorm on each replica (statistics of its own shard); sync=True:
        cross-replica statistics over the global batch. Returns a DataParallelResult.
        """
        raise NotImplementedError
