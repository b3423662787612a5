"""Gradients: every VJP a backend returns (dL/dx, dL/dgamma, dL/dbeta) against the
oracle's closed forms (F1, F2, F3), BatchNorm with and without affine parameters,
LayerNorm with gamma alone and beta alone, BatchNorm with 100 channels as well, and
LayerNorm and RMSNorm whose gamma holds zeros (ZERO_GAINS): gains initialized or pruned to
zero are real (torchvision's zero_init_residual, adaLN-Zero), and a memory-efficient
backward that rebuilds x_hat from the output, (y - beta) / gamma (Apex's
memory_efficient LayerNorm and RMSNorm), gives NaN there (found by a red team: the
drawn gains never held a zero)."""

from __future__ import annotations

from .. import strategies as ns
from ..cases import ArraySpec, Literal
from ..ops import BatchNormDriver, layer_norm_case, rms_norm_case
from . import check
from .values import many_channels_case, one_parameter_cases

#: gamma of the zero-gains cases: exact zeros among ordinary gains, one negative
ZERO_GAINS = (1.25, 0.0, -0.75, 0.0, 2.0, 0.5, 0.0, 1.0)
ZERO_GAINS_ROWS = 6


def _zero_gains(ctx, op):
    d = len(ZERO_GAINS)
    with ctx.case(f"gamma with zeros {ZERO_GAINS}: {ZERO_GAINS_ROWS} rows of d = {d}"):
        common = dict(x=ArraySpec((ZERO_GAINS_ROWS, d), ctx.seed, 0.5, 1.5),
                      normalized_shape=(d,), weight=Literal(values=ZERO_GAINS),
                      grad=ArraySpec((ZERO_GAINS_ROWS, d), ctx.seed + 3))
        if op == "layer_norm":
            layer_norm_case(ctx, bias=ArraySpec((d,), ctx.seed + 2, 0.0, 0.5), **common)
        else:
            rms_norm_case(ctx, **common)


@check("F2.grad", title="LayerNorm gradients equal the oracle's VJP", ops=("layer_norm",),
       needs=("gradients",))
def layer_norm_grads(ctx):
    ctx.explore("drawn shapes, values and upstream gradients",
                ns.layer_norm_cases(with_grad=True, max_size=1024),
                lambda case: layer_norm_case(ctx, **case))
    one_parameter_cases(ctx, grad=True)
    _zero_gains(ctx, "layer_norm")


@check("F3.grad", title="RMSNorm gradients equal the oracle's VJP", ops=("rms_norm",),
       needs=("gradients",))
def rms_norm_grads(ctx):
    ctx.explore("drawn shapes, values and upstream gradients",
                ns.layer_norm_cases(with_grad=True, with_bias=False, max_size=1024),
                lambda case: rms_norm_case(ctx, **{k: v for k, v in case.items() if k != "bias"}))
    _zero_gains(ctx, "rms_norm")


@check("F1.grad", title="BatchNorm training gradients equal the oracle's VJP",
       ops=("batch_norm",), needs=("gradients",))
def batch_norm_grads(ctx):
    def body(case):
        x = case["x"]
        driver = BatchNormDriver(ctx, x.shape[1], eps=case["eps"], momentum=case["momentum"],
                                 weight=case["weight"], bias=case["bias"], compare_stats=False)
        driver.step("x", x, mode="train", grad=case["grad"])

    ctx.explore("drawn shapes, values and upstream gradients", ns.batch_norm_inputs(), body)
    many_channels_case(ctx, grad=True)
    with ctx.case("affine=False: no gamma or beta, dL/dx alone"):
        driver = BatchNormDriver(ctx, 3, affine=False, compare_stats=False)
        driver.step("x", ArraySpec((4, 3, 5), ctx.seed, 1.0, 2.0), mode="train",
                    grad=ArraySpec((4, 3, 5), ctx.seed + 1, 0.0, 1.0))
