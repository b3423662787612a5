"""DP: a backend's data-parallel BatchNorm (`data_parallel_batch_norm`) run beside the
oracle's spec.local_/sync_batch_norm_train(_vjp).

Every quantity of every replica is compared at every step: the output, dL/dx, each
replica's dL/dgamma and dL/dbeta before the gradient all-reduce and what it holds after
it (the mean over replicas), and its running statistics. The bounds are the tolerance
table's, with the statistics' group being the replica's shard (local) or the global
batch (sync): the count n and the conditioning kappa are those of the values that were
reduced. The oracle starts each step from the running statistics the backend held after
the step before, taken as the backend's declared buffer rule says (DP3), so one step's
error is judged at a time.
"""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..assertions import CheckFailure, assert_conforms
from ..tolerances import (
    batch_moments,
    bound,
    centred_output_scale,
    grad_input_scale,
    param_grad_scales,
    running_stat_bound,
    running_stat_scales,
)
from ..twins import modified, twin
from ._common import f64
from .batch_norm import _layout

FIELDS = ("output", "grad_input", "replica_grad_weight", "replica_grad_bias", "grad_weight",
          "grad_bias", "running_mean", "running_var")


def _names(prefix, steps):
    return [[f"{prefix}{t}_{r}" for r in range(len(step))] for t, step in enumerate(steps)]


def _lists(names) -> str:
    return "[" + ", ".join("[" + ", ".join(row) + "]" for row in names) + "]"


