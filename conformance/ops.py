"""One comparison routine per op: build the inputs in the dtype under test, call the
backend through the guarded context, compute the oracle on the very same (rounded)
inputs, and compare every output and gradient under the tolerance table's bound.

The scale each element is measured at is the magnitude of the terms its formula adds
up (see tolerances.py), computed from the oracle's float64 quantities."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from .assertions import CheckFailure, Measure, assert_conforms, assert_holds
from .tolerances import bound, centring_kappa, shift_kappa


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _like(x, names, weight_shape=None, with_bias=False, with_weight=False):
    out = {"output": (x.shape, x.dtype)}
    if "grad_input" in names:
        out["grad_input"] = (x.shape, x.dtype)
        if with_weight:
            out["grad_weight"] = (weight_shape, x.dtype)
        if with_bias:
            out["grad_bias"] = (weight_shape, x.dtype)
    return out


def _fmt_shape(shape):
    return repr(tuple(shape))


def layer_norm_case(ctx, *, x, normalized_shape, weight=None, bias=None, eps=1e-5,
                    grad=None) -> Measure:
    """F2 forward (and VJP when `grad` is given) of the backend against the oracle."""
    xa, w, b, g = ctx.use(x=x, weight=weight, bias=bias, grad=grad)
    shape = tuple(normalized_shape)
    code = f"result = backend.layer_norm(x, {_fmt_shape(shape)}, weight, bias, {eps!r}" + \
           (", grad_output=grad)" if grad is not None else ")")
    res = ctx.call(code, ctx.backend.layer_norm, xa, shape, w, b, eps, g,
                   outputs_like=_like(xa, ["grad_input"] if g is not None else [], shape,
                                      b is not None, w is not None),
                   refusable=eps == 0 and not eps_zero_accepted(ctx, "layer_norm"))
    ctx.calls.append(f"expected = spec.layer_norm(x, {_fmt_shape(shape)}, weight, bias, {eps!r})")
    x64, w64, b64 = _f64(xa), _f64(w), _f64(b)
    axes = tuple(range(x64.ndim - len(shape), x64.ndim))
    x_hat = spec.layer_norm(x64, shape, eps=eps)
    kappa = centring_kappa(x64, axes, eps)
    d = int(np.prod(shape))
    gamma = np.abs(w64) if w64 is not None else 1.0
    beta = np.abs(b64) if b64 is not None else 0.0
    # max(|x_hat|, 1): the mean's rounding error reaches the output as gamma * delta_mu * r
    # even where x_hat is 0 (d = 1, constant rows), so gamma itself bounds the error's scale
    scale = np.max(np.maximum(np.abs(x_hat), 1.0) * gamma + beta, axis=axes, keepdims=True)
    m = assert_conforms(expected=spec.layer_norm(x64, shape, w64, b64, eps), actual=res.output,
                        dtype=ctx.dtype, scale=scale, bound=bound("output", ctx.dtype, d, kappa),
                        what="layer_norm output", call=code, repro=ctx.repro())
    if g is None:
        return m
    g64 = _f64(g)
    gx, gw, gb = spec.layer_norm_vjp(x64, shape, g64, w64, b64, eps)
    r = 1.0 / np.sqrt(x64.var(axis=axes, keepdims=True) + eps)
    h = np.abs(g64 * (w64 if w64 is not None else 1.0))
    m.absorb(assert_conforms(expected=gx, actual=res.grad_input, dtype=ctx.dtype,
                             scale=_grad_input_scale(r, h, x_hat, axes, centre=True),
                             bound=bound("gradient", ctx.dtype, d, kappa),
                             what="layer_norm grad_input", call=code, repro=ctx.repro()))
    _param_grads(ctx, m, code, "layer_norm", g64, x_hat, tuple(range(axes[0])), gw, gb, res,
                 kappa)
    return m


def _grad_input_scale(r, h, x_hat, axes, *, centre):
    """The magnitude of the terms of dL/dx = r (h - mean(h) - x_hat mean(h x_hat)) over
    the normalized `axes` (no mean(h) term for RMSNorm), with h = |g gamma|."""
    terms = np.max(h, axis=axes, keepdims=True) + np.max(np.abs(x_hat), axis=axes, keepdims=True) \
        * (h * np.abs(x_hat)).mean(axis=axes, keepdims=True)
    if centre:
        terms = terms + h.mean(axis=axes, keepdims=True)
    return r * terms


def _param_grads(ctx, m, code, op, g64, x_hat, sum_axes, gw, gb, res, kappa, bias_kappa=1.0):
    """dL/dgamma, dL/dbeta: sums over `sum_axes` of terms that each carry the forward's
    error, so the growth covers both reductions: n = every element of g."""
    n = g64.size
    if gw is not None:
        m.absorb(assert_conforms(expected=gw, actual=res.grad_weight, dtype=ctx.dtype,
                                 scale=(np.abs(g64) * np.maximum(np.abs(x_hat), 1.0)).sum(axis=sum_axes),
                                 bound=bound("param_gradient", ctx.dtype, n, np.max(kappa)),
                                 what=f"{op} grad_weight", call=code, repro=ctx.repro()))
    if gb is not None:
        m.absorb(assert_conforms(expected=gb, actual=res.grad_bias, dtype=ctx.dtype,
                                 scale=np.abs(g64).sum(axis=sum_axes),
                                 bound=bound("param_gradient", ctx.dtype, n, bias_kappa),
                                 what=f"{op} grad_bias", call=code, repro=ctx.repro()))


def eps_zero_accepted(ctx, op) -> bool:
    """Whether the backend's conventions say it accepts eps = 0 for `op` (default yes)."""
    conv = getattr(ctx.conventions, "eps_zero", {}) or {}
    return bool(conv.get(op, True))


