"""Every conformance check can fail: each is run on a deliberately broken backend that
it must catch, and on the oracle backend and the correct numpy backend, which must pass.
The table below is the proof, check by check."""

from __future__ import annotations

import broken_backends as bb
import numpy as np
import pytest
from normspec.conformance import runner
from normspec.conformance.checks import all_checks
from normspec.conformance.ops.data_parallel import FIELDS as DP_FIELDS
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.protocol import DTYPES
from normspec.impls.registry import LoadedBackend
from oracle_backend import OracleBackend

# check id -> (broken backend, dtype on which the defect shows)
CATCHES = {
    "F8.post_ln": (bb.SwapsLnWiring, "float32"),
    "F8.pre_ln": (bb.SwapsLnWiring, "float32"),
    "F8.pre_ln_stack": (bb.SwapsLnWiring, "float32"),
    "F8.fused_add_rms_norm": (bb.UnaddedResidual, "float32"),
    "F8.fused_add_layer_norm": (bb.MixesFusedContracts, "float16"),
    "F2.values": (bb.DropsTail, "float32"),
    "F3.values": (bb.RmsSubtractsMean, "float32"),
    "F1.values": (bb.UnbiasedForward, "float32"),
    "F5.values": (bb.EvalUsesBatchStats, "float32"),
    "F6.values": (bb.QkWrongScale, "float32"),
    "F2.grad": (bb.WrongGradient, "float32"),
    "F3.grad": (bb.WrongRmsGradient, "float32"),
    "F1.grad": (bb.StatsConstantGrad, "float32"),
    "B1.layer_norm_shift": (bb.NaiveVariance, "float32"),
    "B1.rms_norm_shift": (bb.RmsSubtractsMean, "float32"),
    "B2.layer_norm_scale": (bb.EpsOutsideSqrt, "float32"),
    "B2.rms_norm_scale": (bb.EpsOutsideSqrt, "float32"),
    "E3.train_then_eval": (bb.BiasedRunningVar, "float32"),
    "F4.running_stats": (bb.FlippedMomentum, "float32"),
    "F4.cumulative_momentum": (bb.CumulativeIgnored, "float32"),
    "F5.untracked": (bb.UntrackedEvalUsesInit, "float32"),
    "F5.eval_before_training": (bb.UntrainedEvalUsesBatch, "float32"),
    "F1.matrix": (bb.StatsConstantGrad, "float32"),
    "F5.matrix": (bb.EvalTrainingGradient, "float32"),
    "B3.batch_of_one_train": (bb.NoSingleValueError, "float32"),
    "B3.batch_of_one_eval": (bb.EvalUsesBatchStats, "float32"),
    "B3.single_sample_sequence": (bb.ChannelLastStats, "float32"),
    "B4.train_eval_divergence": (bb.EvalUsesBatchStats, "float32"),
    "B7.accumulation": (bb.GradsAccumulate, "float32"),
    "B5.update_every_forward": (bb.LazyUpdate, "float32"),
    "B5.train_after_eval": (bb.FrozenAfterEval, "float32"),
    "B6.no_grad_still_updates": (bb.NoGradSkipsUpdate, "float32"),
    "E7.bound": (bb.QkNoNorm, "float32"),
    "E6.scale_invariance": (bb.QkNoNorm, "float32"),
    "E7.gains": (bb.QkIgnoresGains, "float32"),
    "E8.rope": (bb.QkNoNorm, "float32"),
    "F7.softcap": (bb.SoftcapClips, "float32"),
    "F2/F3.half_overflow": (bb.HalfAccumulation, "float16"),
    "F2.large_mean_tiny_spread": (bb.NaiveVariance, "float32"),
    "F2/F3.degenerate_rows": (bb.NoEps, "float32"),
    "F1/F2.constant_near_max": (bb.MeanOverflows, "bfloat16"),
    "F2/F3.non_contiguous": (bb.AssumesContiguous, "float32"),
    "F2/F3.nan_inf": (bb.NanToZero, "float32"),
    "F2/F3.subnormals": (bb.FlushesSubnormals, "float16"),
    "protocol.shape_dtype_inputs": (bb.WritesInput, "float32"),
    "F4.declared_estimator": (bb.BiasedRunningVar, "float32"),
    "F4.momentum_meaning": (bb.FlippedMomentum, "float32"),
    "protocol.eps_zero": (bb.DeclaresRefusalButAccepts, "float32"),
    "protocol.parameter_dtype": (bb.DeclaresFloat32Parameters, "float64"),
    "E1.worked_example": (bb.RmsSubtractsMean, "float32"),
    "E2.worked_example": (bb.RmsSubtractsMean, "float32"),
    "B9.layer_norm": (bb.SwitchesStrategyWithBatch, "float32"),
    "B9.rms_norm": (bb.CarriesCompensation, "float32"),
    "B9.qk_norm_scores": (bb.CarriesCompensation, "float32"),
    "B9.batch_norm_eval": (bb.SwitchesStrategyWithBatch, "float32"),
    "B9.fused_add_norm": (bb.FusedSwitchesStrategy, "float32"),
    "B9.batch_norm_train": (bb.TrainUsesRunningStats, "float32"),
    "B9.deterministic": (bb.RandomOrderSums, "float32"),
    "F2.rounding_bias": (bb.TruncatesHalf, "float16"),
    "F3.rounding_bias": (bb.TruncatesHalf, "bfloat16"),
    "F1.rounding_bias": (bb.TruncatesHalf, "bfloat16"),
    "F6.rounding_bias": (bb.TruncatesHalf, "float16"),
    "F8.rounding_bias": (bb.TruncatesHalf, "float16"),
    "F2/F3.row_counts": (bb.GridStopsAt65535, "float32"),
    "F2/F3.hidden_sizes": (bb.PaddedLanes, "float32"),
    "F2/F3.ranks": (bb.Assumes2D, "float32"),
    "F2/F3.layouts": (bb.IgnoresStrides, "float32"),
    "F6.row_counts": (bb.GridStopsAt65535, "float32"),
    "F1/F5.row_counts": (bb.GridStopsAt65535, "float32"),
    "F1/F5.batchnorm_layouts": (bb.BatchNormIgnoresStrides, "float32"),
    "DP1.local_per_shard": (bb.DpLocalUsesGlobalStats, "float32"),
    "DP1.e4_split": (bb.DpLocalUsesGlobalStats, "float32"),
    "DP2.sync_global": (bb.DpSyncAveragesVariances, "float32"),
    "DP2.global_count": (bb.DpSyncB3PerReplica, "float32"),
    "DP3.buffers": (bb.DpBuffersNotBroadcast, "float32"),
}