class DataParallelRun:
    """One call of `data_parallel_batch_norm`: `steps[t][r]` and `grads[t][r]` are input
    recipes (shard r of step t and its output gradient)."""

    def __init__(self, ctx, *, sync, steps, grads, weight, bias, eps=1e-5, momentum=0.1):
        self.ctx, self.sync, self.eps, self.momentum = ctx, sync, eps, momentum
        self.x_names, self.g_names = _names("x", steps), _names("g", grads)
        self.xs = [[ctx.use(**{n: rec}) for n, rec in zip(row, step, strict=True)]
                   for row, step in zip(self.x_names, steps, strict=True)]
        self.gs = [[ctx.use(**{n: rec}) for n, rec in zip(row, step, strict=True)]
                   for row, step in zip(self.g_names, grads, strict=True)]
        self.w, self.b = ctx.use(weight=weight, bias=bias)
        self.w64, self.b64 = f64(self.w), f64(self.b)
        self.e = ctx.effective(eps, "eps")
        self.a = ctx.effective(momentum, "momentum")
        self.world = len(steps[0])
        self.code = (f"result = backend.data_parallel_batch_norm({_lists(self.x_names)}, "
                     f"sync={sync}, eps={eps!r}, momentum={momentum!r}, dtype={ctx.dtype_name!r}, "
                     f"weight=weight, bias=bias, grad_outputs={_lists(self.g_names)})")
        self.result = None

    # ------------------------------------------------------------ the call
    def call(self, *, refusable=False):
        """The backend's answer, its structure checked: every field [step][replica] of
        arrays of the protocol's shapes and the dtype under test; inputs untouched."""
        ctx = self.ctx
        # the backend gets twins of every array (see twins.twin): the oracle reads
        # the originals, and a write into any of them, gamma and beta too, is seen
        arrays = [*(a for row in self.xs + self.gs for a in row), self.w, self.b]
        twins = {id(a): twin(a) for a in arrays if isinstance(a, np.ndarray)}

        def handed(a):
            return twins[id(a)][0] if id(a) in twins else a

        def rows(shards):
            return [[handed(a) for a in row] for row in shards]
        res = ctx.call(self.code, lambda: ctx.backend.data_parallel_batch_norm(
            rows(self.xs), sync=self.sync, eps=self.eps, momentum=self.momentum,
            dtype=ctx.dtype, weight=handed(self.w), bias=handed(self.b),
            grad_outputs=rows(self.gs)), refusable=refusable)
        # held by the case like any call's, and checked again when it ends
        names = (*(n for row in self.x_names + self.g_names for n in row), "weight", "bias")
        ctx.held.append((self.code, None, names, arrays,
                         {i: twins[id(a)] for i, a in enumerate(arrays) if id(a) in twins}))
        for name, arrays in (("an input shard", [a for row in self.xs for a in row]),
                             ("a gradient shard", [a for row in self.gs for a in row]),
                             ("weight", [self.w]), ("bias", [self.b])):
            if any(modified(a, *twins[id(a)]) for a in arrays if id(a) in twins):
                raise CheckFailure(f"got {name} modified in place, but the spec says inputs "
                                   f"are never modified [{self.code}]", protocol=True)
        c = self.w.shape
        for f in FIELDS:
            value = getattr(res, f, None)
            for t, row in enumerate(self.xs):
                for r, x in enumerate(row):
                    shape = x.shape if f in ("output", "grad_input") else c
                    try:
                        got = value[t][r]
                    except (TypeError, IndexError, KeyError):
                        raise CheckFailure(f"got result.{f} without an entry [{t}][{r}], but the "
                                           f"protocol says one array per step and replica "
                                           f"[{self.code}]", protocol=True) from None
                    dtype_ok = isinstance(got, np.ndarray) and (
                        got.dtype == ctx.dtype or (f.startswith("running") and
                                                   got.dtype in spec.FLOAT_DTYPES))
                    if not dtype_ok or got.shape != shape:
                        what = (f"shape {got.shape} and dtype {got.dtype}"
                                if isinstance(got, np.ndarray) else type(got).__name__)
                        raise CheckFailure(f"got result.{f}[{t}][{r}] of {what}, but the protocol "
                                           f"says an array of shape {shape} and dtype "
                                           f"{ctx.dtype} [{self.code}]", protocol=True)
        self.result = res
        return res

    def raises(self) -> str | None:
        """The call where raising is the finding: the exception's text, or None if it
        returned (its answer then checked like any other)."""
        from ..context import Refused

        try:
            self.call(refusable=True)
        except Refused as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------ the oracle
    def _stats_before(self, t, rule):
        """Each replica's (running_mean, running_var) as step t starts: 0 and 1 at first,
        then the backend's own after step t - 1, or replica 0's under "broadcast_rank0"."""
        if t == 0:
            c = self.w.shape[0]
            return [np.zeros(c)] * self.world, [np.ones(c)] * self.world, \
                f"([np.zeros({c})] * {self.world})", f"([np.ones({c})] * {self.world})"
        res = self.result
        src = [0] * self.world if rule == "broadcast_rank0" else list(range(self.world))
        rms = [f64(res.running_mean[t - 1][s]) for s in src]
        rvs = [f64(res.running_var[t - 1][s]) for s in src]
        code_m = "[" + ", ".join(f"result.running_mean[{t - 1}][{s}]" for s in src) + "]"
        code_v = "[" + ", ".join(f"result.running_var[{t - 1}][{s}]" for s in src) + "]"
        return rms, rvs, code_m, code_v

    def expected(self, t, rule="per_replica"):
        """The oracle's step t: dict of field -> per-replica float64 arrays, and the
        groups (per replica: float64 values the statistics reduce over) for the bounds."""
        xs = [f64(x) for x in self.xs[t]]
        gs = [f64(g) for g in self.gs[t]]
        w, b, e, a = self.w64, self.b64, self.e, self.a
        rms, rvs, code_m, code_v = self._stats_before(t, rule)
        xl, gl = _lists([self.x_names[t]])[1:-1], _lists([self.g_names[t]])[1:-1]
        if self.sync:
            ys, rm, rv = spec.sync_batch_norm_train(xs, rms[0], rvs[0], w, b, a, e)
            new_rms, new_rvs = [rm] * self.world, [rv] * self.world
            vjp, train = spec.sync_batch_norm_train_vjp, "sync_batch_norm_train"
            self.ctx.oracle(f"ys, new_rm, new_rv = spec.{train}({xl}, {code_m}[0], {code_v}[0], "
                            f"weight, bias, {a!r}, {e!r})",
                            f"new_rms, new_rvs = [new_rm] * {self.world}, [new_rv] * {self.world}")
        else:
            ys, new_rms, new_rvs = spec.local_batch_norm_train(xs, rms, rvs, w, b, a, e)
            vjp, train = spec.local_batch_norm_train_vjp, "local_batch_norm_train"
            self.ctx.oracle(f"ys, new_rms, new_rvs = spec.{train}({xl}, {code_m}, {code_v}, "
                            f"weight, bias, {a!r}, {e!r})")
        gxs, gw, gb = vjp(xs, gs, w, b, e, reduction="mean")
        mine = [vjp(xs, [g if q == r else 0 * g for q, g in enumerate(gs)], w, b, e)
                for r in range(self.world)]
        self.ctx.oracle(
            f"gxs, gw, gb = spec.{vjp.__name__}({xl}, {gl}, weight, bias, {e!r}, reduction='mean')",
            f"mine = [spec.{vjp.__name__}({xl}, [g if q == r else 0 * g for q, g in "
            f"enumerate({gl})], weight, bias, {e!r}) for r in range({self.world})]")
        exp = {"output": ys, "grad_input": gxs, "replica_grad_weight": [m[1] for m in mine],
               "replica_grad_bias": [m[2] for m in mine], "grad_weight": [gw] * self.world,
               "grad_bias": [gb] * self.world, "running_mean": new_rms, "running_var": new_rvs,
               "old_rm": rms, "old_rv": rvs}
        groups = [np.concatenate(xs)] * self.world if self.sync else xs
        ggroups = [np.concatenate(gs)] * self.world if self.sync else gs
        return exp, groups, ggroups

    # ------------------------------------------------------------ comparisons
    def _normalizations(self, groups):
        """Per replica, what its group (the values its statistics reduce over) normalizes
        by: (axes, channel shape, BatchMoments, mean, 1/sqrt(var + eps)). Replicas that
        share one group (sync mode: the global batch) share one computation."""
        done: dict[int, tuple] = {}
        for grp in groups:
            if id(grp) not in done:
                axes, bshape = _layout(grp)
                moments = batch_moments(grp, axes, self.e)
                done[id(grp)] = (axes, bshape, moments, grp.mean(axis=axes, keepdims=True),
                                 1.0 / np.sqrt(moments.var + self.e))
        return [done[id(grp)] for grp in groups]

    def stats_follow(self, t, rule) -> bool:
        """Whether every replica's running statistics after step t meet the oracle under
        buffer `rule`, by the same bounds as `compare` (nothing is recorded)."""
        exp, groups, _ = self.expected(t, rule)
        for r, (_, _, moments, _, _) in enumerate(self._normalizations(groups)):
            scales = running_stat_scales(exp["old_rm"][r], exp["old_rv"][r], moments, self.a)
            for f, sc in zip(("running_mean", "running_var"), scales, strict=True):
                got = getattr(self.result, f)[t][r]
                bd = running_stat_bound(f, got.dtype, self.ctx.dtype, moments, self.a, sc)
                try:
                    assert_conforms(expected=exp[f][r], actual=got, dtype=got.dtype, scale=sc,
                                    bound=bd,
                                    quantity=f"batch_norm.dp.{f}", call=self.code)
                except CheckFailure:
                    return False
        return True

    def compare(self, t, fields=FIELDS, rule="per_replica"):
        """Every field of step t against the oracle, replica by replica."""
        ctx, res = self.ctx, self.result
        exp, groups, ggroups = self.expected(t, rule)
        biased = ctx.convention("running_var_estimator") == "biased"
        w, b, a = np.abs(self.w64), np.abs(self.b64), self.a
        norms = self._normalizations(groups)
        # each replica's shard normalized by its own group's statistics: the gradients
        # the all-reduce averages are each replica's own
        x_hats = [(f64(x) - mean) * inv
                  for x, (_, _, _, mean, inv) in zip(self.xs[t], norms, strict=True)]
        axes = norms[0][0]
        all_ws = sum(param_grad_scales(f64(g), x_hat, axes)[0]
                     for g, x_hat in zip(self.gs[t], x_hats, strict=True))
        all_bs = sum(np.abs(f64(g)).sum(axis=axes) for g in self.gs[t])
        c = self.w64.shape[0]
        # per channel, as tolerances' param_gradient counts BatchNorm's (see batch_norm.py):
        # the terms summed; and the kappa of the statistics, the worst replica's for the
        # all-reduced gradients, which sum every replica's terms
        terms = [g.size // c for g in self.gs[t]]
        all_terms = sum(terms)
        k_all = np.max([moments.kappa.reshape(-1) for _, _, moments, _, _ in norms], axis=0)
        for r, (axes, bshape, moments, mean, inv) in enumerate(norms):
            g, x_hat = f64(self.gs[t][r]), x_hats[r]
            grp, ggrp = groups[r], ggroups[r]
            n, var, kappa = moments.count, moments.var, moments.kappa
            grp_hat = (grp - mean) * inv
            wb, bb = w.reshape(bshape), b.reshape(bshape)
            scales = {
                "output": (centred_output_scale(grp_hat, wb, bb, axes), bound("output", ctx.dtype, n, kappa)),
                "grad_input": (grad_input_scale(inv, np.abs(ggrp) * wb, grp_hat, axes, centre=True),
                               bound("gradient", ctx.dtype, n, kappa)),
            }
            ws, bs = param_grad_scales(g, x_hat, axes)
            scales["replica_grad_weight"] = (ws, bound("param_gradient", ctx.dtype,
                                                       terms[r], kappa.reshape(-1)))
            scales["replica_grad_bias"] = (bs, bound("bias_gradient", ctx.dtype, terms[r]))
            scales["grad_weight"] = (all_ws / self.world,
                                     bound("param_gradient", ctx.dtype, all_terms, k_all))
            scales["grad_bias"] = (all_bs / self.world,
                                   bound("bias_gradient", ctx.dtype, all_terms))
            rm_scale, rv_scale = running_stat_scales(exp["old_rm"][r], exp["old_rv"][r], moments, a)
            for f in fields:
                got = getattr(res, f)[t][r]
                where = f"[{t}][{r}]"
                shown = {"output": f"ys[{r}]", "grad_input": f"gxs[{r}]", "grad_weight": "gw",
                         "grad_bias": "gb", "replica_grad_weight": f"mine[{r}][1]",
                         "replica_grad_bias": f"mine[{r}][2]", "running_mean": f"new_rms[{r}]",
                         "running_var": f"new_rvs[{r}]"}[f]
                ctx.oracle(f"show(result.{f}{where}, {shown}, name='{f}{where}')")
                quantity = f"batch_norm.dp.{f}"
                what = f"result.{f}{where}"
                if f.startswith("running"):
                    explained = []
                    if f == "running_var" and biased:
                        old = exp["old_rv"][r]
                        explained = [((1 - a) * old + a * var.reshape(-1), "running_var_estimator")]
                    sc = rm_scale if f == "running_mean" else rv_scale
                    ctx.conforms(expected=exp[f][r], actual=got, dtype=got.dtype, scale=sc,
                                 bound=running_stat_bound(f, got.dtype, ctx.dtype, moments, a, sc),
                                 quantity=quantity, what=what, call=self.code,
                                 explained=explained)
                else:
                    sc, bd = scales[f]
                    ctx.conforms(expected=exp[f][r], actual=got, scale=sc, bound=bd,
                                 quantity=quantity, what=what, call=self.code)
        return exp
