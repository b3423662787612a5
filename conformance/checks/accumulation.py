"""Gradient accumulation and when statistics update (B5, B6, B7, E4): one batch against
micro-batches differs in outputs, running statistics and gradients exactly as the oracle
says; statistics update at every training forward, under no-grad too."""

from __future__ import annotations

import numpy as np

from ..cases import ArraySpec, Literal
from ..ops import BatchNormDriver
from . import check

E4_FULL = Literal(values=((0.0,), (2.0,), (10.0,), (12.0,)))
E4_FIRST = Literal(values=((0.0,), (2.0,)))
E4_SECOND = Literal(values=((10.0,), (12.0,)))
E4_GRAD_FULL = Literal(values=((1.0,), (-0.5,), (0.25,), (2.0,)))
E4_GRAD_FIRST = Literal(values=((1.0,), (-0.5,)))
E4_GRAD_SECOND = Literal(values=((0.25,), (2.0,)))


@check("B7.accumulation", title="E4: one batch [0,2,10,12] against micro-batches [0,2], "
       "[10,12]: outputs, running statistics and gradients differ as the oracle says",
       ops=("batch_norm",), needs=("gradients",), also=("E4",))
def accumulation(ctx):
    for eps in (0.0, 1e-5):
        with ctx.case("E4, eps = 0 as the document" if eps == 0 else "E4, eps = 1e-5"):
            weight, bias = Literal(values=(1.5,)), Literal(values=(0.25,))
            full = BatchNormDriver(ctx, 1, eps=eps, momentum=0.1, weight=weight, bias=bias)
            y_full = full.step("x_full", E4_FULL, mode="train", grad=E4_GRAD_FULL)
            stats_full = (full.rm.copy(), full.rv.copy())
            micro = BatchNormDriver(ctx, 1, eps=eps, momentum=0.1, weight=weight, bias=bias)
            y1 = micro.step("x_first", E4_FIRST, mode="train", grad=E4_GRAD_FIRST)
            y2 = micro.step("x_second", E4_SECOND, mode="train", grad=E4_GRAD_SECOND)
            both = np.concatenate([y1, y2]).astype(np.float64)
            ctx.differs(first=both, second=y_full, scale=1.0, at_least=2.0,
                           what="full-batch and micro-batch outputs",
                           call="one forward of x_full against x_first then x_second")
            ctx.differs(first=stats_full[1].astype(np.float64), second=micro.rv,
                           dtype=micro.rv.dtype, scale=1.0, at_least=2.0,
                           what="running_var after one batch and after two micro-batches",
                           call="layer.running_var")


@check("B5.update_every_forward", title="Running statistics change at every training-mode "
       "forward, with no optimizer step in between", ops=("batch_norm",))
def every_forward(ctx):
    with ctx.case("two forwards, no step"):
        driver = BatchNormDriver(ctx, 2, momentum=0.5)
        before = driver.rm.copy()
        for i in range(2):
            driver.step(f"x{i}", ArraySpec((4, 2), ctx.seed + i, 5.0, 1.0), mode="train",
                        check_output=False)  # B5 is about the statistics; F1 owns outputs
            ctx.holds(condition=not np.array_equal(before, driver.rm),
                         got=f"running_mean unchanged after training forward {i + 1}",
                         spec_says="it updates at every training forward (B5)",
                         call=f"layer.forward(x{i})")
            before = driver.rm.copy()


@check("B6.no_grad_still_updates", title="The no-grad switch does not change BatchNorm's "
       "mode: in training mode it still updates the statistics; eval() is what stops it",
       ops=("batch_norm",), needs=("no_grad_mode",))
def no_grad(ctx):
    with ctx.case("train mode under no-grad, then eval mode under no-grad"):
        driver = BatchNormDriver(ctx, 2, momentum=0.5)
        # the driver compares the statistics with the oracle's update after this forward
        driver.step("x", ArraySpec((4, 2), ctx.seed, 5.0, 1.0), mode="no_grad",
                    check_output=False)
        driver.set_mode(False)
        driver.step("x_val", ArraySpec((4, 2), ctx.seed + 1, -5.0, 1.0), mode="no_grad",
                    check_output=False)
