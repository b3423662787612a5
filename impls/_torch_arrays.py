"""NumPy <-> torch conversion for the torch-based adapters (torch, triton).

torch cannot read `ml_dtypes.bfloat16` arrays directly; their bits are reinterpreted
through int16, which is exact."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def torch_dtype(dtype):
    import torch

    return {
        np.dtype(np.float16): torch.float16, BF16: torch.bfloat16,
        np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
    }[np.dtype(dtype)]


def to_torch(a, device="cpu"):
    import torch

    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def to_numpy(t):
    import torch

    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16).copy()
    return t.numpy().copy()
