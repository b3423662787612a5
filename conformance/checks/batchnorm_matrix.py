"""BatchNorm as a case matrix (F1, F5), the way PyTorch's OpInfo generates sample inputs:
mode (train, eval, train under no-grad, eval under no-grad) x gradients x affine x
track_running_stats x momentum (a number, None) x rank (2, 3, 4). Each case creates a
layer, trains it for two steps, then runs the mode under test, and compares every output,
gradient, running statistic and num_batches_tracked (where the layer exposes one) with
the oracle. A combination the backend's capabilities do not offer is recorded as
unsupported, never skipped silently.

Kept tiny ([4, 3], [4, 3, 5], [2, 3, 2, 3]): the point is the combinations, not the sizes;
the drawn checks (F1.values, F1.grad, F5.values) cover shapes and values."""

from __future__ import annotations

import itertools

from ..cases import ArraySpec
from ..context import Unsupported
from ..ops import BatchNormDriver
from . import check

SHAPES = {2: (4, 3), 3: (4, 3, 5), 4: (2, 3, 2, 3)}
MOMENTA = (0.3, None)
TRAIN_MODES = ("train", "train_no_grad")
EVAL_MODES = ("eval", "eval_no_grad")


def matrix(modes):
    """The cases, as data: one dict per combination. A no-grad forward returns no
    gradients, so the no-grad modes come without them (a contradiction, not a gap)."""
    for mode, grads, affine, track, momentum, rank in itertools.product(
            modes, (True, False), (True, False), (True, False), MOMENTA, sorted(SHAPES)):
        if grads and mode.endswith("no_grad"):
            continue
        yield dict(mode=mode, grads=grads, affine=affine, track=track, momentum=momentum,
                   shape=SHAPES[rank])


def case_name(case) -> str:
    return (f"{case['mode']}, {'grads' if case['grads'] else 'no grads'}, "
            f"{'affine' if case['affine'] else 'no affine'}, "
            f"{'tracked' if case['track'] else 'untracked'}, momentum {case['momentum']}, "
            f"x {case['shape']}")


def missing_capability(caps, case) -> str | None:
    """Why the backend cannot run `case`, from its declared capabilities; None if it can."""
    if case["grads"] and "batch_norm" not in caps.gradients:
        return "capabilities list no gradients for batch_norm"
    if case["mode"].endswith("no_grad") and not caps.no_grad_mode:
        return "capabilities say no_grad_mode = False"
    if case["momentum"] is None and not caps.cumulative_momentum:
        return "capabilities say cumulative_momentum = False"
    if not case["track"] and not caps.untracked_stats:
        return "capabilities say untracked_stats = False"
    return None


def run_case(ctx, case):
    """Two training steps (momentum None: a = 1, then 1/2), then the mode under test on a
    batch from another distribution, so eval (running statistics) and train (batch
    statistics) give different outputs and gradients."""
    shape, c, seed = case["shape"], case["shape"][1], ctx.seed
    affine = case["affine"]
    driver = BatchNormDriver(
        ctx, c, momentum=case["momentum"], affine=affine, track_running_stats=case["track"],
        weight=ArraySpec((c,), seed + 7, 1.0, 0.5) if affine else None,
        bias=ArraySpec((c,), seed + 8, 0.0, 0.5) if affine else None,
        defer_stats=True)  # a running-statistics failure must not hide the gradients
    grad = case["grads"]
    for i in range(2):
        driver.step(f"x{i}", ArraySpec(shape, seed + i, 1.0 + i, 2.0), mode="train",
                    grad=ArraySpec(shape, seed + 10 + i, 0.0, 1.0) if grad else None)
    mode = case["mode"]
    if mode.startswith("eval"):
        driver.set_mode(False)
    driver.step("x_test", ArraySpec(shape, seed + 2, -1.0, 0.7),
                mode="no_grad" if mode.endswith("no_grad") else mode,
                grad=ArraySpec(shape, seed + 12, 0.5, 1.0) if grad else None,
                what=f"batch_norm {mode} output")
    driver.raise_deferred()


def run_matrix(ctx, modes):
    caps = ctx.backend.capabilities
    for case in matrix(modes):
        with ctx.case(case_name(case)):
            why = missing_capability(caps, case)
            if why:
                raise Unsupported(why)
            run_case(ctx, case)


@check("F1.matrix", title="BatchNorm case matrix, training modes (train, train under "
       "no-grad) x gradients x affine x track_running_stats x momentum x rank: outputs, "
       "gradients, running statistics and num_batches_tracked equal the oracle's",
       ops=("batch_norm",))
def train_matrix(ctx):
    run_matrix(ctx, TRAIN_MODES)


@check("F5.matrix", title="BatchNorm case matrix, eval modes (eval, eval under no-grad) "
       "x gradients x affine x track_running_stats x momentum x rank: outputs and gradients "
       "(dL/dx = gamma g / sqrt(running_var + eps)) equal the oracle's",
       ops=("batch_norm",))
def eval_matrix(ctx):
    run_matrix(ctx, EVAL_MODES)
