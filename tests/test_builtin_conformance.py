"""The built-in backends through the whole suite: torch, numba and triton conform to
every check they support (documented deviations and declared refusals aside); the known
facts of claims.md about torch and Flax show up as what they are."""

from __future__ import annotations

import pytest
from normspec.conformance import runner
from normspec.impls.protocol import DTYPES


@pytest.fixture(scope="module")
def results_by_backend():
    cache = {}

    def get(name, checks=None):
        key = (name, tuple(checks or ()))
        if key not in cache:
            cache[key] = runner.run([name], checks=checks, dtypes=DTYPES, seed=0, examples=4)
        return cache[key]["records"]

    return get


@pytest.mark.parametrize("name", ["torch", "numba", "triton"])
def test_backend_conforms_to_every_check_it_supports(results_by_backend, name):
    records = results_by_backend(name)
    bad = [f"{r['check']} {r['dtype']} {r['case']}: {r['status']}: {r['message'][:200]}"
           for r in records if r["status"] in ("fail", "error")]
    assert [] == bad
    assert sum(r["status"] == "pass" for r in records) > 100


def test_torch_refuses_eps_zero_in_batchnorm_training(results_by_backend):
    refused = [r for r in results_by_backend("torch", ["E3"]) if r["status"] == "refused"]
    assert {r["dtype"] for r in refused} == set(DTYPES)
    assert all("batch_norm eps must be positive during training" in r["message"] for r in refused)


def test_flax_biased_running_variance_is_a_deviation_never_a_pass(results_by_backend):
    records = results_by_backend("jax", ["F4.running_stats", "F4.declared_estimator"])
    stats = [r for r in records if r["check"] == "F4.running_stats"]
    assert {"deviation"} == {r["status"] for r in stats}
    assert all("biased" in r["reason"] for r in stats)
    # Flax declares the biased estimator, and that declaration is true
    assert {"pass"} == {r["status"] for r in records if r["check"] == "F4.declared_estimator"}


def test_flax_fast_variance_fails_the_large_shift(results_by_backend):
    records = results_by_backend("jax", ["B1.layer_norm_shift"])
    f32 = [r for r in records if r["dtype"] == "float32"]
    assert {"fail"} == {r["status"] for r in f32}


def test_torch_data_parallel_local_conforms_and_sync_batch_norm_is_refused_on_cpu(
        results_by_backend):
    """DDP over BatchNorm matches the oracle per shard (DP1) and follows its declared
    buffer broadcast (DP3); SyncBatchNorm refuses CPU tensors, with torch's message."""
    import torch

    records = [r for r in results_by_backend("torch") if r["claim"].startswith("DP")]
    sync = [r for r in records if r["claim"] == "DP2" or "cross-replica" in r["case"]]
    local = [r for r in records if r not in sync]
    assert local and {"pass"} == {r["status"] for r in local}
    if torch.cuda.is_available():
        assert {"pass"} == {r["status"] for r in sync}
    else:
        assert sync and {"refused"} == {r["status"] for r in sync}
        assert all("SyncBatchNorm layers only work with GPU modules" in r["message"] for r in sync)


def test_flax_cross_replica_batch_norm_is_the_global_batch_for_equal_shards_only(
        results_by_backend):
    """BatchNorm(axis_name=...) under shard_map: every compared quantity conforms but the
    running variance, which Flax keeps biased (its declared convention), and one value per
    replica trains (declared). Unequal shards (padded, with BatchNorm's mask) fail: Flax
    pmeans each replica's masked mean, weighting replicas and not rows (a finding)."""
    records = results_by_backend("jax", ["DP"])
    fails = [r for r in records if r["status"] == "fail"]
    assert {(r["check"], r["case"]) for r in fails} == {
        ("DP2.sync_global", "R = 2, unequal shards [2, 3], {'eps': 0.001, 'momentum': 0.3}")}
    assert {r["dtype"] for r in fails} == {"float32", "float64"}
    for r in records:
        if r["status"] == "deviation":
            assert r["reason"].startswith(("declared convention running_var_estimator",
                                           "declared convention single_value_batch")), r
        else:
            assert r["status"] == "fail", r