def rms_norm_case(ctx, *, x, normalized_shape, weight=None, eps=1e-6, grad=None) -> Measure:
    """F3 forward (and VJP when `grad` is given) of the backend against the oracle."""
    xa, w, g = ctx.use(x=x, weight=weight, grad=grad)
    shape = tuple(normalized_shape)
    code = f"result = backend.rms_norm(x, {_fmt_shape(shape)}, weight, {eps!r}" + \
           (", grad_output=grad)" if grad is not None else ")")
    res = ctx.call(code, ctx.backend.rms_norm, xa, shape, w, eps, g,
                   outputs_like=_like(xa, ["grad_input"] if g is not None else [], shape,
                                      False, w is not None),
                   refusable=eps == 0 and not eps_zero_accepted(ctx, "rms_norm"))
    ctx.calls.append(f"expected = spec.rms_norm(x, {_fmt_shape(shape)}, weight, {eps!r})")
    x64, w64 = _f64(xa), _f64(w)
    axes = tuple(range(x64.ndim - len(shape), x64.ndim))
    d = int(np.prod(shape))
    x_r = spec.rms_norm(x64, shape, eps=eps)
    gamma = np.abs(w64) if w64 is not None else 1.0
    scale = np.max(np.abs(x_r) * gamma, axis=axes, keepdims=True)
    m = assert_conforms(expected=spec.rms_norm(x64, shape, w64, eps), actual=res.output,
                        dtype=ctx.dtype, scale=scale, bound=bound("output", ctx.dtype, d),
                        what="rms_norm output", call=code, repro=ctx.repro())
    if g is None:
        return m
    g64 = _f64(g)
    gx, gw = spec.rms_norm_vjp(x64, shape, g64, w64, eps)
    r = 1.0 / np.sqrt((x64 * x64).mean(axis=axes, keepdims=True) + eps)
    h = np.abs(g64 * (w64 if w64 is not None else 1.0))
    m.absorb(assert_conforms(expected=gx, actual=res.grad_input, dtype=ctx.dtype,
                             scale=_grad_input_scale(r, h, x_r, axes, centre=False),
                             bound=bound("gradient", ctx.dtype, d),
                             what="rms_norm grad_input", call=code, repro=ctx.repro()))
    _param_grads(ctx, m, code, "rms_norm", g64, x_r, tuple(range(axes[0])), gw, None, res, 1.0)
    return m


