"""BatchNorm state (F4, F5, B3, B4, B5, E3): running statistics after every training step
(unbiased update, momentum weighting the new batch), eval on running statistics (the
initial ones, mean 0 and variance 1, on a layer that never trained), no statistics with
track_running_stats=False, a batch of one, and training again after eval()."""

from __future__ import annotations

import numpy as np

from ..cases import ArraySpec, Literal
from ..ops import BatchNormDriver
from . import check

E3_BATCH = Literal(values=((1.0,), (3.0,)))


def _by_biased_estimator(ctx):
    """With momentum 1 the divergence of train and eval comes only from the unbiased
    running variance: a backend that declares the biased one has none, by design."""
    biased = ctx.convention("running_var_estimator") == "biased"
    return "running_var_estimator" if biased else None


def _e3(ctx, eps):
    driver = BatchNormDriver(ctx, 1, eps=eps, momentum=1.0, affine=False)
    train_out = driver.step("x", E3_BATCH, mode="train")
    driver.set_mode(False)
    eval_out = driver.step("x", E3_BATCH, mode="eval")
    return driver, train_out, eval_out


@check("E3.train_then_eval", title="E3: [[1],[3]], momentum 1: train gives [-1, 1], "
       "running_var 2, eval gives [-0.7071068, 0.7071068]", ops=("batch_norm",))
def e3(ctx):
    for eps in (0.0, 1e-5):
        label = "eps = 0, as the document" if eps == 0 else "eps = 1e-5"
        with ctx.case(label):
            driver, train_out, eval_out = _e3(ctx, eps)
            # B4: the same batch, different outputs
            ctx.differs(first=train_out.astype(np.float64), second=eval_out, scale=1.0,
                        at_least=2.0, what="train and eval outputs",
                        call="layer.forward(x) in train, then in eval",
                        explained_by=_by_biased_estimator(ctx))


@check("F4.running_stats", title="Running statistics: unbiased variance (m - 1), momentum "
       "weights the new batch (0: the statistics stay as they are), updated at every "
       "training forward", ops=("batch_norm",))
def running_stats(ctx):
    # momentum 0.0 is a number, not None: `momentum or 1 / t` takes it for a cumulative
    # average
    for momentum in (0.0, 0.1, 0.3):
        for shape in ((3, 4), (2, 3, 2)):
            with ctx.case(f"3 steps, momentum {momentum}, x {shape}"):
                driver = BatchNormDriver(ctx, shape[1], momentum=momentum,
                                         weight=ArraySpec((shape[1],), ctx.seed + 7, 1.0, 0.5),
                                         bias=ArraySpec((shape[1],), ctx.seed + 8, 0.0, 0.5))
                for i in range(3):
                    driver.step(f"x{i}", ArraySpec(shape, ctx.seed + i, 2.0 * i, 1.0 + i),
                                mode="train", check_output=False)  # outputs are F1's


@check("F4.cumulative_momentum", title="momentum=None is a cumulative average of the batch "
       "statistics", ops=("batch_norm",), needs=("cumulative_momentum",))
def cumulative(ctx):
    with ctx.case("3 steps, momentum None"):
        driver = BatchNormDriver(ctx, 2, momentum=None, affine=False)
        for i in range(3):
            driver.step(f"x{i}", ArraySpec((4, 2), ctx.seed + i, 3.0 * i, 1.0 + i), mode="train")


@check("F5.untracked", title="track_running_stats=False: no running statistics; eval uses "
       "the batch's statistics", ops=("batch_norm",), needs=("untracked_stats",))
def untracked(ctx):
    with ctx.case("train, then eval on another batch"):
        driver = BatchNormDriver(ctx, 3, track_running_stats=False,
                                 weight=ArraySpec((3,), ctx.seed + 7, 1.0, 0.5),
                                 bias=ArraySpec((3,), ctx.seed + 8, 0.0, 0.5))
        driver.step("x", ArraySpec((4, 3), ctx.seed, 1.0, 2.0), mode="train")
        driver.set_mode(False)
        driver.step("x_eval", ArraySpec((5, 3), ctx.seed + 1, -2.0, 0.5), mode="eval")


@check("F5.eval_before_training", title="Eval on a layer that never trained normalizes "
       "with the initial running statistics, mean 0 and variance 1, not the batch's",
       ops=("batch_norm",))
