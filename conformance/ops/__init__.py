"""One comparison routine per op: build the inputs in the dtype under test, call the
backend through the guarded context, compute the oracle on the very same (rounded)
inputs, and compare every output and gradient under the tolerance table's bound.

norms.py: LayerNorm and RMSNorm; qk.py: QK-norm scores; batch_norm.py: a BatchNorm
layer driven step by step; data_parallel.py: BatchNorm trained on R replicas (DP). The
scales and bounds come from tolerances.py; each routine also writes the oracle's side of
the repro snippet, so a failure's repro compares."""

from .batch_norm import BatchNormDriver
from .data_parallel import DataParallelRun
from .norms import layer_norm_case, rms_norm_case
from .qk import qk_scores_case

__all__ = ["BatchNormDriver", "DataParallelRun", "layer_norm_case", "qk_scores_case", "rms_norm_case"]
