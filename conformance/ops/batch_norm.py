"""F1/F4/F5 BatchNorm: a backend layer driven step by step beside the oracle's pure
functions."""

from __future__ import annotations

from collections.abc import Callable

import normspec.spec as spec
import numpy as np

from ..assertions import CheckFailure
from ..diagnosis import Alternatives
from ..tolerances import (
    batch_moments,
    bound,
    centred_output_scale,
    grad_input_scale,
    reported_stats_ulps,
    running_stat_bound,
    running_stat_scales,
    shift_kappa,
)
from ._common import Judged, compare_param_grads, f64

#: what the harness calls on a layer batch_norm() returns (impls/protocol.BatchNormLayer;
#: forward_no_grad only where the backend's capabilities say so)
LAYER_METHODS = ("forward", "train", "eval")


def _describe(a) -> str:
    return "None" if a is None else f"an array of shape {np.shape(a)}"


def _layout(x64):
    """Reduction axes (all but the channel axis 1) and the broadcast shape of a channel."""
    return (0,) + tuple(range(2, x64.ndim)), (1, x64.shape[1]) + (1,) * (x64.ndim - 2)


def _channel(p, bshape):
    return None if p is None else p.reshape(bshape)


def _exact_count(count, steps: int) -> bool:
    """Whether `count` (a number or a 0-d array of one, integer or float: the protocol does
    not type it) is exactly `steps`."""
    try:
        value = np.asarray(count)
    except Exception:  # noqa: BLE001 - whatever the layer holds
        return False
    return value.shape == () and value.dtype.kind in "iuf" and bool(value == steps)


