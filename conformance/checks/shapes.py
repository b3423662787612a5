"""Where real kernels break: a fixed matrix of shapes and memory layouts, grouped by the
bug class each group exercises (shared/research/kernel-bug-classes.md, "Shapes, layouts,
memory").

Fixed cases, not Hypothesis-drawn, so a compiled backend compiles a bounded number of
times. Cases are data (a generator of dicts per group, as PyTorch's OpInfo sample inputs
are); every input is an ArraySpec recipe, layouts included, so a failure's repro rebuilds
the same view. Every op runs with weight and bias, and with an upstream gradient where
the backend returns gradients, so dL/dgamma and dL/dbeta are compared in every case.

- row counts straddling launch thresholds (256-row fast paths, 65535-block grids, int16
  row indices): apex #411, pytorch #16998, #19911, vLLM #48271; and, for LayerNorm and
  RMSNorm, no rows at all, an empty batch, where a launch of zero blocks fails (pytorch
  PR #28614, PR #80893, intel/torch-xpu-ops PR #4378) or, skipped, leaves dL/dgamma (and
  dL/dbeta) unwritten: the spec's sums of no terms are 0;
- hidden sizes that are not powers of two (padded lanes), between 4096 and 65536 (a
  row walked in several blocks) and longer than one block: Liger-Kernel #518, triton
  #9838; and 300-row problems, past the row counts where kernels switch to a tiled
  dL/dgamma reduction or a one-pass variance for "large" inputs (one of them with a mean
  of 1000, which a one-pass variance cannot survive); and prefills of 67 rows of wide
  rows, where kernels take several rows a program and reduce dL/dgamma in two stages of
  row blocks (FlagGems PR #59, attorch #17, pytorch PR #192016), one in training (with
  the gradients) and one in inference (the forward alone, a kernel of its own) with a row
  past one block of 1024 that a loop in vectors of 16 leaves a tail of (xformers #785);
- ranks 2 to 4 and multi-axis normalized shapes (backwards that assume 2-D input):
  FlagGems #5392, Liger-Kernel #1375;
- strides and offsets: a last axis with stride 2, a slice with an offset, a transposed
  view, a non-contiguous upstream gradient: LightLLM #1467, quack #88; and leading axes
  with no one row stride between them (q split from a fused qkv and transposed, as
  Qwen3's QK-norm gets it: sgl-kernel-xpu #169/#170, vllm-xpu-kernels PR #397);
- BatchNorm on channels-last and strided [N, C, H, W]: pytorch #62594, #107199; on
  channels-last with 6 channels, where a kernel that stores per-channel results in
  vectors of 4 leaves the last two (apex #1768); and with the upstream gradient in a
  memory format other than x's, which a backward that indexes it with x's strides
  reads in the wrong order (pytorch #107199).

The row counts are kept small in d (4) so 131072 rows stay a few MB; QK-norm also takes
65537 key rows for one query (a long KV cache past a 65535-program grid). A backend whose
capabilities declare `max_rows` (the Triton interpreter) records the larger row counts as
unsupported with its reason.
"""

from __future__ import annotations

from ..cases import ArraySpec
from ..context import Unsupported
from ..ops import BatchNormDriver, layer_norm_case, qk_scores_case, rms_norm_case
from . import check

ROW_COUNTS = (1, 2, 255, 256, 257, 300, 4096, 65535, 65536, 65537, 131072)
#: LayerNorm and RMSNorm also take an empty batch (see the module doc)
NORM_ROW_COUNTS = (0,) + ROW_COUNTS
ROW_D = 4  # small: 131072 x 4 float64 is 4 MB, and the matrix stays fast
#: (d, rows, mean of x): hidden sizes that are not powers of two, one between 4096 and
#: 65536 (where a kernel walks a row in several blocks), one longer than 65536; and two
#: problems of 300 rows (past the 256-row thresholds where kernels switch to a tiled or
#: one-pass path: dL/dgamma tiles of 32 columns, E[x^2] - E[x]^2 for "large" problems),
#: one of them with a mean of 1000 that a one-pass variance cannot survive
HIDDEN_SIZES = ((17, 3, 1.0), (100, 300, 1.0), (160, 300, 1000.0), (1536, 3, 1.0),
                (3584, 2, 1.0), (5120, 2, 1.0), (70_003, 2, 1.0))
