"""The triton backend's kernels: LayerNorm and RMSNorm forward and backward, the
dL/dgamma, dL/dbeta group reduction, and the BatchNorm forward.

Laid out as Triton's LayerNorm tutorial (05-layer-norm) lays them out, so a reader of it
reads these at sight: kernels at module level, row strides passed in, a forward that
keeps the row in registers when it fits one block, and a backward that reduces dW/dB
through a [GROUP_SIZE_M, N] partial buffer and a second small kernel instead of a full
[rows, N] buffer. Three changes, each for a reason:

- Where a row fits one block, a program handles a [BLOCK_M, BLOCK_N] tile of BLOCK_M
  rows, not one row: for small N one row leaves most of a program idle (a common
  production layout), and Triton's interpreter, which runs every program as Python at a
  cost per operation rather than per element, does BLOCK_M rows for the price of one.
  Longer rows are walked one row a program in 1-D blocks, as in the tutorial.
- The backward launches GROUP_SIZE_M programs, each walking the row blocks whose index
  is its own modulo GROUP_SIZE_M (the tutorial's `row % GROUP_SIZE_M` lock id) and so
  the only writer of its row of the partial buffer: no lock, and the same bits every
  call (the backend declares `deterministic`).
- A backward of one program (every row in one tile) is handed the final dW, dB buffers:
  its partial row is the sum, and the second kernel is not launched.

One change of spelling: sums are `tl.reduce(x, axis, _add)` and zeros `tl.full`, not
`tl.sum` and `tl.zeros`. Those two are @triton.jit functions themselves, and Triton's
interpreter patches its whole language module again at every call of one (measured
here: a quarter of this backend's time in a run, thousands of calls); `tl.reduce` and
`tl.full` are builtins. On a GPU it is the same reduction (`_add` is tl.sum's own combine
function); in the interpreter, one np.sum.

Statistics accumulate in float32 (float64 for float64 inputs, ACC64); the variance is
two-pass, so a large mean does not cancel it. Imported by the triton adapter only when
the backend is loaded (it imports triton, whose interpreter must be chosen before).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plain_add(a, b):
    return a + b


#: tl.sum's combine function, which the interpreter reduces with one np.sum; Triton names
#: it privately, so where a release renames it a plain add is the same sum (checked here:
#: every case passes), reduced by the interpreter's generic path one pair at a time,
#: some 50 times slower
_add = getattr(tl.standard, "_sum_combine", _plain_add)


@triton.jit
def norm_fwd(X, Y, W, B, Mean, Rstd, stride_xm, stride_xn, stride_ym, M, N, eps, mean_scale,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
             CENTRE: tl.constexpr, ACC64: tl.constexpr):
    """Y = (X - mean) * rstd * W (+ B).

    CENTRE (LayerNorm): two-pass mean and centred sum of squares; otherwise (RMSNorm)
    the mean is 0, the raw mean square is used and B is not read. Mean and Rstd (1/std)
    are stored per row for the backward. ONE_BLOCK (N <= BLOCK_N): a program loads a
    [BLOCK_M, BLOCK_N] tile of BLOCK_M rows once and keeps it in registers; otherwise
    (BLOCK_M = 1) it takes one row in three passes over column blocks, as the tutorial.
    The mean is the sum of x * mean_scale (2^-k, 2^k >= N) over N * mean_scale: with
    2^k >= N the sum cannot overflow (a constant row of 8.5e37 gives beta, not NaN:
    pytorch #173793), and scaling by a power of two is exact above the subnormal range,
    so it has the same bits as sum / N there (rows of |x| below ~2^k times the smallest
    normal of the accumulation type, 1.2e-38 in float32, lose low bits)."""
    acc_t = tl.float64 if ACC64 else tl.float32
    if ONE_BLOCK:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        # 64-bit row offsets: rows * stride passes 2**31 on large inputs
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + r64 * stride_xm + (cols * stride_xn)[None, :], mask=mask,
                    other=0.0).to(acc_t)
        if CENTRE:
            mean = tl.reduce(x * mean_scale, 1, _add) / (tl.cast(N, acc_t) * mean_scale)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        else:
            mean = 0.0
            xc = x
        var = tl.reduce(xc * xc, 1, _add) / N
        # padding rows get 1, not eps: no division by zero where eps = 0
        rstd = 1.0 / tl.sqrt(tl.where(row_ok, var + eps, 1.0))
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(acc_t)
        y = xc * rstd[:, None] * w[None, :]
        if CENTRE:
            y += tl.load(B + cols, mask=col_ok, other=0.0).to(acc_t)[None, :]
        tl.store(Y + r64 * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + rows, mean, mask=row_ok)
        tl.store(Rstd + rows, rstd, mask=row_ok)
    else:
        row = tl.program_id(0)
        X += tl.cast(row, tl.int64) * stride_xm
        Y += tl.cast(row, tl.int64) * stride_ym
        mean = 0.0
        if CENTRE:
            total = tl.full([BLOCK_N], 0.0, acc_t)
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                total += tl.load(X + cols * stride_xn, mask=cols < N,
                                 other=0.0).to(acc_t) * mean_scale
            mean = tl.reduce(total, 0, _add) / (tl.cast(N, acc_t) * mean_scale)
        sq = tl.full([BLOCK_N], 0.0, acc_t)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            x = tl.load(X + cols * stride_xn, mask=cols < N, other=0.0).to(acc_t)
            xc = tl.where(cols < N, x - mean, 0.0)
            sq += xc * xc
        rstd = 1.0 / tl.sqrt(tl.reduce(sq, 0, _add) / N + eps)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(X + cols * stride_xn, mask=mask, other=0.0).to(acc_t)
            w = tl.load(W + cols, mask=mask, other=0.0).to(acc_t)
            y = (x - mean) * rstd * w
            if CENTRE:
                y += tl.load(B + cols, mask=mask, other=0.0).to(acc_t)
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)


@triton.jit
def _bwd_block(x_row, g_row, W, cols, mask, stride_xn, stride_gn, mean, rstd,
               acc_t: tl.constexpr):
    """One column block of a long row in the backward: (g, x_hat, h = g W) in acc_t, zero
    outside the row. Both passes over the row load it again (the row does not fit)."""
    x = tl.load(x_row + cols * stride_xn, mask=mask, other=0.0).to(acc_t)
    g = tl.load(g_row + cols * stride_gn, mask=mask, other=0.0).to(acc_t)
    w = tl.load(W + cols, mask=mask, other=0.0).to(acc_t)
    return g, tl.where(mask, (x - mean) * rstd, 0.0), g * w


@triton.jit
def norm_bwd(X, G, W, Mean, Rstd, DX, DW, DB, stride_xm, stride_xn, stride_gm, stride_gn,
             stride_dxm, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             ONE_BLOCK: tl.constexpr, CENTRE: tl.constexpr, ACC64: tl.constexpr):
    """dx = rstd (h - mean(h) - x_hat mean(h x_hat)), h = g W (RMSNorm: without the
    mean(h) term), and this program's share of dW = sum g x_hat and dB = sum g.

    Program p of GROUP_SIZE_M = num_programs walks row blocks p, p + GROUP_SIZE_M, ...
    and adds its rows' dW, dB into row p of the partial buffers DW, DB ([GROUP_SIZE_M, N];
    DB is not touched without CENTRE); `group_sum` then adds the GROUP_SIZE_M rows.
    ONE_BLOCK: a row block is a [BLOCK_M, BLOCK_N] tile in registers, and so is the
    program's dW, dB, stored once at the end (a lone program, GROUP_SIZE_M = 1, may be
    handed the final dW, dB buffers, its row being the sum). Otherwise (BLOCK_M = 1,
    partial buffers zeroed by the caller) each row takes two passes over column blocks,
    the second adding into the partial rows, as the tutorial."""
    acc_t = tl.float64 if ACC64 else tl.float32
    group = tl.program_id(0)
    n_groups = tl.num_programs(0)
    DW += group * N
    DB += group * N
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(acc_t)[None, :]
        x_cols = (cols * stride_xn)[None, :]
        g_cols = (cols * stride_gn)[None, :]
        dw = tl.full([BLOCK_M, BLOCK_N], 0.0, acc_t)
        if CENTRE:
            db = tl.full([BLOCK_M, BLOCK_N], 0.0, acc_t)
        for start in range(group * BLOCK_M, M, n_groups * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(X + r64 * stride_xm + x_cols, mask=mask, other=0.0).to(acc_t)
            g = tl.load(G + r64 * stride_gm + g_cols, mask=mask, other=0.0).to(acc_t)
            mean = tl.load(Mean + rows, mask=row_ok, other=0.0)[:, None]
            rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)[:, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            h = g * w
            c1 = tl.reduce(h * xhat, 1, _add)[:, None] / N
            if CENTRE:
                c2 = tl.reduce(h, 1, _add)[:, None] / N
                dx = (h - c2 - xhat * c1) * rstd
                db += g
            else:
                dx = (h - xhat * c1) * rstd
            tl.store(DX + r64 * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw += g * xhat
        # cast to DW's dtype: with one group the caller passes the final buffers
        tl.store(DW + cols, tl.reduce(dw, 0, _add).to(DW.dtype.element_ty), mask=col_ok)
        if CENTRE:
            tl.store(DB + cols, tl.reduce(db, 0, _add).to(DB.dtype.element_ty), mask=col_ok)
    else:
        for row in range(group, M, n_groups):
            x_row = X + tl.cast(row, tl.int64) * stride_xm
            g_row = G + tl.cast(row, tl.int64) * stride_gm
            dx_row = DX + tl.cast(row, tl.int64) * stride_dxm
            mean = tl.load(Mean + row)
            rstd = tl.load(Rstd + row)
            if CENTRE:
                sh = tl.full([BLOCK_N], 0.0, acc_t)
            shx = tl.full([BLOCK_N], 0.0, acc_t)
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = cols < N
                g, xhat, h = _bwd_block(x_row, g_row, W, cols, mask, stride_xn, stride_gn,
                                        mean, rstd, acc_t)
                if CENTRE:
                    sh += h
                shx += h * xhat
            c1 = tl.reduce(shx, 0, _add) / N
            if CENTRE:
                c2 = tl.reduce(sh, 0, _add) / N
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = cols < N
                g, xhat, h = _bwd_block(x_row, g_row, W, cols, mask, stride_xn, stride_gn,
                                        mean, rstd, acc_t)
                if CENTRE:
                    dx = (h - c2 - xhat * c1) * rstd
                else:
                    dx = (h - xhat * c1) * rstd
                tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)
                # this program is the only writer of its partial row: a plain
                # read-add-store, no lock
                tl.store(DW + cols, tl.load(DW + cols, mask=mask, other=0.0) + g * xhat,
                         mask=mask)
                if CENTRE:
                    tl.store(DB + cols, tl.load(DB + cols, mask=mask, other=0.0) + g,
                             mask=mask)


@triton.jit
def group_sum(DW, DB, FINAL_DW, FINAL_DB, GROUPS, N, HAS_DW: tl.constexpr,
              HAS_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """FINAL_DW[j] = sum over the GROUPS rows of DW[:, j] (and FINAL_DB from DB), stored
    in the parameters' dtype: the tutorial's `_layer_norm_bwd_dwdb`, BLOCK_N columns per
    program, in a fixed order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_DW:
        dw = tl.full([BLOCK_M, BLOCK_N], 0.0, DW.dtype.element_ty)
    if HAS_DB:
        db = tl.full([BLOCK_M, BLOCK_N], 0.0, DB.dtype.element_ty)
    for start in range(0, GROUPS, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < GROUPS) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        if HAS_DW:
            dw += tl.load(DW + offs, mask=mask, other=0.0)
        if HAS_DB:
            db += tl.load(DB + offs, mask=mask, other=0.0)
    if HAS_DW:
        tl.store(FINAL_DW + cols, tl.reduce(dw, 0, _add).to(FINAL_DW.dtype.element_ty),
                 mask=cols < N)
    if HAS_DB:
        tl.store(FINAL_DB + cols, tl.reduce(db, 0, _add).to(FINAL_DB.dtype.element_ty),
                 mask=cols < N)