def qk_scores_case(ctx, *, q, k, q_weight=None, k_weight=None, eps=1e-6, scale=None):
    """F6 scores of the backend against the oracle; returns (measure, got, expected)."""
    qa, ka, qw, kw = ctx.use(q=q, k=k, q_weight=q_weight, k_weight=k_weight)
    d = qa.shape[-1]
    s = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    code = f"scores = backend.qk_norm_scores(q, k, q_weight, k_weight, {eps!r}, {s!r})"
    out_shape = qa.shape[:-1] + (ka.shape[-2],)
    got = ctx.call(code, ctx.backend.qk_norm_scores, qa, ka, qw, kw, eps, s,
                   outputs_like={"output": (out_shape, qa.dtype)},
                   refusable=eps == 0 and not eps_zero_accepted(ctx, "qk_norm_scores"))
    ctx.calls.append(f"expected = spec.qk_norm_scores(q, k, q_weight, k_weight, {eps!r}, {s!r})")
    q64, k64 = _f64(qa), _f64(ka)
    expected = spec.qk_norm_scores(q64, k64, _f64(qw), _f64(kw), eps, s)
    # each score is a dot product of d products of normalized entries: scale = sum |terms|
    qh = np.abs(spec.rms_norm(q64, (d,), _f64(qw), eps))
    kh = np.abs(spec.rms_norm(k64, (d,), _f64(kw), eps))
    term_scale = np.matmul(qh, np.swapaxes(kh, -1, -2)) * abs(s)
    row_scale = np.max(term_scale, axis=-1, keepdims=True)
    m = assert_conforms(expected=expected, actual=got, dtype=ctx.dtype, scale=row_scale,
                        bound=bound("scores", ctx.dtype, d), what="qk_norm_scores",
                        call=code, repro=ctx.repro())
    return m, got, expected


