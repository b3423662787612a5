"""Batch invariance (B9), read as a property: LayerNorm, RMSNorm, QK-norm scores,
eval-mode BatchNorm and the fused residual add + norm (LayerNorm and RMSNorm: what an
inference engine runs) use no batch statistics, so a sample's output must be bit for bit
the same alone and in any batch, at any position in it; training-mode BatchNorm must not
be (it is the reason for the rule). And the same call twice gives the same bits, the
gradients included (dL/dgamma and dL/dbeta, sums over every row, are where a backward
that reduces with atomic adds differs from call to call; the fused op's too, with
either norm).

Bitwise, not within a tolerance: inference stacks need it bit for bit. A kernel that
switches its reduction strategy with the number of rows (a split reduction for small
batches) rounds the same row differently, which is how "temperature 0" inference
becomes nondeterministic. The batch sizes cross typical kernel thresholds (1, 2, 3, 8,
17, 64, 257, 1024 rows, and a row longer than 65536 in a few rows, where a kernel would split
it); one row length for every size, so a compiling backend compiles once per size.
LayerNorm and RMSNorm also take a batch of 4099 rows (LARGE), past the 2048 and 4096 rows
from which launch heuristics take a split-row reduction: every row of it against the same
rows in batches of 1024 at most, as one sample's bits can come out alike both ways by
chance (a red team's split of the sum into partial sums left the probe's float32 bits
alone, at d = 100 and in both norms). The gradients' run to run case takes it too, past
the 1024 rows from which a backward reduces dL/dgamma with atomic adds. Those rows are
LARGE_D long, not D: cost grows with the elements, and neither path depends on the row's
length. Each is a case of its own: a backend whose capabilities declare fewer `max_rows`
(the Triton interpreter) records it unsupported, with its reason, and runs the rest. The
fused op is run with both norms: vLLM #48271's switch (a sequential sum below 256 tokens,
a tree from 256 on) was in its fused add + RMSNorm kernel; and every row of 257 against
the same rows in batches of 17 (the sample alone caught a red team's copy of that switch
at 5 seeds of 8).

A backend that declares `batch_invariant = False` (or `deterministic = False`) gets the
records its declaration explains as deviations, with its reason; one that declares
nothing and differs fails. A declared False where the bits agree is no failure: the
record passes and says so. Differences are counted in representable steps of the dtype
(ULPs of the element itself), 0 allowed.
"""

from __future__ import annotations

import numpy as np
from normspec.spec import ulp_distance

from ..assertions import Measure, error_ulps, fmt
from ..cases import ArraySpec, RowsAt
from ..ops import BatchNormDriver
from ..ops._common import outputs_like
from ..tolerances import bound
from . import check
from .shapes import _rows_allowed

SIZES = (1, 2, 3, 8, 17, 64, 257, 1024)
#: a batch past the 2048- and 4096-row thresholds (split-row reductions, atomic dL/dgamma
#: from 1024 rows), odd: its last row sits in a partial block of any power-of-two rows
LARGE = 4099
D = 100  # not a multiple of 8, 16 or 32: every size has a tail
LARGE_D = 20  # the rows of LARGE batches: short, so they stay cheap; not a multiple of 8
LONG_D = 70_003  # > 65536, odd: the length where a kernel splits a row across programs
LONG_SIZES = (1, 2, 3, 8)
#: heads, tokens, head_dim of one QK sample: 7 rows to normalize, so 64 samples are 448
#: rows (past the 257-row threshold) and the sizes stop there
QK_SHAPES = {"q": (1, 3, 64), "k": (1, 4, 64)}
QK_SIZES = SIZES[:SIZES.index(64) + 1]
#: run to run: batches that every backend, interpreted ones included, runs in seconds
REPEAT = {"layer_norm": 17, "rms_norm": 17, "qk_norm_scores": 17, "batch_norm": 257}
REPEAT_LONG = 2
#: run to run, forward and backward: dL/dgamma and dL/dbeta sum over every row, which a
#: kernel reducing with atomic adds (Liger PR #945, llm.c PR #445) adds in whatever order
#: its threads finish; 257 rows: past the 256-row threshold of fast paths; LARGE: past
#: the 1024 rows from which a backward takes atomics
REPEAT_GRAD = (257, LARGE)
#: the norms of the fused residual add + norm, each its own kernel
FUSED_NORMS = ("layer_norm", "rms_norm")
#: the fused op's every-row case: 257 rows (past vLLM #48271's 256 tokens) against the
#: same rows in batches of 17 (below it), at D, shapes the sample's case has run already
FUSED_EVERY_ROW = (257, 17)
#: the Result fields a forward and backward returns, in the order they are compared
GRAD_FIELDS = ("output", "grad_input", "grad_weight", "grad_bias")
#: the same of a fused residual add + norm
FUSED_GRAD_FIELDS = ("output", "residual", "grad_input", "grad_residual", "grad_weight",
                     "grad_bias")