#: prefills, the only cases with more than 8 rows of d > 160. 67 rows = 64 + 3: past 32
#: and 64 rows (kernels that take several rows a program, a dL/dgamma reduced in two
#: stages of row blocks), and no block of 2 to 64 rows divides it (a grid of rows // 4
#: programs, or a stage 2 that adds rows // 32 partials, leaves the last 3 rows out)
PREFILL_ROWS = 67
#: d of the prefill in training (forward and gradients): 512, a wide row (kernels take
#: their wide-row paths from widths like it on), and no wider: the Triton interpreter's
#: backward of 67 rows costs about 4x as much at 1039 (its tiles of 8192 elements hold
#: 16 rows of 512, 4 of 1039)
PREFILL_TRAIN_D = 512
#: d of the prefill in inference (the forward alone: an inference kernel is one of its
#: own): 1039 = 1024 + 15, past one block of 1024 (a row walked in vectors or blocks),
#: odd, and d % 16 = 15, the largest tail a loop in vectors of 16 can leave out of the
#: mean and variance, at its largest share of a row past 1024; over 67 rows bfloat16
#: shows it at every seed tried (20), over 3 rows at 5 of 20
PREFILL_INFER_D = 1039
#: (x shape, normalized_shape): ranks 2, 3, 4, one to three normalized axes
RANKS = (((6, 24), (24,)), ((2, 3, 24), (24,)), ((2, 3, 24), (3, 24)),
         ((2, 2, 3, 24), (24,)), ((2, 2, 3, 24), (3, 24)), ((2, 2, 3, 24), (2, 3, 24)))
LAYOUT_SHAPE = (2, 5, 24)
VIEW_LAYOUTS = ("strided", "sliced", "transposed", "split_heads")
BN_C = 3
BN_ROW_C = 2  # channels of the row-count cases: few, so 131072 samples stay fast
BN_WIDE_C = 6  # channels of one more 4096-sample case: not a multiple of 4
BN_LAYOUT_SHAPES = {4: (4, BN_C, 5, 6), 3: (4, BN_C, 7), 2: (12, BN_C)}
BN_WIDE_LAYOUT_SHAPE = (2, BN_WIDE_C, 3, 4)  # channels-last, C not a multiple of 4
NORM_OPS = ("layer_norm", "rms_norm")


def _rows_allowed(ctx, rows: int) -> None:
    caps = ctx.backend.capabilities
    limit = getattr(caps, "max_rows", None)
    if limit is not None and rows > limit:
        raise Unsupported(f"{rows} rows: capabilities say max_rows = {limit} "
                          f"({getattr(caps, 'max_rows_reason', '') or 'no reason given'})")


def _norm(ctx, case):
    """One LayerNorm or RMSNorm case: weight and bias (LayerNorm), and the gradients
    where the backend returns them, unless `forward_alone` (the inference call);
    `layout` / `grad_layout` / `param_layout` place x, the upstream gradient and the
    parameters in memory."""
    op, shape, ns, seed = case["op"], case["shape"], case["normalized_shape"], ctx.seed
    rows = 1
    for n in shape[:len(shape) - len(ns)]:
        rows *= n
    ctx.require(op)
    _rows_allowed(ctx, rows)
    grads = ctx.has_gradient(op) and not case.get("forward_alone", False)
    pl = case.get("param_layout", "contiguous")
    args = dict(x=ArraySpec(shape, seed, case.get("mean", 1.0), 2.0,
                            case.get("layout", "contiguous")),
                normalized_shape=ns, weight=ArraySpec(ns, seed + 1, 1.0, 0.5, pl),
                grad=ArraySpec(shape, seed + 3, 0.0, 1.0, case.get("grad_layout", "contiguous"))
                if grads else None)
    if op == "layer_norm":
        layer_norm_case(ctx, bias=ArraySpec(ns, seed + 2, 0.0, 0.5, pl), eps=1e-5, **args)
    else:
        rms_norm_case(ctx, eps=1e-6, **args)


def _name(case, label) -> str:
    return f"{case['op']}: {label}"


def _run(ctx, cases, runner, label):
    for case in cases:
        # say so where a backend returns no gradients: those cases compare the forward only
        alone = ", forward alone (inference)" if case.get("forward_alone") else \
            "" if ctx.has_gradient(case["op"]) else ", forward only (no gradients listed)"
        with ctx.case(_name(case, label(case)) + alone, op=case["op"]):
            runner(ctx, case)


# ------------------------------------------------------------------ LayerNorm, RMSNorm
def row_count_cases():
    for op in NORM_OPS:
        for rows in NORM_ROW_COUNTS:
            yield dict(op=op, shape=(rows, ROW_D), normalized_shape=(ROW_D,))