# the issue's list of defects, each with a check that catches it; and a backend that
# ignores a parameter, for each parameter docs/coverage.md shows a check varying
DEFECTS = {
    "a BatchNorm that ignores affine=False": (bb.IgnoresAffine, "F1.grad", "float32"),
    "eps held in float32 in float64, undeclared": (bb.Float32EpsUndeclared,
                                                   "protocol.parameter_dtype", "float64"),
    "variance as E[x^2] - E[x]^2": (bb.NaiveVariance, "B1.layer_norm_shift", "float32"),
    "eps outside the sqrt": (bb.EpsOutsideSqrt, "B2.layer_norm_scale", "float32"),
    "a biased running variance": (bb.BiasedRunningVar, "F4.running_stats", "float32"),
    "the momentum meaning flipped": (bb.FlippedMomentum, "F4.momentum_meaning", "float32"),
    "eval using batch statistics": (bb.EvalUsesBatchStats, "F5.values", "float32"),
    "an RMSNorm that subtracts the mean": (bb.RmsSubtractsMean, "F3.values", "float32"),
    "float16 accumulation of squares": (bb.HalfAccumulation, "F2/F3.half_overflow", "float16"),
    "a wrong gradient": (bb.WrongGradient, "F2.grad", "float32"),
    "a kernel that drops the tail of rows": (bb.DropsTail, "F2.values", "float32"),
    "an adapter that writes into its input": (bb.WritesInput, "protocol.shape_dtype_inputs",
                                              "float32"),
    "a write into the input after the call returned": (bb.RewritesInputLate, "F2.values",
                                                       "float32"),
    "a no-grad forward that skips the update, its `training` reading False":
        (bb.HidesItsMode, "B6.no_grad_still_updates", "float32"),
    "atomic dL/dgamma sums behind a cache keyed by id()": (bb.CachesById, "B9.deterministic",
                                                           "float32"),
    "num_batches_tracked a fraction off": (bb.CountsFractions, "F4.running_stats", "float32"),
    "data-parallel BatchNorm writing into gamma and beta": (bb.DataParallelWritesParams,
                                                            "DP1.local_per_shard", "float32"),
    "a QK-norm that ignores scale (always 1/sqrt(d_k))": (bb.QkIgnoresScale, "F6.values",
                                                          "float32"),
    "a softcap that ignores cap (always 30)": (bb.SoftcapIgnoresCap, "F7.softcap", "float32"),
    "a LayerNorm that ignores normalized_shape (last axis only)": (bb.LastAxisOnly, "F2.values",
                                                                   "float32"),
    "a reduction order that depends on the batch size": (bb.SwitchesStrategyWithBatch,
                                                         "B9.rms_norm", "float32"),
    "a row whose output depends on its neighbours": (bb.CarriesCompensation, "B9.layer_norm",
                                                     "float32"),
    "eval-mode BatchNorm folded for large batches only": (bb.SwitchesStrategyWithBatch,
                                                          "B9.batch_norm_eval", "float32"),
    "a truncating float16 encoder (RMSNorm)": (bb.TruncatesHalf, "F3.rounding_bias", "float16"),
    "a truncating bfloat16 encoder (LayerNorm)": (bb.TruncatesHalf, "F2.rounding_bias",
                                                  "bfloat16"),
    "a mean that overflows, its inf scrubbed to 0 (finite garbage near the float32 max)": (
        bb.MeanOverflowsScrubbed, "F1/F2.constant_near_max", "float32"),
    "a backward that recomputes the variance as E[x^2] - E[x]^2 (dL/dx NaN near the max)": (
        bb.BackwardOnePassVariance, "F1/F2.constant_near_max", "bfloat16"),
    # issue #15, where real kernels break
    "a fast path from 256 rows on that drops dgamma's partial block": (
        bb.FastPathFrom256, "F2/F3.row_counts", "float32"),
    "a kernel that ignores a view's offset": (bb.IgnoresOffset, "F2/F3.layouts", "float32"),
    "a backward that assumes a contiguous upstream gradient": (
        bb.GradAssumedContiguous, "F2/F3.layouts", "float32"),
    "BatchNorm statistics of the first 65535 samples only": (
        bb.GridStopsAt65535, "F1/F5.row_counts", "float32"),
    "a data-parallel gradient all-reduce that sums instead of averaging": (
        bb.DpSumsGradients, "DP1.local_per_shard", "float32"),
    "a sync BatchNorm that ignores unequal shard sizes": (bb.DpSyncIgnoresUnequalShards,
                                                          "DP2.sync_global", "float32"),
    "a sync BatchNorm that averages per-replica variances": (bb.DpSyncAveragesVariances,
                                                             "DP2.sync_global", "float64"),
    "a local BatchNorm that reduces statistics across replicas (E4 split)": (
        bb.DpLocalUsesGlobalStats, "DP1.e4_split", "float64"),
    # issue #15 part 2, fused residual add + norm (F8)
    "fused add + LayerNorm: statistics of the rounded sum, float32 declared (bfloat16)": (
        bb.MixesFusedContracts, "F8.fused_add_layer_norm", "bfloat16"),
    "fused add + norm: the rounded contract followed, float32 declared": (
        bb.DeclaresFloat32ButRounds, "F8.fused_add_layer_norm", "float16"),
    "fused add + LayerNorm that writes back the un-added residual": (
        bb.UnaddedResidual, "F8.fused_add_layer_norm", "float32"),
    "fused add + RMSNorm whose backward drops the residual's gradient": (
        bb.DropsResidualGradient, "F8.fused_add_rms_norm", "float32"),
    "fused add + LayerNorm whose backward drops the residual's gradient": (
        bb.DropsResidualGradient, "F8.fused_add_layer_norm", "bfloat16"),
    # blind spots a review found: each slipped through every check before
    "dL/dgamma, dL/dbeta reduced in a different order at every call (atomic adds)": (
        bb.AtomicParamGradSums, "B9.deterministic", "float32"),
    "BatchNorm statistics in blocks of 32 channels, the partial last block skipped": (
        bb.ChannelBlocks, "F1.values", "float32"),
    "rows walked at one stride (heads split from a fused qkv read wrong)": (
        bb.OneRowStride, "F2/F3.layouts", "float32"),
    "QK-norm rows walked at one stride": (bb.OneRowStride, "F6.row_counts", "float32"),
    "a BatchNorm layer that resets the caller's gamma and beta arrays": (
        bb.ZeroesParams, "F1.values", "float32"),
    "BatchNorm gradients of gamma and beta as Python lists": (bb.ListGrads, "F1.grad",
                                                               "bfloat16"),
    # a second review's blind spots: each slipped through every check before
    "rows of 4096 < d <= 65536 walked in blocks, their variances averaged": (
        bb.MidSizeLoopedPath, "F2/F3.hidden_sizes", "float32"),
    "dL/dgamma tiles of 32 columns from 128 rows on, the last partial tile unwritten": (
        bb.TiledParamGradDropsTail, "F2/F3.hidden_sizes", "float32"),
    "a one-pass variance for problems of 256 x 128 and more": (
        bb.LargeProblemOnePassVariance, "F2/F3.hidden_sizes", "float32"),
    "BatchNorm statistics of 4096+ samples in vectors of 4 channels, the partial one skipped": (
        bb.LargeBatchTailChannels, "F1/F5.row_counts", "float32"),
    "BatchNorm momentum 0.0 taken for None (a cumulative average)": (
        bb.MomentumZeroIsNone, "F4.running_stats", "float32"),
    "fused add + RMSNorm over a row padded to a power of two": (
        bb.FusedPaddedLanes, "F8.fused_add_rms_norm", "float32"),
    "fused add + LayerNorm over a row padded to a power of two": (
        bb.FusedPaddedLanes, "F8.fused_add_layer_norm", "float32"),
    "fused add + LayerNorm mixing the contracts from 256 tokens on": (
        bb.FusedLargeBatchMixes, "F8.fused_add_layer_norm", "bfloat16"),
    "fused add + norm reading views in memory order": (
        bb.FusedIgnoresStrides, "F8.fused_add_rms_norm", "float32"),
    "fused add + norm taking x.shape[0] for the token count": (
        bb.FusedAssumes2D, "F8.fused_add_layer_norm", "float32"),
    "fused add + norm writing the residual back truncated": (
        bb.FusedTruncatesResidual, "F8.rounding_bias", "bfloat16"),
    "fused add + norm dL/dgamma reduced with atomic adds": (
        bb.FusedAtomicParamGradSums, "B9.deterministic", "float32"),
    # a red team's blind spots (the suite never built their trigger): each slipped through
    # every check before
    "LayerNorm taking a split-row reduction from 2048 rows on": (
        bb.SwitchesStrategyFrom2048, "B9.layer_norm", "float32"),
    "RMSNorm taking a split-row reduction from 2048 rows on": (
        bb.SwitchesStrategyFrom2048, "B9.rms_norm", "float32"),
    "dL/dgamma, dL/dbeta reduced with atomic adds from 1024 rows on": (
        bb.AtomicParamGradSumsFrom1024, "B9.deterministic", "float64"),
    "fused add + RMSNorm switching its reduction at 256 tokens (vLLM #48271)": (
        bb.FusedRmsSwitchesStrategy, "B9.fused_add_norm", "float32"),
    "fused add + RMSNorm dL/dgamma reduced with atomic adds": (
        bb.FusedRmsAtomicParamGradSums, "B9.deterministic", "float32"),
    "LayerNorm gradients stored in float16 by truncation": (
        bb.TruncatesHalfGradients, "F2.rounding_bias", "float16"),
    "RMSNorm gradients stored in bfloat16 by truncation": (
        bb.TruncatesHalfGradients, "F3.rounding_bias", "bfloat16"),
}