def eval_before_training(ctx):
    with ctx.case("eval on a fresh layer"):
        driver = BatchNormDriver(ctx, 3, weight=ArraySpec((3,), ctx.seed + 7, 1.0, 0.5),
                                 bias=ArraySpec((3,), ctx.seed + 8, 0.0, 0.5))
        # the driver judges eval by the statistics the layer reports: say what they must be
        ctx.holds(condition=np.array_equal(driver.rm, np.zeros(3))
                  and np.array_equal(driver.rv, np.ones(3)),
                  got=f"running_mean {driver.rm}, running_var {driver.rv}",
                  spec_says="a new layer starts at running_mean 0, running_var 1",
                  call="layer.running_mean, layer.running_var")
        driver.set_mode(False)
        # mean 1, spread 2: the batch's statistics are far from 0 and 1
        driver.step("x", ArraySpec((4, 3), ctx.seed, 1.0, 2.0), mode="eval")


@check("B3.batch_of_one_train", title="A [1, C] batch in training mode raises (one value per "
       "channel)", ops=("batch_norm",))
def batch_of_one_train(ctx):
    with ctx.case("[1, 3] in train mode"):
        driver = BatchNormDriver(ctx, 3)
        x = ctx.use(x=ArraySpec((1, 3), ctx.seed, 0.0, 1.0))
        code = "result = layer.forward(x)  # [1, C] in train mode"
        raised = ctx.raises(code, driver.layer.forward, x)
        if ctx.convention("single_value_batch") == "accepts":
            ctx.holds(condition=raised is None, got=f"it raised {raised}",
                      spec_says="the backend declared single_value_batch = 'accepts'", call=code)
            ctx.explain("got an output and no error, but the spec says training on one value "
                        f"per channel raises (B3) [{code}]", "single_value_batch")
        else:
            ctx.holds(condition=raised is not None, got="an output and no error",
                      spec_says="training on one value per channel raises (B3)", call=code)


@check("B3.batch_of_one_eval", title="The same layer in eval mode runs on [1, C] with the "
       "running statistics", ops=("batch_norm",))
def batch_of_one_eval(ctx):
    with ctx.case("train on [4, 3], eval on [1, 3]"):
        driver = BatchNormDriver(ctx, 3, compare_stats=False)
        driver.step("x", ArraySpec((4, 3), ctx.seed, 1.0, 2.0), mode="train", check_output=False)
        driver.set_mode(False)
        driver.step("x_one", ArraySpec((1, 3), ctx.seed + 1, 0.0, 1.0), mode="eval")


@check("B3.single_sample_sequence", title="[1, C, L] with L > 1 trains: statistics run "
       "across time", ops=("batch_norm",))
def single_sample_sequence(ctx):
    with ctx.case("[1, 2, 5] in train mode"):
        driver = BatchNormDriver(ctx, 2)
        driver.step("x", ArraySpec((1, 2, 5), ctx.seed, 1.0, 2.0), mode="train")


@check("B4.train_eval_divergence", title="The same batch gives different outputs in train "
       "and eval mode, with no change of data", ops=("batch_norm",))
def divergence(ctx):
    with ctx.case("one batch, momentum 1, train then eval"):
        driver = BatchNormDriver(ctx, 2, momentum=1.0, compare_stats=False)
        x = ArraySpec((3, 2), ctx.seed, 0.5, 1.5)
        train_out = driver.step("x", x, mode="train")
        driver.set_mode(False)
        eval_out = driver.step("x", x, mode="eval")
        # the oracle says they differ (biased batch variance against the unbiased running
        # one): more than rounding can explain
        ctx.differs(first=train_out.astype(np.float64), second=eval_out, scale=1.0,
                    at_least=2.0, what="train and eval outputs",
                    call="layer.forward(x), train then eval", explained_by=_by_biased_estimator(ctx))


@check("B5.train_after_eval", title="train() after eval() trains again: the next forward "
       "normalizes with the batch's statistics, updates the running statistics and counts "
       "in num_batches_tracked", ops=("batch_norm",), also=("F1", "F4"))
def train_after_eval(ctx):
    with ctx.case("train, eval, then train again"):
        driver = BatchNormDriver(ctx, 3, momentum=0.3,
                                 weight=ArraySpec((3,), ctx.seed + 7, 1.0, 0.5),
                                 bias=ArraySpec((3,), ctx.seed + 8, 0.0, 0.5))
        driver.step("x0", ArraySpec((4, 3), ctx.seed, 1.0, 2.0), mode="train")
        driver.set_mode(False)
        driver.step("x_eval", ArraySpec((4, 3), ctx.seed + 1, -1.0, 0.7), mode="eval")
        driver.set_mode(True)
        # a third distribution: its statistics are far from the running ones
        driver.step("x1", ArraySpec((4, 3), ctx.seed + 2, 3.0, 1.5), mode="train")