def hidden_size_cases():
    for op in NORM_OPS:
        for d, rows, mean in HIDDEN_SIZES:
            yield dict(op=op, shape=(rows, d), normalized_shape=(d,), mean=mean)
        for d, alone in ((PREFILL_TRAIN_D, False), (PREFILL_INFER_D, True)):
            yield dict(op=op, shape=(PREFILL_ROWS, d), normalized_shape=(d,), mean=1.0,
                       forward_alone=alone)


def rank_cases():
    for op in NORM_OPS:
        for shape, ns in RANKS:
            yield dict(op=op, shape=shape, normalized_shape=ns)


def layout_cases():
    base = dict(shape=LAYOUT_SHAPE, normalized_shape=LAYOUT_SHAPE[-1:])
    for op in NORM_OPS:
        for layout in VIEW_LAYOUTS:
            yield dict(base, op=op, layout=layout)
            yield dict(base, op=op, grad_layout=layout)
        yield dict(base, op=op, layout="strided", grad_layout="sliced", param_layout="strided")


def _layout_label(case) -> str:
    parts = [f"{k.split('_')[0] if k != 'layout' else 'x'} {case[k]}"
             for k in ("layout", "grad_layout", "param_layout") if k in case]
    return f"{', '.join(parts).replace('param', 'weight/bias')}, x {case['shape']}"


@check("F2/F3.row_counts", title="Row counts straddling launch thresholds (0 to 131072 rows: "
       "an empty batch, 255/256/257, 65535/65536/65537): outputs and every gradient equal "
       "the oracle's",
       ops=NORM_OPS)
def row_counts(ctx):
    _run(ctx, row_count_cases(), _norm,
         lambda c: f"{c['shape'][0]} rows x d = {ROW_D}")


@check("F2/F3.hidden_sizes", title="Hidden sizes that are not powers of two (17, 100, 160, "
       "1536, 3584, 5120), longer than 65536 (70003), 300-row problems (one of mean 1000) "
       "and 67-row prefills (d = 512 with gradients, 1039 forward alone): outputs and every "
       "gradient equal the oracle's",
       ops=NORM_OPS)
def hidden_sizes(ctx):
    _run(ctx, hidden_size_cases(), _norm,
         lambda c: f"d = {c['shape'][1]}, {c['shape'][0]} rows"
         + (f", mean {c['mean']:g}" if c["mean"] != 1.0 else ""))


@check("F2/F3.ranks", title="Ranks 2, 3 and 4, one to three normalized axes: outputs and every "
       "gradient equal the oracle's", ops=NORM_OPS)
def ranks(ctx):
    _run(ctx, rank_cases(), _norm,
         lambda c: f"x {c['shape']}, normalized_shape {c['normalized_shape']}")


@check("F2/F3.layouts", title="Views: a last axis with stride 2, a slice with an offset, a "
       "transposed view, heads split from a fused buffer (no one row stride), for x, the "
       "upstream gradient and the parameters: results equal the oracle's on the same values",
       ops=NORM_OPS)
def layouts(ctx):
    _run(ctx, layout_cases(), _norm, _layout_label)


# ------------------------------------------------------------------ QK-norm
QK_KEYS = 4
#: key rows for one query: a KV cache longer than 65535 and 65536 rows, for a kernel that
#: normalizes k one program per row on a grid whose y dimension stops at 65535
QK_LONG_KEYS = 65537


def _qk_rows(ctx, q_rows, k_rows):
    """Scores of q_rows queries against k_rows keys of d = ROW_D, with gains."""
    _rows_allowed(ctx, max(q_rows, k_rows))
    qk_scores_case(ctx, q=ArraySpec((1, q_rows, ROW_D), ctx.seed, 0.0, 1.0),
                   k=ArraySpec((1, k_rows, ROW_D), ctx.seed + 1, 0.0, 1.0),
                   q_weight=ArraySpec((ROW_D,), ctx.seed + 2, 1.0, 0.5),
                   k_weight=ArraySpec((ROW_D,), ctx.seed + 3, 1.0, 0.5))


@check("F6.row_counts", title="QK-norm scores with 1 to 131072 query rows (launch thresholds), "
       "one query against 65537 key rows, and q, k as strided, sliced or split-heads views",
       ops=("qk_norm_scores",))
def qk_row_counts(ctx):
    for rows in ROW_COUNTS:
        with ctx.case(f"{rows} query rows x d = {ROW_D}, {QK_KEYS} keys"):
            _qk_rows(ctx, rows, QK_KEYS)
    with ctx.case(f"1 query row x d = {ROW_D}, {QK_LONG_KEYS} keys"):
        _qk_rows(ctx, 1, QK_LONG_KEYS)
    for layout in ("strided", "sliced", "split_heads"):
        with ctx.case(f"q and k {layout}, [2, 3, 5, 24]"):
            qk_scores_case(ctx, q=ArraySpec((2, 3, 5, 24), ctx.seed, 0.0, 1.0, layout),
                           k=ArraySpec((2, 3, 6, 24), ctx.seed + 1, 0.0, 1.0, layout))


