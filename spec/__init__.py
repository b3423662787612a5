"""normspec.spec: the NumPy oracle. Every formula of the normalization document, in
float64, as pure functions; the single source of truth the conformance checks compare
backends against. It imports NumPy and ml_dtypes and nothing else."""

from ._validate import FLOAT_DTYPES
from .attention import qk_norm_scores, rope, softcap, softmax
from .batch_norm import (
    SingleValuePerChannelError,
    batch_norm_eval,
    batch_norm_eval_vjp,
    batch_norm_train,
    batch_norm_train_vjp,
)
from .blocks import post_ln_block, pre_ln_block, pre_ln_stack, sandwich_block
from .layer_norm import layer_norm, layer_norm_vjp
from .rms_norm import RMS_NORM_DEFAULT_EPS, rms_norm, rms_norm_vjp
from .rounding import round_to, ulp, ulp_distance

__all__ = [
    "FLOAT_DTYPES",
    "RMS_NORM_DEFAULT_EPS",
    "SingleValuePerChannelError",
    "batch_norm_eval",
    "batch_norm_eval_vjp",
    "batch_norm_train",
    "batch_norm_train_vjp",
    "layer_norm",
    "layer_norm_vjp",
    "post_ln_block",
    "pre_ln_block",
    "pre_ln_stack",
    "qk_norm_scores",
    "rms_norm",
    "rms_norm_vjp",
    "rope",
    "round_to",
    "sandwich_block",
    "softcap",
    "softmax",
    "ulp",
    "ulp_distance",
]
