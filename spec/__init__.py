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
from .blocks import (
    post_ln_block,
    post_ln_block_vjp,
    pre_ln_block,
    pre_ln_block_vjp,
    pre_ln_stack,
    pre_ln_stack_vjp,
    sandwich_block,
    sandwich_block_vjp,
)
from .data_parallel import (
    local_batch_norm_train,
    local_batch_norm_train_vjp,
    merge_statistics,
    shard_statistics,
    sync_batch_norm_train,
    sync_batch_norm_train_vjp,
)
from .fused_residual import (
    FUSED_RESIDUAL_SUMS,
    fused_add_norm,
    fused_add_norm_vjp,
    fused_residual_sum,
)
from .layer_norm import layer_norm, layer_norm_vjp
from .rms_norm import RMS_NORM_DEFAULT_EPS, rms_norm, rms_norm_vjp
from .rounding import largest_finite, round_to, ulp, ulp_distance
from .transformer import (
    ENCODER_LAYER_PARAMS,
    feed_forward,
    feed_forward_vjp,
    gelu,
    multi_head_self_attention,
    multi_head_self_attention_vjp,
    normal_cdf,
    transformer_encoder,
    transformer_encoder_layer,
    transformer_encoder_layer_vjp,
    transformer_encoder_vjp,
)
from .variants import VARIANTS, Variant, variant, variants_for

__all__ = [
    "ENCODER_LAYER_PARAMS",
    "FLOAT_DTYPES",
    "FUSED_RESIDUAL_SUMS",
    "RMS_NORM_DEFAULT_EPS",
    "VARIANTS",
    "SingleValuePerChannelError",
    "Variant",
    "batch_norm_eval",
    "batch_norm_eval_vjp",
    "batch_norm_train",
    "batch_norm_train_vjp",
    "feed_forward",
    "feed_forward_vjp",
    "fused_add_norm",
    "fused_add_norm_vjp",
    "fused_residual_sum",
    "gelu",
    "largest_finite",
    "layer_norm",
    "layer_norm_vjp",
    "local_batch_norm_train",
    "local_batch_norm_train_vjp",
    "merge_statistics",
    "multi_head_self_attention",
    "multi_head_self_attention_vjp",
    "normal_cdf",
    "post_ln_block",
    "post_ln_block_vjp",
    "pre_ln_block",
    "pre_ln_block_vjp",
    "pre_ln_stack",
    "pre_ln_stack_vjp",
    "qk_norm_scores",
    "rms_norm",
    "rms_norm_vjp",
    "rope",
    "round_to",
    "sandwich_block",
    "sandwich_block_vjp",
    "shard_statistics",
    "softcap",
    "softmax",
    "sync_batch_norm_train",
    "sync_batch_norm_train_vjp",
    "transformer_encoder",
    "transformer_encoder_layer",
    "transformer_encoder_layer_vjp",
    "transformer_encoder_vjp",
    "ulp",
    "ulp_distance",
    "variant",
    "variants_for",
]