@triton.jit
def bn_fwd(X, Y, W, B, Mean, Var, stride_xn, stride_xc, stride_xl, N, C, L, eps, mean_scale,
           USE_BATCH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
           ONE_BLOCK: tl.constexpr, ACC64: tl.constexpr):
    """BatchNorm forward of an [N, C, L] input (strides passed in), BLOCK_C channels a
    program; Y is contiguous. With USE_BATCH the channels' statistics (biased variance,
    two-pass) are computed and stored, otherwise Mean and Var are read (eval).
    ONE_BLOCK (N * L <= BLOCK_M): a channel's samples are one [BLOCK_C, BLOCK_M] tile,
    loaded once; otherwise they are walked BLOCK_M at a time, three passes. The mean is
    summed as norm_fwd's is (x * mean_scale, 2^-k with 2^k >= N * L)."""
    acc_t = tl.float64 if ACC64 else tl.float32
    chans = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = chans < C
    X += chans.to(tl.int64)[:, None] * stride_xc
    Y += chans.to(tl.int64)[:, None] * L
    m = N * L
    if ONE_BLOCK:
        idx = tl.arange(0, BLOCK_M)
        mask = c_ok[:, None] & (idx < m)[None, :]
        n_i = (idx // L).to(tl.int64)
        l_i = idx % L
        x = tl.load(X + (n_i * stride_xn + l_i * stride_xl)[None, :], mask=mask,
                    other=0.0).to(acc_t)
        if USE_BATCH:
            mean = tl.reduce(x * mean_scale, 1, _add) / (tl.cast(m, acc_t) * mean_scale)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            var = tl.reduce(xc * xc, 1, _add) / m
            tl.store(Mean + chans, mean, mask=c_ok)
            tl.store(Var + chans, var, mask=c_ok)
        else:
            mean = tl.load(Mean + chans, mask=c_ok, other=0.0).to(acc_t)
            var = tl.load(Var + chans, mask=c_ok, other=0.0).to(acc_t)
            xc = x - mean[:, None]
        # padding channels get 1, not eps: no division by zero where eps = 0
        rstd = 1.0 / tl.sqrt(tl.where(c_ok, var + eps, 1.0))
        w = tl.load(W + chans, mask=c_ok, other=0.0).to(acc_t)
        b = tl.load(B + chans, mask=c_ok, other=0.0).to(acc_t)
        y = xc * rstd[:, None] * w[:, None] + b[:, None]
        tl.store(Y + (n_i * C * L + l_i)[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        if USE_BATCH:
            total = tl.full([BLOCK_C, BLOCK_M], 0.0, acc_t)
            for off in range(0, m, BLOCK_M):
                idx = off + tl.arange(0, BLOCK_M)
                mask = c_ok[:, None] & (idx < m)[None, :]
                sample = (idx // L).to(tl.int64) * stride_xn + (idx % L) * stride_xl
                total += tl.load(X + sample[None, :], mask=mask,
                                 other=0.0).to(acc_t) * mean_scale
            mean = tl.reduce(total, 1, _add) / (tl.cast(m, acc_t) * mean_scale)
            sq = tl.full([BLOCK_C, BLOCK_M], 0.0, acc_t)
            for off in range(0, m, BLOCK_M):
                idx = off + tl.arange(0, BLOCK_M)
                mask = c_ok[:, None] & (idx < m)[None, :]
                sample = (idx // L).to(tl.int64) * stride_xn + (idx % L) * stride_xl
                x = tl.load(X + sample[None, :], mask=mask, other=0.0).to(acc_t)
                xc = tl.where(mask, x - mean[:, None], 0.0)
                sq += xc * xc
            var = tl.reduce(sq, 1, _add) / m
            tl.store(Mean + chans, mean, mask=c_ok)
            tl.store(Var + chans, var, mask=c_ok)
        else:
            mean = tl.load(Mean + chans, mask=c_ok, other=0.0).to(acc_t)
            var = tl.load(Var + chans, mask=c_ok, other=0.0).to(acc_t)
        rstd = 1.0 / tl.sqrt(tl.where(c_ok, var + eps, 1.0))
        w = tl.load(W + chans, mask=c_ok, other=0.0).to(acc_t)
        b = tl.load(B + chans, mask=c_ok, other=0.0).to(acc_t)
        for off in range(0, m, BLOCK_M):
            idx = off + tl.arange(0, BLOCK_M)
            mask = c_ok[:, None] & (idx < m)[None, :]
            sample = (idx // L).to(tl.int64) * stride_xn + (idx % L) * stride_xl
            x = tl.load(X + sample[None, :], mask=mask, other=0.0).to(acc_t)
            y = (x - mean[:, None]) * rstd[:, None] * w[:, None] + b[:, None]
            out = (idx // L).to(tl.int64) * C * L + idx % L
            tl.store(Y + out[None, :], y.to(Y.dtype.element_ty), mask=mask)