CHECKS = {c.id: c for c in all_checks()}


def run(backend_obj, check_id, dtype, examples=5, timeout=60.0):
    loaded = LoadedBackend(backend_obj.name, "tests", backend=backend_obj)
    return runner.run_check(loaded, CHECKS[check_id], dtype, seed=0, examples=examples,
                            timeout=timeout)


def test_every_check_has_a_broken_backend_that_it_catches():
    assert sorted(CHECKS) == sorted(CATCHES)


@pytest.mark.parametrize("check_id", sorted(CATCHES))
def test_check_catches_its_broken_backend(check_id):
    broken, dtype = CATCHES[check_id]
    records = run(broken(), check_id, dtype)
    statuses = {r.status for r in records}
    assert statuses & {"fail", "error"}, f"{broken.__name__} slipped through {check_id}: " + \
        "; ".join(f"{r.case}: {r.status}" for r in records)


@pytest.mark.parametrize("check_id", sorted(CATCHES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_check_passes_on_the_oracle(check_id, dtype):
    records = run(OracleBackend(), check_id, dtype)
    assert records or CHECKS[check_id].dtypes is not None  # only a dtype-restricted check is empty
    bad = [f"{r.case}: {r.status}: {r.message}" for r in records if r.status != "pass"]
    assert [] == bad


@pytest.mark.parametrize("check_id", sorted(CATCHES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_check_passes_on_the_numpy_backend(check_id, dtype):
    records = run(NumpyBackend(), check_id, dtype)
    # numpy has no no-grad switch (no_grad_mode = False): B6 and the matrices' no-grad
    # cases say so as unsupported; it has no encoder layer (F8's wirings), and nothing
    # else may be unsupported
    allowed = ("no_grad_mode = False", "capabilities do not list encoder_layer")
    bad = [f"{r.case}: {r.status}: {r.message}" for r in records if r.status != "pass"
           and not (r.status == "unsupported" and any(a in r.message for a in allowed))]
    assert [] == bad


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_issue_defects_are_caught(defect):
    broken, check_id, dtype = DEFECTS[defect]
    statuses = {r.status for r in run(broken(), check_id, dtype)}
    assert "fail" in statuses


@pytest.mark.parametrize("check_id", ["B6.no_grad_still_updates", "F1.matrix", "F5.matrix"])
def test_a_correct_layer_without_a_training_attribute_passes(check_id):
    """The mode is the one the harness set, never read back from the layer (a layer need
    not have `training`: found by a review, 13 false failures)."""
    records = run(bb.NoModeAttribute(), check_id, "float32")
    assert records and {r.status for r in records} == {"pass"}, [
        (r.case, r.message) for r in records if r.status != "pass"]


def test_num_batches_tracked_is_compared_where_exposed():
    failed = [r for r in run(bb.CountsEvalForwards(), "F5.matrix", "float32") if r.status == "fail"]
    assert failed and all("num_batches_tracked" in r.message for r in failed)


@pytest.mark.parametrize("broken,expected", [
    (bb.Raises, "error"), (bb.ReturnsNaN, "fail"), (bb.WrongShape, "fail"),
    (bb.WrongDtype, "fail"), (bb.WritesInput, "fail"),
])
def test_misbehaving_adapter_fails_that_check_alone(broken, expected):
    records = run(broken(), "F2.values", "float32")
    assert expected in {r.status for r in records}
    others = run(broken(), "F3.values", "float32")
    assert {"pass"} == {r.status for r in others}


def test_a_hanging_adapter_times_out_and_the_run_goes_on():
    records = run(bb.Hangs(), "F2.values", "float32", timeout=2.0)
    assert records[-1].status == "error" and "timed out after 2 s" in records[-1].message
    assert {"pass"} == {r.status for r in run(bb.Hangs(), "F3.values", "float32")}


@pytest.mark.parametrize(("broken", "failing"), [
    (bb.AffineOnlyWithBoth, {"gamma only", "beta only"}),
    (bb.BetaOnlyUnderGamma, {"beta only"})])
@pytest.mark.parametrize("check_id", ["F2.values", "F2.grad"])
def test_layer_norm_with_one_parameter_is_checked(broken, failing, check_id):
    """LayerNorm given gamma alone (LayerNorm(bias=False)) or beta alone: the drawn cases
    pass both or neither, so the fixed cases are all that catch a kernel that needs both,
    or adds beta under gamma; they fail there and nowhere else."""
    records = run(broken(), check_id, "float32")
    assert {r.case.split(",")[0] for r in records if r.status != "pass"} == failing


@pytest.mark.parametrize("check_id", ["F1.values", "F1.grad"])
def test_many_channels_are_checked(check_id):
    """BatchNorm whose statistics skip a partial last block of 32 channels: the drawn
    cases have at most 16 channels, so the 100-channel case is what fails, alone."""
    records = run(bb.ChannelBlocks(), check_id, "float32")
    assert [r.case.split(":")[0] for r in records if r.status != "pass"] == ["100 channels"]


@pytest.mark.parametrize(("broken", "failing"), [
    (bb.GradInInputStrides, ["x (4, 3, 5, 6) channels_last, grad contiguous",
                             "x (4, 3, 5, 6) contiguous, grad channels_last"]),
    (bb.ChannelsLastTailStats, ["x (2, 6, 3, 4) channels_last"])],
    ids=["grad read with x's strides", "channels-last tail statistics"])
def test_batchnorm_memory_formats_are_checked(broken, failing):
    """A backward that reads the upstream gradient with x's strides, and channels-last
    running statistics that skip a partial vector of 4 channels: every layout case had
    the gradient in x's layout and 3 channels, so the cases of x and the gradient in
    different memory formats, and of 6 channels channels-last, are what fail, alone
    (found by a red-team review)."""
    records = run(broken(), "F1/F5.batchnorm_layouts", "float32")
    assert [r.case.split(":")[0] for r in records if r.status != "pass"] == failing


def test_a_layer_that_writes_into_gamma_is_named_for_it():
    failed = [r for r in run(bb.ZeroesParams(), "F1.values", "float32") if r.status == "fail"]
    assert failed and all(r.message.startswith("got weight modified in place")
                          for r in failed), failed[0].message


@pytest.mark.parametrize(("check_id", "dtype"), [("F2.rounding_bias", "float16"),
                                                 ("F3.rounding_bias", "bfloat16")])
def test_truncated_gradients_fail_the_gradients_case_alone(check_id, dtype):
    """A forward rounded to nearest, a backward that truncates (a red team's passed every
    check): the dL/dx case fails, naming dL/dx, and the outputs' case passes."""
    records = run(bb.TruncatesHalfGradients(), check_id, dtype)
    assert [(r.case.split(":")[0], r.status) for r in records] == [
        (records[0].case, "pass"), ("dL/dx", "fail")]
    assert records[1].message.startswith("got dL/dx: mean signed error -0."), records[1].message


def test_bias_of_an_untracked_layer_is_asked_only_of_a_backend_that_has_one():
    """F1.rounding_bias's untracked case is unsupported, with why, where the backend's
    capabilities say untracked_stats = False; its tracked cases still run."""
    import dataclasses

    class TrackedOnly(NumpyBackend):
        capabilities = dataclasses.replace(NumpyBackend.capabilities, untracked_stats=False)

    records = run(TrackedOnly(), "F1.rounding_bias", "bfloat16")
    by_status = {r.status: r for r in records}
    assert sorted(r.status for r in records) == ["pass", "pass", "unsupported"]
    assert "untracked_stats = False" in by_status["unsupported"].message


def test_the_allowance_for_reported_statistics_is_each_channels_own():
    """bfloat16 eval whose channel 0 uses the batch's statistics (21 ULPs off): with a
    second channel of running mean 50, the allowance of the worst channel (kappa 51 ULPs)
    was added to every channel's bound, and the bug passed (found by a review)."""
    import legit_backends

    class ChannelZeroFromBatch(bb.OracleBackend):
        def batch_norm(self, *args, **kwargs):
            layer = super().batch_norm(*args, **kwargs)
            forward = layer.forward

            def eval_channel_zero_from_batch(x, grad_output=None):
                res = forward(x, grad_output)
                if layer.training:
                    return res
                x0 = np.asarray(x, np.float64)[:, 0]
                y = np.array(res.output)
                y[:, 0] = ((x0 - x0.mean()) / np.sqrt(x0.var() + layer.eps) * layer.w[0]
                           + layer.b[0]).astype(y.dtype)
                return res._replace(output=y)
            layer.forward = eval_channel_zero_from_batch
            return layer

    rec = legit_backends.eval_after_train(ChannelZeroFromBatch(), "bfloat16", seed=3,
                                          spread=1.15, grad=False)
    assert rec.status == "fail", rec.message


def test_dbeta_is_judged_without_the_batchs_conditioning():
    """dL/dbeta = sum g holds no statistic of x, so its bound has kappa 1 in training too:
    it took the batch's centring kappa, and a channel of mean 1000 (kappa ~1000) let a
    dL/dbeta that drops the batch's last sample (a tail tile left out of the reduction,
    0.1% of sum |g|) pass at 48,000 ULPs allowed."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops.batch_norm import BatchNormDriver

    class DbetaDropsTail(NumpyBackend):
        def batch_norm(self, *args, **kwargs):
            layer = super().batch_norm(*args, **kwargs)
            forward = layer.forward

            def dbeta_without_the_tail(x, grad_output=None):
                res = forward(x, grad_output)
                if grad_output is None or not layer.training:
                    return res
                whole = x.shape[0] - x.shape[0] % 32
                dbeta = np.asarray(grad_output[:whole], np.float64).sum(axis=0)
                return res._replace(grad_bias=dbeta.astype(res.grad_bias.dtype))
            layer.forward = dbeta_without_the_tail
            return layer

    backend = DbetaDropsTail()
    ctx = Context(backend_name="t", source="tests", backend=backend, check_id="t", claim="F1",
                  op="batch_norm", dtype=np.dtype(np.float32), seed=0, examples=1,
                  conventions=backend.conventions)
    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(1025, 2)), rng.normal(size=(1025, 2))
    x[:, 1] += 1000.0
    with ctx.case("train, channel means 0 and 1000"):
        BatchNormDriver(ctx, 2, momentum=0.1).step("x", Literal.of(x), mode="train",
                                                    grad=Literal.of(g))
    rec = ctx.records[-1]
    assert rec.status == "fail" and "grad_bias" in rec.message, rec.message


def test_an_output_neither_precision_of_eps_explains_names_neither():
    """RMSNorm adding eps to the sum, not the mean (eps / d in effect), is as far from
    eps held in float32 as in float64: the record named float32 as the match (found by a
    review)."""
    class EpsOnTheSum(NumpyBackend):
        def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
            return super().rms_norm(x, normalized_shape, weight, eps / int(np.prod(normalized_shape)),
                                    grad_output)

    (rec,) = [r for r in run(EpsOnTheSum(), "protocol.parameter_dtype", "float64")
              if r.case.startswith("rms_norm")]
    assert rec.status == "fail" and "matches eps held in neither precision" in rec.message, \
        rec.message


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_outputs_rounded_twice_fail_the_rounding_check(dtype):
    """LlamaRMSNorm's x_hat rounded to the dtype before the gain: within 1 ULP and
    unbiased, so only QK-norm's scores caught it, on one seed (found by a red team)."""
    (rec,) = run(bb.RoundsBeforeTheGain(), "F3.rounding_bias", dtype)[:1]
    assert rec.status == "fail" and "off the oracle's rounding" in rec.message, rec.message


#: A third review's blind spots: realistic kernels that got through every check because
#: no case built their trigger. (broken backend, check, dtype, the cases that must fail:
#: the new ones, and no other); bfloat16, the coarsest dtype, where the defect's size
#: decides whether it shows.
TRAIN, INFER = "d = 512, 67 rows", "d = 1039, 67 rows, forward alone (inference)"
NEW_CASES_CATCH = [
    (bb.MultiRowGridRoundsDown, "F2/F3.hidden_sizes", "float32",
     {f"{op}: {case}" for op in ("layer_norm", "rms_norm") for case in (TRAIN, INFER)}),
    (bb.TwoStageParamGradDropsTailRows, "F2/F3.hidden_sizes", "bfloat16",
     {f"layer_norm: {TRAIN}", f"rms_norm: {TRAIN}"}),
    (bb.VectorTailOutsideStats, "F2/F3.hidden_sizes", "bfloat16", {f"layer_norm: {INFER}"}),
    (bb.FusedSecondPassRereadsX, "F8.fused_add_rms_norm", "bfloat16",
     {"3 rows of d = 1039, wider than one block: both outputs and all gradients"}),
    (bb.FusedSecondPassRereadsX, "F8.fused_add_layer_norm", "bfloat16",
     {"3 rows of d = 1039, wider than one block: both outputs and all gradients"}),
    (bb.QkHalvesOwnRms, "F6.values", "bfloat16",
     {"head_dim 256, its first 128 lanes 4 times the last 128's magnitude, gains"}),
    (bb.QkKeyGridStopsAt65535, "F6.row_counts", "float32", {"1 query row x d = 4, 65537 keys"}),
]


@pytest.mark.parametrize(("broken", "check_id", "dtype", "failing"), NEW_CASES_CATCH,
                         ids=[f"{b.__name__}-{c}" for b, c, _, _ in NEW_CASES_CATCH])
def test_the_cases_a_review_found_missing_catch_their_kernels(broken, check_id, dtype, failing):
    """67-row prefills (4 rows a program on a grid rounded down; dL/dgamma in two stages
    of 32-row blocks; LayerNorm's inference forward leaving the d % 16 tail out of its
    statistics), a fused row wider than one block of 1024 (pass 2 normalizing x, not the
    sum it wrote), QK-norm at head_dim 256 (each 128-lane half by its own RMS) and 65537
    key rows (keys past a 65535-program grid never normalized): each fails there, and
    only there."""
    records = run(broken(), check_id, dtype)
    assert {r.case for r in records if r.status != "pass"} == failing


def test_a_running_variance_is_judged_at_the_batchs_share_of_its_scale():
    """The batch's centring kappa multiplied the whole blended scale, where the old value
    (1) dominated: a running variance with the batch variance doubled passed at 158 ULPs
    on a channel of mean 1000 and spread 0.01, momentum 0.1 (found by a review)."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops.batch_norm import BatchNormDriver

    class DoublesTheBatchVariance(bb.NumpyBatchNorm):
        def update_running(self, mu, sum_sq, m):
            super().update_running(mu, 2 * sum_sq, m)

    backend = bb._bn_backend(DoublesTheBatchVariance)()
    ctx = Context(backend_name="t", source="tests", backend=backend, check_id="t", claim="F4",
                  op="batch_norm", dtype=np.dtype(np.float32), seed=0, examples=1,
                  conventions=backend.conventions)
    x = np.random.default_rng(0).normal(1000.0, 0.01, size=(64, 2))
    with np.errstate(all="ignore"), ctx.case("mean 1000, spread 0.01, momentum 0.1"):
        BatchNormDriver(ctx, 2, momentum=0.1).step("x", Literal.of(x), mode="train")
    rec = ctx.records[-1]
    assert rec.status == "fail" and "running_var" in rec.message, rec.message


@pytest.mark.parametrize("check_id", ["F2.grad", "F3.grad"])
def test_a_backward_from_the_output_fails_on_zero_gains(check_id):
    """x_hat rebuilt from y as (y - beta) / gamma is NaN where gamma is 0: the drawn
    gains never held a zero, and the suite caught it only through the error small gains
    amplify (found by a red team)."""
    failed = [r for r in run(bb.BackwardFromTheOutput(), check_id, "float32")
              if r.status == "fail"]
    assert [r.case.split(":")[0] for r in failed if r.case.startswith("gamma with zeros")] \
        and any("nan" in r.message for r in failed), [r.message[:120] for r in failed]


def _local_dp_record(backend, xs, gs, case, fields=DP_FIELDS):
    """The record of one local data-parallel step of `backend` on float64 shards `xs`
    with upstream gradients `gs` (one per replica), unit gains, compared in float32."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops import DataParallelRun

    ctx = Context(backend_name="t", source="tests", backend=backend, check_id="t",
                  claim="DP1", op="batch_norm", dtype=np.dtype(np.float32), seed=0,
                  examples=1, conventions=backend.conventions)
    c = xs[0].shape[1]
    with ctx.case(case):
        run = DataParallelRun(ctx, sync=False, steps=[[Literal.of(x) for x in xs]],
                              grads=[[Literal.of(g) for g in gs]],
                              weight=Literal.of(np.ones(c)), bias=Literal.of(np.zeros(c)))
        run.call()
        run.compare(0, fields=fields)
    return ctx.records[-1]


def test_one_replicas_copy_of_the_averaged_gradient_off_is_caught():
    """Local BatchNorm on two replicas, shards of spread 1 and 100, where replica 0's
    copy of the averaged dL/dgamma is off by a relative 1e-4 (a rank the all-reduce left
    partly stale). Each replica's copy is judged at the scale of the terms averaged, every
    replica's normalized by its own statistics. The scale normalized replica 1's shard by
    replica 0's statistics, 100 times too large: 16 ULPs against a bound of 64, a pass;
    at the right scale 526 ULPs (found by a review)."""
    class OneCopyOff(NumpyBackend):
        def data_parallel_batch_norm(self, steps, **kwargs):
            res = super().data_parallel_batch_norm(steps, **kwargs)
            gw = res.grad_weight[0][0]
            gw[...] = (gw.astype(np.float64) * (1 + 1e-4)).astype(gw.dtype)
            return res

    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(16, 3)), 100.0 * rng.normal(size=(16, 3))]
    gs = [rng.normal(size=(16, 3)) for _ in xs]
    rec = _local_dp_record(OneCopyOff(), xs, gs, "local, shards of spread 1 and 100")
    assert rec.status == "fail" and "grad_weight[0][0]" in rec.message, rec.message


def test_a_float32_averaged_gradient_is_judged_at_its_worst_replicas_conditioning():
    """Local BatchNorm on two replicas, shards of mean 0 and 1000 (spread 1), each
    replica's dL/dgamma computed in float32 the textbook way (mean, x - mean, x_hat, sum
    of g x_hat, all float32) and then averaged: a correct float32 backend. Replica 1's
    term errs by ~1000 u (its centring amplifies the mean's rounding by kappa ~1000), and
    every replica's copy holds the average, so each copy is judged at the worst kappa of
    the replicas averaged: at replica 0's own (kappa ~1), its copy fails, 108 ULPs against
    64. (Before, a scale that normalized replica 1's shard by replica 0's statistics,
    1000 times too large, hid this; see the test above.)"""
    def textbook_dgamma(x, g):
        m = x.mean(axis=0, dtype=np.float32)
        v = ((x - m) ** 2).mean(axis=0, dtype=np.float32)
        return (g * ((x - m) / np.sqrt(v + np.float32(1e-5)))).sum(axis=0, dtype=np.float32)

    class Float32Textbook(NumpyBackend):
        def data_parallel_batch_norm(self, steps, **kwargs):
            res = super().data_parallel_batch_norm(steps, **kwargs)
            grads = kwargs["grad_outputs"][0]
            mean = sum(textbook_dgamma(x, g) for x, g in zip(steps[0], grads, strict=True))
            mean = (mean / np.float32(len(grads))).astype(np.float32)
            for copy in res.grad_weight[0]:
                copy[...] = mean
            return res

    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(16, 3)), rng.normal(size=(16, 3)) + 1000.0]
    gs = [rng.normal(size=(16, 3)) for _ in xs]
    rec = _local_dp_record(Float32Textbook(), xs, gs, "local, shard means 0 and 1000",
                           fields=("grad_weight",))
    assert rec.status == "pass", rec.message