BN_SHAPE = (4, 24)  # channels, length of one sample
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6, "qk_norm_scores": 1e-6, "batch_norm": 1e-5}
STATEMENT = "a sample's output is bit for bit the same alone and in any batch, at any position (B9)"


def positions(n: int) -> tuple[int, ...]:
    """Where the sample sits in a batch of n: first, middle, last."""
    return tuple(sorted({0, n // 2, n - 1}))


def _recipe(ctx, shape, n, at, k=0):
    """The sample (k-th input of the op) alone when n == 1, else placed at `at` among
    n - len(at) other samples drawn with another mean and spread."""
    probe = ArraySpec((1,) + tuple(shape), ctx.seed + 1000 * k, 0.5, 1.0)
    if n == 1:
        return probe
    return RowsAt(ArraySpec((n,) + tuple(shape), ctx.seed + 1000 * k + n, 3.0, 5.0), probe, at)


def differing_bits(a, b) -> np.ndarray:
    """Where the bits of a and b differ (+0 against -0 included)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    as_bits = f"u{a.dtype.itemsize}"
    return a.view(as_bits) != b.view(as_bits)


def bit_diff(a, b, dtype) -> tuple[int, float, int]:
    """Elements of a and b whose bits differ, the most representable steps between any
    two (0 for +0 against -0), and the flat index of the first that does."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    differ = differing_bits(a, b).reshape(-1)
    count = int(differ.sum())
    if not count:
        return 0, 0.0, -1
    steps = ulp_distance(a.astype(np.float64), b.astype(np.float64), dtype).reshape(-1)
    return count, float(np.max(steps[differ])), int(np.argmax(differ))


def _measure(ctx, quantity, what, reference, other, index, steps) -> None:
    """The worst difference as the record's measure: steps of the dtype, bound 0."""
    m = Measure(comparisons=1, max_ulp=steps, bound_ulp=0.0)
    if index >= 0:
        r, o = reference.reshape(-1)[index], other.reshape(-1)[index]
        m.max_abs = float(abs(np.float64(r) - np.float64(o)))
        m.worst = {"quantity": quantity, "what": what, "index": [index],
                   "expected": fmt(r, ctx.dtype), "got": fmt(o, ctx.dtype), "ulp": steps,
                   "bound": 0.0}
    else:
        m.worst = {"quantity": quantity, "what": what, "ulp": 0.0, "bound": 0.0}
    ctx.measure.absorb(m)


def _declared_false_note(ctx, convention: str) -> str:
    if ctx.convention(convention, True) is False:
        return (f"; the backend declares {convention} = False, but this op is "
                f"{'batch-invariant' if convention == 'batch_invariant' else 'deterministic'} "
                "here: the declaration is not needed for it")
    return ""


def _explained_by(ctx, convention: str) -> str | None:
    return convention if ctx.convention(convention, True) is False else None


# ---------------------------------------------------------------- the ops, called by name
def _op_runner(ctx, op, d, norm=None):
    """`run(name, n, at)`: the op on its inputs for a batch of n (the sample alone when
    n is 1), registered as `name` (q_name and k_name for QK); the repro names the output
    name_out. Returns the output. `norm`: the fused op's norm."""
    if op == "batch_norm":
        c, length = BN_SHAPE
        driver = BatchNormDriver(ctx, c, momentum=1.0, compare_stats=False,
                                 weight=ArraySpec((c,), ctx.seed + 1, 1.0, 0.5),
                                 bias=ArraySpec((c,), ctx.seed + 2, 0.0, 0.5))
        driver.step("x_train", ArraySpec((8, c, length), ctx.seed + 3, 1.0, 2.0), mode="train",
                    check_output=False)  # running statistics to evaluate with
        driver.set_mode(False)

        def run(name, n, at):
            out = driver.step(name, _recipe(ctx, BN_SHAPE, n, at), mode="eval",
                              check_output=False)
            ctx.oracle(f"{name}_out = result.output")
            return out
        return run
    if op == "qk_norm_scores":
        dk = QK_SHAPES["q"][-1]
        scale = float(1.0 / np.sqrt(dk))

        def run(name, n, at):
            q, k = ctx.use(**{f"q_{name}": _recipe(ctx, QK_SHAPES["q"], n, at, 0),
                              f"k_{name}": _recipe(ctx, QK_SHAPES["k"], n, at, 1)})
            code = (f"{name}_out = backend.qk_norm_scores(q_{name}, k_{name}, None, None, "
                    f"{EPS[op]!r}, {scale!r})")
            shape = q.shape[:-1] + (k.shape[-2],)
            return ctx.call(code, ctx.backend.qk_norm_scores, q, k, None, None, EPS[op], scale,
                            outputs_like={"output": (shape, q.dtype)}, bare=True)
        return run
    names, call = _row_caller(ctx, op, d, norm)

    def run(name, n, at):
        # the input is named for the batch (x_name and residual_name for the fused op)
        keys = [name] if len(names) == 1 else [f"{k}_{name}" for k in names]
        built = ctx.use(**{k: _recipe(ctx, (d,), n, at, i) for i, k in enumerate(keys)})
        return call(name, [built] if len(keys) == 1 else built, keys)
    return run


def _row_caller(ctx, op, d, norm=None):
    """(names, call) of LayerNorm, RMSNorm or the fused add + `norm`: the names of the
    inputs it takes a row of (x; x and residual), and `call(name, arrays, codes)`, the op
    on those inputs (which the repro writes as codes) with the case's gamma and beta
    (beta None for RMSNorm, registered too, so the fused op's repro defines the `bias` it
    passes). The repro names the output name_out; the fused op's two outputs (the
    normalized sum and the residual written back) come stacked on axis 1."""
    w = ctx.use(weight=ArraySpec((d,), ctx.seed + 1, 1.0, 0.5))
    b = ctx.use(bias=ArraySpec((d,), ctx.seed + 2, 0.0, 0.5) if (norm or op) != "rms_norm"
                else None)
    if op == "fused_add_norm":
        eps = EPS[norm]

        def fused(name, arrays, codes):
            x, r = arrays
            code = (f"{name}_out = np.stack(backend.fused_add_norm({codes[0]}, {codes[1]}, "
                    f"{norm!r}, ({d},), weight, bias, {eps!r})[:2], axis=1)")
            res = ctx.call(code, ctx.backend.fused_add_norm, x, r, norm, (d,), w, b,
                           eps, outputs_like={"output": (x.shape, x.dtype),
                                              "residual": (x.shape, x.dtype)})
            return np.stack([res.output, res.residual], axis=1)
        return ("x", "residual"), fused
    params = "weight, bias" if op != "rms_norm" else "weight"

    def call(name, arrays, codes):
        x = arrays[0]
        code = f"{name}_out = backend.{op}({codes[0]}, ({d},), {params}, {EPS[op]!r}).output"
        args = (x, (d,), w, b, EPS[op]) if op == "layer_norm" else (x, (d,), w, EPS[op])
        return ctx.call(code, getattr(ctx.backend, op), *args,
                        outputs_like={"output": (x.shape, x.dtype)}).output
    return ("x",), call


def _invariance(ctx, op, sizes, d=D, norm=None):
    label = ((f"{norm}: " if norm else "") + "one sample alone and at rows first, middle, "
             f"last of batches of {', '.join(map(str, sizes[1:]))}"
             + (f", d = {d}" if d else ""))
    with ctx.case(label, op=op):
        ctx.require(op)
        run = _op_runner(ctx, op, d, norm)
        alone = run("alone", 1, (0,))[0]
        found = []  # (n, row, elements differing, steps, flat index, output row)
        for n in sizes[1:]:
            at = positions(n)
            out = run(f"batch_{n}", n, at)
            for row in at:
                count, steps, index = bit_diff(alone, out[row], ctx.dtype)
                if count:
                    found.append((n, row, count, steps, index, out[row]))
        quantity = f"{op}.output"
        if not found:
            _measure(ctx, quantity, "the sample in a batch against alone", alone, alone, -1, 0.0)
            ctx.say(f"batch-invariant: bit-identical alone and at rows first, middle and last "
                    f"of batches of {', '.join(map(str, sizes[1:]))}"
                    + _declared_false_note(ctx, "batch_invariant"))
            return
        n, row, count, steps, index, placed = found[0]
        worst = max(found, key=lambda f: f[3])
        _measure(ctx, quantity, f"row {worst[1]} of the batch of {worst[0]} against the sample "
                 "alone", alone, worst[5], worst[4], worst[3])
        sizes_differing = sorted({f[0] for f in found})
        for f in found[:2]:
            ctx.oracle(f"show(batch_{f[0]}_out[{f[1]}], alone_out[0].astype(np.float64), "
                       f"name='row {f[1]} of the batch of {f[0]}, against the sample alone')",
                       f"print('bit-identical:', np.array_equal(batch_{f[0]}_out[{f[1]}], "
                       "alone_out[0]))")
        ctx.holds(
            condition=False,
            got=(f"not batch-invariant: row {row} of a batch of {n} (the first differing batch "
                 f"size) differs from the same sample alone in {count} of {placed.size} "
                 f"elements, by up to {steps:g} ULPs; batch sizes that differ: "
                 f"{', '.join(map(str, sizes_differing))}, at most {worst[3]:g} ULPs "
                 f"(representable steps)"),
            spec_says=STATEMENT, call=f"backend.{op} alone and in batches",
            explained_by=_explained_by(ctx, "batch_invariant"), measured=True)


def _every_row(ctx, op, n, chunk, d, norm=None):
    """Every row of a batch of n against the same rows in batches of at most `chunk`
    rows, on either side of the thresholds between them: a row the batch of n rounds
    otherwise shows wherever it sits, where the one sample of _invariance can round alike
    both ways by chance. `norm`: the fused op's norm."""
    label = ((f"{norm}: " if norm else "") + f"every row of a batch of {n} against the "
             f"same rows in batches of at most {chunk}, d = {d}")
    with ctx.case(label, op=op):
        ctx.require(op)
        _rows_allowed(ctx, n)
        names, call = _row_caller(ctx, op, d, norm)
        built = ctx.use(**{k: ArraySpec((n, d), ctx.seed + 1000 * i + n, 3.0, 5.0)
                           for i, k in enumerate(names)})
        arrays = [built] if len(names) == 1 else built
        whole = call("whole", arrays, names)
        starts = range(0, n, chunk)
        parts = np.concatenate([call(f"part_{i // chunk}", [a[i:i + chunk].copy() for a in arrays],
                                     [f"{k}[{i}:{i + chunk}].copy()" for k in names])
                                for i in starts])
        count, steps, index = bit_diff(parts, whole, ctx.dtype)
        _measure(ctx, f"{op}.output", f"the batch of {n} against batches of at most {chunk}",
                 parts, whole, index, steps)
        if not count:
            ctx.say(f"batch-invariant: every row of a batch of {n} bit-identical to the same "
                    f"row in batches of at most {chunk}"
                    + _declared_false_note(ctx, "batch_invariant"))
            return
        row = index // (whole.size // n)
        rows = int(np.any(differing_bits(parts, whole).reshape(n, -1), axis=1).sum())
        ctx.oracle(f"show(whole_out[{row}], part_{row // chunk}_out[{row % chunk}]"
                   f".astype(np.float64), name='row {row} of the batch of {n}, against in a "
                   f"batch of at most {chunk}')",
                   f"print('bit-identical:', np.array_equal(whole_out, np.concatenate(["
                   f"{', '.join(f'part_{i // chunk}_out' for i in starts)}])))")
        ctx.holds(
            condition=False,
            got=(f"not batch-invariant: {rows} of the {n} rows of a batch differ from the "
                 f"same rows in batches of at most {chunk}, in {count} of {whole.size} "
                 f"elements, by up to {steps:g} ULPs (representable steps); the first: row "
                 f"{row}"),
            spec_says=STATEMENT, call=f"backend.{op} on {n} rows and on batches of {chunk}",
            explained_by=_explained_by(ctx, "batch_invariant"), measured=True)


@check("B9.layer_norm", title="LayerNorm: a sample's output is bit for bit the same alone and "
       "in batches of 2 to 4099 rows, at any position, and for a 70003-long row",
       ops=("layer_norm",))
def layer_norm_invariance(ctx):
    _invariance(ctx, "layer_norm", SIZES)
    _invariance(ctx, "layer_norm", LONG_SIZES, LONG_D)
    _every_row(ctx, "layer_norm", LARGE, SIZES[-1], LARGE_D)


@check("B9.rms_norm", title="RMSNorm: a sample's output is bit for bit the same alone and in "
       "batches of 2 to 4099 rows, at any position, and for a 70003-long row", ops=("rms_norm",))
def rms_norm_invariance(ctx):
    _invariance(ctx, "rms_norm", SIZES)
    _invariance(ctx, "rms_norm", LONG_SIZES, LONG_D)
    _every_row(ctx, "rms_norm", LARGE, SIZES[-1], LARGE_D)


@check("B9.fused_add_norm", title="Fused residual add + LayerNorm and + RMSNorm: a sample's "
       "output and residual are bit for bit the same alone and in batches of 2 to 1024 rows, "
       "at any position", ops=("fused_add_norm",))
def fused_invariance(ctx):
    for norm in FUSED_NORMS:
        _invariance(ctx, "fused_add_norm", SIZES, norm=norm)
        _every_row(ctx, "fused_add_norm", *FUSED_EVERY_ROW, D, norm)


@check("B9.qk_norm_scores", title="QK-norm scores: a sample's scores are bit for bit the same "
       "alone and in batches of 2 to 64, at any position", ops=("qk_norm_scores",))
def qk_invariance(ctx):
    _invariance(ctx, "qk_norm_scores", QK_SIZES, 0)


@check("B9.batch_norm_eval", title="Eval-mode BatchNorm: a sample's output is bit for bit the "
       "same alone and in batches of 2 to 1024, at any position", ops=("batch_norm",))
def batch_norm_eval_invariance(ctx):
    _invariance(ctx, "batch_norm", SIZES, 0)


@check("B9.batch_norm_train", title="Training-mode BatchNorm: a sample's output depends on the "
       "rest of its batch (why B9 says not to use batch statistics)", ops=("batch_norm",))
def batch_norm_train_dependence(ctx):
    c, length = BN_SHAPE
    n = 8
    with ctx.case(f"one sample at row 0 of two batches of {n} with other statistics, train "
                  "mode, a fresh layer for each"):
        probe = ArraySpec((1, c, length), ctx.seed, 0.5, 1.0)
        outs = []
        for name, mean, spread in (("batch_a", 0.0, 1.0), ("batch_b", 3.0, 5.0)):
            # the same initial state for both: only the batch differs
            driver = BatchNormDriver(ctx, c, compare_stats=False,
                                     weight=ArraySpec((c,), ctx.seed + 1, 1.0, 0.5),
                                     bias=ArraySpec((c,), ctx.seed + 2, 0.0, 0.5))
            recipe = RowsAt(ArraySpec((n, c, length), ctx.seed + len(outs) + 5, mean, spread),
                            probe, (0,))
            # the values are F1's business: here only whether the batch shows through
            outs.append(driver.step(name, recipe, mode="train", check_output=False)[0])
            ctx.oracle(f"{name}_out = result.output")
        ctx.oracle("show(batch_b_out[0], batch_a_out[0].astype(np.float64), "
                   "name='the sample in batch b, against in batch a')")
        at_least = 2.0 * float(bound("output", ctx.dtype, n * length))
        biggest = float(np.max(error_ulps(expected=outs[0].astype(np.float64), actual=outs[1],
                                          dtype=ctx.dtype, scale=1.0)))
        ctx.differs(first=outs[0].astype(np.float64), second=outs[1], scale=1.0,
                    at_least=at_least, what="the sample's training-mode outputs in two batches",
                    call="layer.forward(batch_a), layer.forward(batch_b) in train mode, two "
                         "fresh layers")
        ctx.say(f"depends on its batch, as B9 says batch statistics do: the sample's outputs "
                f"in two batches differ by up to {biggest:.3g} ULPs at scale 1 (more than "
                f"{at_least:.3g})")


# ---------------------------------------------------------------- run to run
def _twice(ctx, op, label, d, n, at):
    with ctx.case(label, op=op):
        ctx.require(op)
        run = _repeating(ctx, op, d)
        first = run("first", n, at)
        second = run("second", n, at)
        count, steps, index = bit_diff(first, second, ctx.dtype)
        _measure(ctx, f"{op}.output", "the second call against the first", first, second,
                 index, steps)
        if not count:
            ctx.say("deterministic: the same call twice gave the same bits"
                    + _declared_false_note(ctx, "deterministic"))
            return
        ctx.oracle("show(second_out, first_out.astype(np.float64), name='second call, "
                   "against the first')",
                   "print('bit-identical:', np.array_equal(first_out, second_out))")
        ctx.holds(condition=False,
                  got=(f"not deterministic: the same call twice gave outputs differing in "
                       f"{count} of {first.size} elements, by up to {steps:g} ULPs "
                       "(representable steps)"),
                  spec_says="the same call gives the same bits every time (B9)",
                  call=f"backend.{op} twice on the same input",
                  explained_by=_explained_by(ctx, "deterministic"), measured=True)


def _repeating(ctx, op, d):
    """`run(name, n, at)` calling op on the same input each time (registered under each
    name), the repro naming the output name_out."""
    if op != "batch_norm":
        return _op_runner(ctx, op, d)
    c, _ = BN_SHAPE

    def run(name, n, at):
        # a fresh layer each time, so the state is the same too
        driver = BatchNormDriver(ctx, c, compare_stats=False,
                                 weight=ArraySpec((c,), ctx.seed + 1, 1.0, 0.5),
                                 bias=ArraySpec((c,), ctx.seed + 2, 0.0, 0.5))
        recipe = _recipe(ctx, BN_SHAPE, n, at)
        train = driver.step(name, recipe, mode="train", check_output=False)
        ctx.oracle(f"{name}_train = result.output")
        driver.set_mode(False)
        out = driver.step(name, recipe, mode="eval", check_output=False)
        ctx.oracle(f"{name}_out = np.stack([{name}_train, result.output])")
        return np.stack([train, out])
    return run


def _backward_caller(ctx, op, n, d, norm=None):
    """(call(name) -> the Result of op's forward and backward on fixed inputs, its fields
    to compare); the repro names the result `name`. `norm`: the fused op's norm."""
    x, w, g = ctx.use(x=ArraySpec((n, d), ctx.seed, 0.5, 1.0),
                      weight=ArraySpec((d,), ctx.seed + 1, 1.0, 0.5),
                      grad=ArraySpec((n, d), ctx.seed + 2))
    # (None registered too, so the fused op's repro defines the `bias` it passes)
    b = ctx.use(bias=ArraySpec((d,), ctx.seed + 3, 0.0, 0.5) if (norm or op) != "rms_norm"
                else None)
    expect = outputs_like(x, grads=True, param_shape=(d,), weight=True, bias=b is not None)
    if op == "fused_add_norm":
        r, gr = ctx.use(residual=ArraySpec((n, d), ctx.seed + 4, 3.0, 2.0),
                        grad_residual=ArraySpec((n, d), ctx.seed + 5))
        eps = EPS[norm]
        expect.update(residual=(x.shape, x.dtype), grad_residual=(x.shape, x.dtype))

        def call(name):
            code = (f"{name} = backend.fused_add_norm(x, residual, {norm!r}, ({d},), "
                    f"weight, bias, {eps!r}, grad_outputs=(grad, grad_residual))")
            return ctx.call(code, ctx.backend.fused_add_norm, x, r, norm, (d,), w, b,
                            eps, (g, gr), outputs_like=expect)
        return call, FUSED_GRAD_FIELDS
    params, args = (("weight, bias", (w, b)) if op == "layer_norm" else ("weight", (w,)))

    def call(name):
        code = f"{name} = backend.{op}(x, ({d},), {params}, {EPS[op]!r}, grad_output=grad)"
        return ctx.call(code, getattr(ctx.backend, op), x, (d,), *args, EPS[op], g,
                        outputs_like=expect)
    return call, GRAD_FIELDS


def _gradients_twice(ctx, op, n, norm=None):
    """The same forward and backward twice on n rows: every field of the Result bit for
    bit, the parameter gradients (sums over all the rows) above all. `norm`: the fused
    op's norm."""
    d = LARGE_D if n == LARGE else D
    what = f"{op} with {norm}" if norm else op
    with ctx.case(f"{what}: the same forward and backward twice, a batch of {n}, d = {d}",
                  op=op):
        ctx.require(op, gradient=True)
        _rows_allowed(ctx, n)
        call, fields = _backward_caller(ctx, op, n, d, norm)
        results = [call(name) for name in ("first", "second")]
        differing = []
        for field in fields:
            a, c = getattr(results[0], field), getattr(results[1], field)
            if a is None:
                continue
            count, steps, index = bit_diff(a, c, ctx.dtype)
            _measure(ctx, f"{op}.{field}", f"{field} of the second call against the first",
                     a, c, index, steps)
            if count:
                differing.append(f"{field} in {count} of {a.size} elements, by up to "
                                 f"{steps:g} ULPs")
                ctx.oracle(f"show(second.{field}, first.{field}.astype(np.float64), "
                           f"name='{field}: the second call, against the first')",
                           f"print('bit-identical:', np.array_equal(first.{field}, "
                           f"second.{field}))")
        if not differing:
            ctx.say("deterministic: the same forward and backward twice gave the same bits "
                    "in the output and every gradient"
                    + _declared_false_note(ctx, "deterministic"))
            return
        ctx.holds(condition=False,
                  got="not deterministic: the same forward and backward twice differed: "
                      + "; ".join(differing) + " (representable steps)",
                  spec_says="the same call gives the same bits every time (B9)",
                  call=f"backend.{op}(..., grad_output=grad) twice on the same inputs",
                  explained_by=_explained_by(ctx, "deterministic"), measured=True)


@check("B9.deterministic", title="The same call twice gives the same bits (LayerNorm and "
       "RMSNorm on 17 rows and on a 70003-long row, their gradients and the fused residual "
       "add + LayerNorm's and + RMSNorm's on 257 and 4099 rows, QK scores, BatchNorm train "
       "and eval)",
       ops=("layer_norm", "rms_norm", "qk_norm_scores", "batch_norm", "fused_add_norm"))
def deterministic(ctx):
    caps = ctx.backend.capabilities
    for op, n in REPEAT.items():
        if op not in caps.ops:
            continue
        what = {"batch_norm": "train then eval forward of a fresh layer",
                "qk_norm_scores": "scores"}.get(op, f"d = {D}")
        _twice(ctx, op, f"{op}: the same call twice, a batch of {n}, {what}", D, n, positions(n))
        if op in ("layer_norm", "rms_norm"):
            _twice(ctx, op, f"{op}: the same call twice, a batch of {REPEAT_LONG}, d = {LONG_D}",
                   LONG_D, REPEAT_LONG, positions(REPEAT_LONG))
            for n in REPEAT_GRAD:
                _gradients_twice(ctx, op, n)
    if "fused_add_norm" in caps.ops:
        for norm in FUSED_NORMS:
            for n in REPEAT_GRAD:
                _gradients_twice(ctx, "fused_add_norm", n, norm)