class BatchNormDriver:
    """A backend BatchNorm layer driven step by step beside the oracle.

    Every step compares the output (and gradients, and running statistics) with the
    oracle, which starts each step from the statistics the backend actually holds, so
    one step's error is judged at a time and rounding does not accumulate. The repro
    snippet gets the same steps, each followed by the oracle's answer and a comparison.

    A declared `running_var_estimator = "biased"` is a convention the spec does not
    share: a running variance that misses the spec's unbiased update but meets the
    biased one makes the case a deviation (with the declared reason), not a fail."""

    def __init__(self, ctx, num_features, *, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, weight=None, bias=None, compare_stats=True,
                 defer_stats=False):
        self.ctx, self.eps, self.momentum = ctx, eps, momentum
        self.compare_stats = compare_stats
        # defer_stats: a running-statistics failure is kept (raise_deferred) instead of
        # raised, so that it does not hide the comparisons of the steps after it
        self.defer_stats, self.deferred = defer_stats, []
        self.affine, self.track = affine, track_running_stats
        # registered even when None, so the repro defines every name it uses
        self.w, self.b = ctx.use(weight=weight if affine else None, bias=bias if affine else None)
        self.steps = 0
        #: the mode the driver last put the layer in (layers start in training mode),
        #: which says what a no-grad forward must do: never read back from the layer,
        #: whose own `training` could say anything (found by a review: a layer whose
        #: no-grad forward never updated its statistics, and whose `training` always read
        #: False, passed B6)
        self.training = True
        #: the last step's output as it was compared (a Judged), for checks that ask more
        self.judged = None
        code = (f"layer = backend.batch_norm({num_features}, eps={eps!r}, momentum={momentum!r}, "
                f"affine={affine}, track_running_stats={track_running_stats}, "
                f"dtype={ctx.dtype_name!r}, weight=weight, bias=bias)")
        # the oracle's gamma and beta are taken before the backend sees the arrays, which
        # are passed as arguments so that a layer that writes into them is caught
        # an affine layer made without weight or bias starts at gamma = 1, beta = 0
        self.w64 = f64(self.w) if self.w is not None or not affine else np.ones(num_features)
        self.b64 = f64(self.b) if self.b is not None or not affine else np.zeros(num_features)
        self.layer = ctx.call(code, lambda weight, bias: ctx.backend.batch_norm(
            num_features, eps=eps, momentum=momentum, affine=affine,
            track_running_stats=track_running_stats, dtype=ctx.dtype, weight=weight,
            bias=bias), self.w, self.b, arg_names=("weight", "bias"))
        # (a None here was an AttributeError error in the harness's own code: a red team)
        lacking = [n for n in LAYER_METHODS if not callable(getattr(self.layer, n, None))]
        if lacking:
            raise CheckFailure(f"got layer = {type(self.layer).__name__} with no "
                               f"{', '.join(lacking)} method, but the protocol says a "
                               f"BatchNormLayer [{code}]", protocol=True)
        self.e = ctx.effective(eps, "eps")
        self.a = ctx.effective(momentum, "momentum")
        self.rm, self.rv = self._stats("initial")
        #: the spec's running statistics after the last training step (see _held)
        self.spec_rm = self.spec_rv = None

    # ------------------------------------------------------------ state
    def _stats(self, when):
        try:
            rm, rv = self.layer.running_mean, self.layer.running_var
        except AttributeError as exc:
            if exc.obj is not self.layer or exc.name not in ("running_mean", "running_var"):
                raise  # (one raised inside the backend's property: its own error, as named)
            raise CheckFailure(f"got a layer without running statistics ({exc}; {when}), but "
                               "the protocol says a BatchNormLayer has running_mean and "
                               "running_var [layer.running_mean, layer.running_var]",
                               protocol=True) from None
        if not self.track:
            self.ctx.holds(condition=rm is None and rv is None,
                           got=f"running statistics {rm!r}, {rv!r} ({when})",
                           spec_says="none are kept with track_running_stats=False",
                           call="layer.running_mean, layer.running_var")
            return None, None
        for name, v in (("running_mean", rm), ("running_var", rv)):
            if not isinstance(v, np.ndarray) or v.dtype not in spec.FLOAT_DTYPES:
                raise CheckFailure(f"got layer.{name} = {v!r} ({when}), but the protocol says a "
                                   f"floating NumPy array [layer.{name}]", protocol=True)
        return rm.copy(), rv.copy()

    def set_mode(self, training: bool):
        self.ctx.call("layer.train()" if training else "layer.eval()",
                      self.layer.train if training else self.layer.eval)
        self.training = training

    # ------------------------------------------------------------ one step
    def step(self, name, x_recipe, *, mode, grad=None, what=None, check_output=True):
        """One forward: mode "train", "eval" or "no_grad" (a no-grad forward in whatever
        mode the layer is in: `training` says which). Returns the backend's output.
        `what` describes the output in the message (its quantity id stays the same)."""
        ctx = self.ctx
        xa = ctx.use(**{name: x_recipe})
        g = ctx.use(**{f"{name}_grad": grad}) if grad is not None else None
        x64 = f64(xa)
        training = mode == "train" or (mode == "no_grad" and self.training)
        use_batch = training or not self.track
        phase = "train" if use_batch else "eval"
        refusable = self.eps == 0 and not ctx.accepts_eps_zero("batch_norm") and training
        if self.track:
            ctx.oracle("rm, rv = layer.running_mean, layer.running_var")
        if mode == "no_grad":
            code = f"out = layer.forward_no_grad({name})"
            out = ctx.call(code, self.layer.forward_no_grad, xa,
                           outputs_like={"output": (xa.shape, xa.dtype)}, bare=True,
                           refusable=refusable)
            res, got_name = None, "out"
        else:
            code = f"result = layer.forward({name}" + \
                (f", grad_output={name}_grad)" if g is not None else ")")
            like = {"output": (xa.shape, xa.dtype)}
            if g is not None:
                like["grad_input"] = (xa.shape, xa.dtype)
                if self.affine:
                    channels = (xa.shape[1],)
                    like["grad_weight"] = like["grad_bias"] = (channels, xa.dtype)
            res = ctx.call(code, self.layer.forward, xa, g, outputs_like=like, refusable=refusable)
            out, got_name = res.output, "result.output"
        w64, b64 = self.w64, self.b64
        axes, bshape = _layout(x64)
        a = self.a
        if self.momentum is None and ctx.convention("parameter_dtype"):
            # the cumulative average's weight 1/t, as a backend holding it rounded sees it
            a = ctx.effective(1.0 / (self.steps + 1), "momentum")
        self.step_a = 1.0 / (self.steps + 1) if a is None else a
        variants = None
        if use_batch:
            keeps = training and self.track
            rm_in, rv_in = self._held() if keeps else (None, None)
            expected, rm, rv = spec.batch_norm_train(
                x64, rm_in, rv_in, w64, b64, a, self.e, num_batches_tracked=self.steps)

            def variants(pick, e=self.e):
                return Alternatives("batch_norm_train",
                                    lambda fn: fn(x64, rm_in, rv_in, w64, b64, a, e), pick,
                                    x64.size // x64.shape[1],
                                    statistics=(x64, axes, _channel(w64, bshape),
                                                _channel(b64, bshape), e))
            moments = batch_moments(x64, axes, self.e)
            mean, var, n = x64.mean(axis=axes), moments.var.reshape(-1), moments.count
            kappa = moments.kappa
            stats = "rm, rv" if keeps else "None, None"
            ctx.oracle(f"expected, new_rm, new_rv = spec.batch_norm_train({name}, {stats}, weight, "
                       f"bias, {a!r}, {self.e!r}, num_batches_tracked={self.steps})")
        else:
            mean, var = self._held()
            expected = spec.batch_norm_eval(x64, mean, var, w64, b64, self.e)
            n, rm, rv = 1, None, None
            kappa = shift_kappa(mean.reshape(bshape), var.reshape(bshape), self.e)
            ctx.oracle(f"expected = spec.batch_norm_eval({name}, rm, rv, weight, bias, {self.e!r})")
        x_hat = (x64 - mean.reshape(bshape)) / np.sqrt(var.reshape(bshape) + self.e)
        gamma = np.abs(w64).reshape(bshape) if w64 is not None else 1.0
        beta = np.abs(b64).reshape(bshape) if b64 is not None else 0.0
        if check_output:
            ctx.oracle(f"show({got_name}, expected, name='output', axes={axes!r})")
            scale = centred_output_scale(x_hat, gamma, beta, axes)
            self.judged = Judged(out, expected, scale, n, kappa)
            held = 0.0 if use_batch else self._reported(
                scale, gamma / np.sqrt(var.reshape(bshape) + self.e),
                0.5 * np.abs(x_hat) * gamma / (var.reshape(bshape) + self.e))
            ctx.conforms(expected=expected, actual=out, scale=scale,
                         bound=bound("output", ctx.dtype, n, kappa) + held,
                         quantity=f"batch_norm.{phase}.output", what=what, call=code,
                         variants=variants(0) if variants else None)
        if g is not None:
            self._compare_grads(code, name, x64, f64(g), res, use_batch, mean, var, n, kappa)
        if training and self.track:
            self.steps += 1
            self._compare_stats(rm, rv, moments, code, variants)
            self._compare_count(code)
        elif self.track:
            self._compare_count(code)
            new_rm, new_rv = self._stats(f"after {mode} forward")
            for nm, before, after in (("running_mean", self.rm, new_rm),
                                      ("running_var", self.rv, new_rv)):
                ctx.holds(condition=np.array_equal(before, after, equal_nan=True),
                          got=f"{nm} changed by an eval-mode forward",
                          spec_says="eval uses the running statistics and leaves them alone (F5)",
                          call=code)
        return out

    # ------------------------------------------------------------ comparisons
    def _compare_grads(self, code, name, x64, g64, res, use_batch, mean, var, n, kappa):
        """Every gradient against the oracle's VJP: the training one where the batch's
        statistics normalize (they depend on x), the eval one where the running ones do
        (constants: dL/dx = gamma g r, no reduction)."""
        ctx = self.ctx
        w64, b64 = self.w64, self.b64
        if not self.affine:
            ctx.holds(condition=res.grad_weight is None and res.grad_bias is None,
                      got=f"grad_weight {_describe(res.grad_weight)}, grad_bias "
                          f"{_describe(res.grad_bias)}",
                      spec_says="None for both: a layer with affine=False has no gamma or beta",
                      call=code)
        axes, bshape = _layout(x64)
        r = 1.0 / np.sqrt(var.reshape(bshape) + self.e)
        x_hat = (x64 - mean.reshape(bshape)) * r
        h = np.abs(g64 * (w64.reshape(bshape) if w64 is not None else 1.0))
        vjp: Callable | None = None  # the catalogue has no eval-mode variants
        if use_batch:
            gx, gw, gb = spec.batch_norm_train_vjp(x64, g64, w64, b64, self.e)

            def vjp(pick, e=self.e):
                return Alternatives("batch_norm_train_vjp", lambda fn: fn(x64, g64, w64, b64, e),
                                    pick, n)
            scale = grad_input_scale(r, h, x_hat, axes, centre=True)
            gx_bound = bound("gradient", ctx.dtype, n, kappa)
            ctx.oracle(f"expected_grads = spec.batch_norm_train_vjp({name}, {name}_grad, weight, "
                       f"bias, {self.e!r})")
        else:
            gx, gw, gb = spec.batch_norm_eval_vjp(x64, g64, mean, var, w64, b64, self.e)
            # the channel's largest |gamma g r|: the group's scale, as for every quantity
            scale = r * np.max(h, axis=axes, keepdims=True)
            gx_bound = bound("eval_gradient", ctx.dtype, 1) + self._reported(
                scale, 0.0, 0.5 * np.abs(gx) / (var.reshape(bshape) + self.e))
            ctx.oracle(f"expected_grads = spec.batch_norm_eval_vjp({name}, {name}_grad, rm, rv, "
                       f"weight, bias, {self.e!r})")
        phase = "train" if use_batch else "eval"
        ctx.oracle(f"show(result.grad_input, expected_grads[0], name='grad_input', "
                   f"axes={_layout(x64)[0]!r})")
        ctx.conforms(expected=gx, actual=res.grad_input, scale=scale, bound=gx_bound,
                     quantity=f"batch_norm.{phase}.grad_input", call=code,
                     variants=vjp(0) if vjp is not None else None)
        held = None
        if not use_batch:
            # dL/dgamma = sum g (x - rm) r: a unit change of the mean moves it by up to
            # sum |g| r, of the variance by sum |g x_hat| / (2 (var + eps))
            def held(w_scale):
                return self._reported(
                    w_scale, (r * np.abs(g64)).sum(axis=axes),
                    0.5 * np.abs(g64 * x_hat).sum(axis=axes) / (var + self.e))
        # the sum and the training statistics reduce over the same m values: the growth
        # per halving of m covers both (n = m), as it does the eval sum's alone
        compare_param_grads(ctx, code, f"batch_norm.{phase}", g64, x_hat, axes, gw, gb, res,
                            kappa, 1, variants=vjp, held=held)

    def _reported(self, scale, mean_sens, var_sens):
        """ULPs an eval quantity at `scale` may be off for the running statistics this
        layer reports (tolerances.reported_stats_ulps): `mean_sens` and `var_sens` are
        what a unit change of the mean or the variance moves it by (broadcast like the
        quantity; the statistics per channel, shaped to match)."""
        shape = np.shape(mean_sens) if np.ndim(mean_sens) else np.shape(var_sens)
        bshape = (1, -1) + (1,) * (len(shape) - 2) if len(shape) >= 2 else (-1,)
        return reported_stats_ulps(self.ctx.dtype, scale, mean=self.rm.reshape(bshape),
                                   mean_sens=mean_sens, var=self.rv.reshape(bshape),
                                   var_sens=var_sens)

    def _held(self):
        """The running statistics the eval oracle evaluates at, float64: those the layer
        reports, except where a report overflowed (inf in its dtype, float16's largest
        being 65504) for the finite value the spec's update gave and the layer holds,
        which then stands in (a float16 layer holding its variance of 70805 in float32
        reported inf, and its correct output failed at 556 ULPs against an oracle at an
        infinite variance: found by a review); the repro and the record say so. The
        spec's update of the next training step starts from them too, so the stand-in
        holds over several steps (a second step's update from an inf was inf: found by a
        review)."""
        held = []
        for nm, got, spec_value in (("rm", self.rm, self.spec_rm), ("rv", self.rv, self.spec_rv)):
            got64 = f64(got)
            over = np.zeros(got64.shape, bool)
            if spec_value is not None:
                with np.errstate(invalid="ignore"):
                    over = (np.isinf(got64) & np.isfinite(spec_value)
                            & (spec.round_to(spec_value, got.dtype).astype(np.float64) == got64))
            if over.any():
                value = np.where(over, spec_value, got64)
                self.ctx.oracle(f"{nm} = np.array({value.tolist()!r})  # the spec's where the "
                                f"layer's {got.dtype} report overflowed")
                note = (f"oracle at the spec's running {'mean' if nm == 'rm' else 'variance'} in "
                        f"channel(s) {np.flatnonzero(over).tolist()}, whose {got.dtype} report "
                        f"overflowed to inf")
                if note not in self.ctx.notes:
                    self.ctx.notes.append(note)
                got64 = value
            held.append(got64)
        return held[0], held[1]

    def _compare_count(self, code):
        """num_batches_tracked, where the layer exposes one: the training forwards so far."""
        count = getattr(self.layer, "num_batches_tracked", None)
        if count is None:
            return
        # exactly: int() would pass a count of steps + 0.9 (found by a review)
        self.ctx.holds(condition=_exact_count(count, self.steps),
                       got=f"layer.num_batches_tracked = {count}",
                       spec_says=f"{self.steps}, one per training forward with running "
                                 f"statistics (F4)", call=code)

    def _compare_stats(self, rm_ref, rv_ref, moments, code, variants=None):
        """The running statistics after a training step on a batch of these `moments`
        (tolerances.batch_moments) against the oracle's update; `variants(i)` recomputes
        field i (1: running_mean, 2: running_var) under a variant of the training forward,
        for diagnosis."""
        ctx = self.ctx
        old_rm, old_rv = self._held()  # (what the spec's update started from)
        self.rm, self.rv = self._stats("after a training forward")
        self.spec_rm, self.spec_rv = rm_ref, rv_ref
        if not self.compare_stats:
            return
        a = self.step_a
        rm_scale, rv_scale = running_stat_scales(old_rm, old_rv, moments, a)
        # the declared biased estimator's update, which the spec does not share (F4)
        biased = [((1 - a) * old_rv + a * moments.var.reshape(-1), "running_var_estimator")] \
            if ctx.convention("running_var_estimator") == "biased" else []
        for nm, ref, got, sc, explained, var, pick in (
                ("running_mean", rm_ref, self.rm, rm_scale, [], "new_rm", 1),
                ("running_var", rv_ref, self.rv, rv_scale, biased, "new_rv", 2)):
            ctx.oracle(f"show(layer.{nm}, {var}, name='{nm}')")
            bd = running_stat_bound(nm, got.dtype, ctx.dtype, moments, a, sc)
            try:
                ctx.conforms(expected=ref, actual=got, dtype=got.dtype, scale=sc, bound=bd,
                             quantity=f"batch_norm.{nm}", call=code, explained=explained,
                             variants=variants(pick) if variants else None)
            except CheckFailure as exc:
                if not self.defer_stats:
                    raise
                self.deferred.append(exc)

    def raise_deferred(self):
        """Raise the first running-statistics failure that defer_stats kept, if any."""
        if self.deferred:
            raise self.deferred[0]