class _ParamGradOff(NumpyBackend):
    """The numpy backend with one parameter gradient of BatchNorm (`bn_field`, channel 0)
    or LayerNorm (`ln_field`, every element) scaled by 1 + `rel`."""

    def __init__(self, rel, bn_field=None, ln_field=None):
        super().__init__()
        self.rel, self.bn_field, self.ln_field = rel, bn_field, ln_field

    def _off(self, res, field, where):
        v = getattr(res, field).astype(np.float64)
        v[where] *= 1 + self.rel
        return res._replace(**{field: v.astype(res.output.dtype)})

    def batch_norm(self, *args, **kwargs):
        layer = super().batch_norm(*args, **kwargs)
        forward = layer.forward

        def off(x, grad_output=None):
            res = forward(x, grad_output)
            return res if grad_output is None else self._off(res, self.bn_field, 0)
        layer.forward = off
        return layer

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        return res if grad_output is None else self._off(res, self.ln_field, Ellipsis)


def _bn_grad_record(backend, x, g, mode):
    """The record of one BatchNorm step of `mode` on float64 x with upstream gradient g,
    in float32, a fresh layer (running mean 0, variance 1 for eval)."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops.batch_norm import BatchNormDriver

    ctx = Context(backend_name="t", source="tests", backend=backend, check_id="t", claim="F1",
                  op="batch_norm", dtype=np.dtype(np.float32), seed=0, examples=1,
                  conventions=backend.conventions)
    with ctx.case(f"{mode}, x {x.shape}"):
        driver = BatchNormDriver(ctx, x.shape[1], momentum=0.1)
        if mode == "eval":
            driver.set_mode(False)
        driver.step("x", Literal.of(x), mode=mode, grad=Literal.of(g))
    return ctx.records[-1]


def test_batchnorm_dgamma_is_judged_at_its_own_channels_conditioning():
    """dL/dgamma of channel 0 off by 1e-3 (1005 ULPs) beside a channel of mean 1000: a
    channel's dL/dgamma sums its own terms only, so its bound has its own kappa (~1.8),
    not the largest over every channel (~1000: 33,000 ULPs allowed, a pass; a review)."""
    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(64, 2)), rng.normal(size=(64, 2))
    x[:, 1] += 1000.0
    rec = _bn_grad_record(_ParamGradOff(1e-3, bn_field="grad_weight"), x, g, "train")
    assert rec.status == "fail" and "grad_weight[0]" in rec.message, rec.message


def test_batchnorm_eval_dgamma_counts_the_channels_own_terms():
    """Eval, 2 samples of 512 channels, dL/dgamma of channel 0 off by 4e-6 (31.5 ULPs):
    it sums 2 terms normalized by the running statistics (no reduction of x), so n = 2
    (bound 15.5), not every element of g, 1024 (51.5, a pass; a review)."""
    rng = np.random.default_rng(1)
    x, g = rng.normal(size=(2, 512)), rng.normal(size=(2, 512))
    rec = _bn_grad_record(_ParamGradOff(4e-6, bn_field="grad_weight"), x, g, "eval")
    assert rec.status == "fail" and "grad_weight[0]" in rec.message, rec.message


def test_layernorm_dbeta_counts_the_rows_it_sums():
    """dL/dbeta of 2 rows of d = 4096 off by 5e-7 relative (~8 ULPs): each element sums 2
    terms, so n = 2 (bound 3), not every element of g, 8192 (15, a pass; a review)."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops.norms import layer_norm_case

    backend = _ParamGradOff(5e-7, ln_field="grad_bias")
    ctx = Context(backend_name="t", source="tests", backend=backend, check_id="t", claim="F2",
                  op="layer_norm", dtype=np.dtype(np.float32), seed=0, examples=1,
                  conventions=backend.conventions)
    rng = np.random.default_rng(2)
    with ctx.case("2 rows of d = 4096"):
        layer_norm_case(ctx, x=Literal.of(rng.normal(size=(2, 4096))), normalized_shape=(4096,),
                        weight=Literal.of(np.ones(4096)), bias=Literal.of(np.zeros(4096)),
                        eps=1e-5, grad=Literal.of(rng.normal(size=(2, 4096))))
    rec = ctx.records[-1]
    assert rec.status == "fail" and "grad_bias" in rec.message, rec.message