# ------------------------------------------------------------------ BatchNorm
def batchnorm_row_cases():
    """[rows, 2]: BatchNorm's rows are its samples. One sample is B3's business (training
    on one value per channel raises), so the counts start at 2."""
    for rows in ROW_COUNTS:
        if rows > 1:
            yield dict(shape=(rows, BN_ROW_C), layout="contiguous")
    # past 4096 values per channel kernels switch to a two-stage reduction that takes
    # channels in vectors of 4: 6 channels leave a partial vector
    yield dict(shape=(4096, BN_WIDE_C), layout="contiguous")


def batchnorm_layout_cases():
    for rank, shape in sorted(BN_LAYOUT_SHAPES.items(), reverse=True):
        for layout in ("channels_last", "strided", "sliced", "transposed"):
            if layout == "channels_last" and rank < 3:
                continue  # [N, C] already has C innermost
            yield dict(shape=shape, layout=layout)
    yield dict(shape=BN_WIDE_LAYOUT_SHAPE, layout="channels_last")
    # x and the upstream gradient in different memory formats, both ways
    for layout, grad_layout in (("channels_last", "contiguous"), ("contiguous", "channels_last")):
        yield dict(shape=BN_LAYOUT_SHAPES[4], layout=layout, grad_layout=grad_layout)


def _bn_layout_label(case) -> str:
    grad = f", grad {case['grad_layout']}" if "grad_layout" in case else ""
    return f"x {case['shape']} {case['layout']}{grad}"


def _bn_grads(ctx) -> str:
    return "" if ctx.has_gradient("batch_norm") else " (no gradients listed: outputs and statistics)"


def _batchnorm(ctx, case):
    """One training step (with gradients where the backend has them) on the case's x,
    then one eval step on another batch in the same layout: outputs, gradients and the
    running statistics against the oracle. The upstream gradients take `grad_layout`
    where the case gives one, x's layout otherwise."""
    shape, layout, seed = case["shape"], case["layout"], ctx.seed
    grad_layout = case.get("grad_layout", layout)
    c = shape[1]
    ctx.require("batch_norm")
    grads = ctx.has_gradient("batch_norm")
    if "grad_layout" in case and not grads:
        raise Unsupported("capabilities list no gradients for batch_norm: the case is the "
                          "upstream gradient's layout")
    driver = BatchNormDriver(ctx, c, momentum=0.3,
                             weight=ArraySpec((c,), seed + 7, 1.0, 0.5),
                             bias=ArraySpec((c,), seed + 8, 0.0, 0.5), defer_stats=True)
    driver.step("x", ArraySpec(shape, seed, 1.0, 2.0, layout), mode="train",
                grad=ArraySpec(shape, seed + 10, 0.0, 1.0, grad_layout) if grads else None)
    driver.set_mode(False)
    driver.step("x_eval", ArraySpec(shape, seed + 2, -1.0, 0.7, layout), mode="eval",
                grad=ArraySpec(shape, seed + 12, 0.5, 1.0, grad_layout) if grads else None)
    driver.raise_deferred()


@check("F1/F5.row_counts", title="BatchNorm with 2 to 131072 samples (launch thresholds), "
       "and 4096 samples of 6 channels: train and eval outputs, gradients and running "
       "statistics equal the oracle's",
       ops=("batch_norm",))
def batchnorm_row_counts(ctx):
    for case in batchnorm_row_cases():
        with ctx.case(f"x {case['shape']}: train, then eval" + _bn_grads(ctx)):
            _batchnorm(ctx, case)


@check("F1/F5.batchnorm_layouts", title="BatchNorm on [N, C, H, W] stored channels-last (3 "
       "and 6 channels), on strided, sliced and transposed views, and with the upstream "
       "gradient in the other memory format: train and eval outputs, gradients and running "
       "statistics equal the oracle's", ops=("batch_norm",))
def batchnorm_layouts(ctx):
    for case in batchnorm_layout_cases():
        # a gradient layout case without gradients is unsupported, not outputs alone
        alone = "" if "grad_layout" in case else _bn_grads(ctx)
        with ctx.case(f"{_bn_layout_label(case)}: train, then eval" + alone):
            _batchnorm(ctx, case)