class BatchNormDriver:
    """A backend BatchNorm layer driven step by step beside the oracle's pure functions.

    Every step compares the output (and gradients, and running statistics) with the
    oracle, which starts each step from the statistics the backend actually holds, so
    one step's error is judged at a time and rounding does not accumulate."""

    def __init__(self, ctx, num_features, *, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, weight=None, bias=None, compare_stats=True,
                 defer_stats=False):
        self.ctx, self.eps, self.momentum = ctx, eps, momentum
        self.compare_stats = compare_stats
        # defer_stats: a running-statistics failure is kept (raise_deferred) instead of
        # raised, so that it does not hide the comparisons of the steps after it
        self.defer_stats, self.deferred = defer_stats, []
        self.affine, self.track = affine, track_running_stats
        w, b = ctx.use(weight=weight, bias=bias) if affine else (None, None)
        self.w, self.b = w, b
        self.steps = 0
        self.measure = Measure()
        code = (f"layer = backend.batch_norm({num_features}, eps={eps!r}, momentum={momentum!r}, "
                f"affine={affine}, track_running_stats={track_running_stats}, "
                f"dtype={ctx.dtype_name!r}, weight=weight, bias=bias)")
        self.layer = ctx.call(code, lambda: ctx.backend.batch_norm(
            num_features, eps=eps, momentum=momentum, affine=affine,
            track_running_stats=track_running_stats, dtype=ctx.dtype, weight=w, bias=b))
        self.rm, self.rv = self._stats("initial")

    def _stats(self, when):
        rm, rv = self.layer.running_mean, self.layer.running_var
        if not self.track:
            assert_holds(condition=rm is None and rv is None,
                         got=f"running statistics {rm!r}, {rv!r} ({when})",
                         spec_says="none are kept with track_running_stats=False",
                         call="layer.running_mean, layer.running_var", repro=self.ctx.repro())
            return None, None
        for name, v in (("running_mean", rm), ("running_var", rv)):
            if not isinstance(v, np.ndarray) or v.dtype not in spec.FLOAT_DTYPES:
                raise CheckFailure(f"got layer.{name} = {v!r} ({when}), but the protocol says a "
                                   f"floating NumPy array [layer.{name}]", repro=self.ctx.repro())
        return rm.copy(), rv.copy()

    def _w64(self):
        return _f64(self.w), _f64(self.b)

    def _scale_and_kappa(self, x64, mean, var, use_batch):
        """The channel's output scale and the conditioning kappa (tolerances.py): centring
        by the batch's computed mean, or shifting by the given running mean in eval."""
        axes = (0,) + tuple(range(2, x64.ndim))
        bshape = (1, x64.shape[1]) + (1,) * (x64.ndim - 2)
        w64, b64 = self._w64()
        x_hat = np.abs(x64 - mean.reshape(bshape)) / np.sqrt(var.reshape(bshape) + self.eps)
        gamma = np.abs(w64).reshape(bshape) if w64 is not None else 1.0
        beta = np.abs(b64).reshape(bshape) if b64 is not None else 0.0
        # as for LayerNorm: the mean's error reaches the output even where x_hat is 0
        scale = np.max(np.maximum(x_hat, 1.0) * gamma + beta, axis=axes, keepdims=True)
        if use_batch:
            kappa = centring_kappa(x64, axes, self.eps)
        else:
            kappa = shift_kappa(mean.reshape(bshape), var.reshape(bshape), self.eps)
        return scale, kappa, axes

    def set_mode(self, training: bool):
        self.ctx.call("layer.train()" if training else "layer.eval()",
                      self.layer.train if training else self.layer.eval)

    def step(self, name, x_recipe, *, mode, grad=None, what=None, check_output=True):
        """One forward: mode "train", "eval" or "no_grad" (a no-grad forward in whatever
        mode the layer is in: `training` says which). Returns the backend's output."""
        ctx = self.ctx
        xa = ctx.use(**{name: x_recipe})
        g = ctx.use(**{f"{name}_grad": grad}) if grad is not None else None
        x64 = _f64(xa)
        training = mode == "train" or (mode == "no_grad" and self.training_flag)
        refusable = self.eps == 0 and not eps_zero_accepted(ctx, "batch_norm") and training
        if mode == "no_grad":
            code = f"out = layer.forward_no_grad({name})"
            res = ctx.call(code, self.layer.forward_no_grad, xa,
                           outputs_like={"output": (xa.shape, xa.dtype)}, refusable=refusable)
            out = res
        else:
            code = f"result = layer.forward({name}" + \
                (f", grad_output={name}_grad)" if g is not None else ")")
            like = {"output": (xa.shape, xa.dtype)}
            if g is not None:
                like["grad_input"] = (xa.shape, xa.dtype)
            res = ctx.call(code, self.layer.forward, xa, g, outputs_like=like, refusable=refusable)
            out = res.output
        w64, b64 = self._w64()
        use_batch = training or not self.track
        label = what or f"batch_norm {mode} output"
        if use_batch:
            expected, rm, rv = spec.batch_norm_train(
                x64, None if not training or not self.track else _f64(self.rm),
                None if not training or not self.track else _f64(self.rv),
                w64, b64, self.momentum, self.eps, num_batches_tracked=self.steps)
            axes = (0,) + tuple(range(2, x64.ndim))
            mean, var = x64.mean(axis=axes), x64.var(axis=axes)
            n = x64.size // x64.shape[1]
        else:
            expected = spec.batch_norm_eval(x64, _f64(self.rm), _f64(self.rv), w64, b64, self.eps)
            mean, var, n, rm, rv = _f64(self.rm), _f64(self.rv), 1, None, None
        scale, kappa, axes = self._scale_and_kappa(x64, mean, var, use_batch)
        ctx.calls.append(f"# oracle: spec.batch_norm_{'train' if use_batch else 'eval'}(...)")
        m = Measure()
        if check_output:
            m = assert_conforms(expected=expected, actual=out, dtype=ctx.dtype, scale=scale,
                                bound=bound("output", ctx.dtype, n, kappa), what=label,
                                call=code, repro=ctx.repro())
        if g is not None:
            m.absorb(self._compare_grads(code, x64, _f64(g), res, use_batch, mean, var, n, kappa))
        if training and self.track:
            self.steps += 1
            m.absorb(self._compare_stats(rm, rv, x64, n, code))
            self._compare_count(code)
        elif self.track:
            self._compare_count(code)
            new_rm, new_rv = self._stats(f"after {mode} forward")
            for nm, before, after in (("running_mean", self.rm, new_rm), ("running_var", self.rv, new_rv)):
                assert_holds(condition=np.array_equal(before, after, equal_nan=True),
                             got=f"{nm} changed by an eval-mode forward",
                             spec_says="eval uses the running statistics and leaves them alone (F5)",
                             call=code, repro=ctx.repro())
        self.measure.absorb(m)
        return out

    def _compare_grads(self, code, x64, g64, res, use_batch, mean, var, n, kappa):
        """Every gradient against the oracle's VJP: the training one where the batch's
        statistics normalize (they depend on x), the eval one where the running ones do
        (constants: dL/dx = gamma g r, no reduction)."""
        ctx = self.ctx
        w64, b64 = self._w64()
        axes = (0,) + tuple(range(2, x64.ndim))
        bshape = (1, x64.shape[1]) + (1,) * (x64.ndim - 2)
        r = 1.0 / np.sqrt(var.reshape(bshape) + self.eps)
        x_hat = (x64 - mean.reshape(bshape)) * r
        h = np.abs(g64 * (w64.reshape(bshape) if w64 is not None else 1.0))
        if use_batch:
            gx, gw, gb = spec.batch_norm_train_vjp(x64, g64, w64, b64, self.eps)
            scale = _grad_input_scale(r, h, x_hat, axes, centre=True)
            gx_bound, bias_kappa = bound("gradient", ctx.dtype, n, kappa), np.max(kappa)
        else:
            gx, gw, gb = spec.batch_norm_eval_vjp(x64, g64, mean, var, w64, b64, self.eps)
            # the channel's largest |gamma g r|: the group's scale, as for every quantity
            scale = r * np.max(h, axis=axes, keepdims=True)
            # dL/dbeta = sum g whatever the statistics: nothing is centred in it
            gx_bound, bias_kappa = bound("eval_gradient", ctx.dtype, 1), 1.0
        m = assert_conforms(expected=gx, actual=res.grad_input, dtype=ctx.dtype, scale=scale,
                            bound=gx_bound, what="batch_norm grad_input", call=code,
                            repro=ctx.repro())
        _param_grads(ctx, m, code, "batch_norm", g64, x_hat, axes, gw, gb, res, kappa,
                     bias_kappa=bias_kappa)
        return m

    def _compare_count(self, code):
        """num_batches_tracked, where the layer exposes one: the training forwards so far."""
        count = getattr(self.layer, "num_batches_tracked", None)
        if count is None:
            return
        assert_holds(condition=int(count) == self.steps,
                     got=f"layer.num_batches_tracked = {count}",
                     spec_says=f"{self.steps}, one per training forward with running "
                               f"statistics (F4)", call=code, repro=self.ctx.repro())

    @property
    def training_flag(self):
        return bool(getattr(self.layer, "training", True))

    def _compare_stats(self, rm_ref, rv_ref, x64, m_count, code):
        ctx = self.ctx
        old_rm, old_rv = _f64(self.rm), _f64(self.rv)
        self.rm, self.rv = self._stats("after a training forward")
        if not self.compare_stats:
            return Measure()
        a = 1.0 / self.steps if self.momentum is None else self.momentum
        axes = (0,) + tuple(range(2, x64.ndim))
        mean_abs = np.abs(x64).mean(axis=axes)
        v_u = x64.var(axis=axes) * m_count / max(m_count - 1, 1)
        meas = Measure()
        for nm, ref, got, sc in (
                ("running_mean", rm_ref, self.rm, (1 - a) * np.abs(old_rm) + a * mean_abs),
                ("running_var", rv_ref, self.rv, (1 - a) * np.abs(old_rv) + a * v_u)):
            try:
                meas.absorb(assert_conforms(expected=ref, actual=got, dtype=got.dtype, scale=sc,
                                            bound=bound("running_stat", got.dtype, m_count),
                                            what=f"layer.{nm}", call=code, repro=ctx.repro()))
            except CheckFailure as exc:
                if not self.defer_stats:
                    raise
                self.deferred.append(exc)
        return meas

    def raise_deferred(self):
        """Raise the first running-statistics failure that defer_stats kept, if any."""
        if self.deferred:
            raise self.deferred[0]
