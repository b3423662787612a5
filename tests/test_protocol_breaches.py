"""A red team's backends that break the protocol's promises about what an op returns, or
offer only some ops: each gets the record its behaviour deserves, a protocol fail naming
what came back or an unsupported one, never an error from the harness's own code or a
pass."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from normspec.conformance import runner
from normspec.conformance.checks import all_checks
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.protocol import Capabilities, Result
from normspec.impls.registry import LoadedBackend
from oracle_backend import OracleBackend

CHECKS = {c.id: c for c in all_checks()}


def run(backend, check_id, dtype):
    loaded = LoadedBackend(backend.name, "tests", backend=backend)
    return runner.run_check(loaded, CHECKS[check_id], dtype, seed=0, examples=3, timeout=60.0)


class BatchNormOnly(NumpyBackend):
    capabilities = Capabilities(ops={"batch_norm"}, dtypes={"float32", "float64"},
                                gradients={"batch_norm"})


class SoftcapOnly(NumpyBackend):
    capabilities = Capabilities(ops={"softcap"}, dtypes={"float32", "float64"})


@pytest.mark.parametrize("backend, check_id, dtype", [
    (BatchNormOnly(), "protocol.parameter_dtype", "float64"),
    (SoftcapOnly(), "protocol.shape_dtype_inputs", "float32"),
    (SoftcapOnly(), "protocol.eps_zero", "float64"),
])
def test_a_backend_without_the_ops_a_protocol_check_drives_is_unsupported_there(
        backend, check_id, dtype):
    """A correct backend offering only BatchNorm (or softcap) got "the check produced no
    result (a defect in normspec)", an error that failed its run."""
    records = run(backend, check_id, dtype)
    assert [r.status for r in records] == ["unsupported"], [(r.status, r.message) for r in records]
    assert "capabilities do not list" in records[0].message


class BareLayerNorm(NumpyBackend):
    """layer_norm returns its output array, not a Result."""

    def layer_norm(self, *args, **kwargs):
        return super().layer_norm(*args, **kwargs).output


class ResultScores(NumpyBackend):
    """qk_norm_scores returns a Result, not the scores array."""

    def qk_norm_scores(self, *args, **kwargs):
        return Result(super().qk_norm_scores(*args, **kwargs))


class MatrixLayerNorm(NumpyBackend):
    """layer_norm's output as an np.matrix (an ndarray subclass) where it is 2-D."""

    def layer_norm(self, *args, **kwargs):
        res = super().layer_norm(*args, **kwargs)
        out = res.output
        if out.ndim != 2:
            return res
        with warnings.catch_warnings():  # (NumPy discourages the class)
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            return res._replace(output=np.asmatrix(out))


class FirstRowOnly(NumpyBackend):
    """layer_norm and rms_norm return the first row alone for a 2-row float64 input."""

    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        return res._replace(output=res.output[:1]) if x.shape == (2, 2) else res

    def rms_norm(self, x, *args, **kwargs):
        res = super().rms_norm(x, *args, **kwargs)
        return res._replace(output=res.output[:1]) if x.shape == (2, 2) else res


@pytest.mark.parametrize("backend, check_id, dtype, says", [
    (BareLayerNorm(), "F2.values", "float32", "with no .output, but the protocol says a Result"),
    (ResultScores(), "F6.values", "float32", "got output = a Result, but the protocol says a "
                                             "NumPy array"),
    (MatrixLayerNorm(), "F2.values", "float32", "numpy.matrix"),
    (FirstRowOnly(), "protocol.parameter_dtype", "float64", "of shape (1, 2)"),
])
def test_an_op_returning_the_wrong_kind_is_a_protocol_failure(backend, check_id, dtype, says):
    """Found by a red team: a bare array from layer_norm was an AttributeError error, a
    Result from qk_norm_scores a ValueError, an np.matrix passed the output check and
    broke the checks' arithmetic later, and protocol.parameter_dtype read an output of
    the wrong shape as an answer."""
    records = run(backend, check_id, dtype)
    failed = [r for r in records if r.status == "fail"]
    assert failed and not any(r.status == "error" for r in records), \
        [(r.status, r.message[:120]) for r in records]
    assert all(r.quantity == "protocol" for r in failed), [r.quantity for r in failed]
    assert any(says in r.message for r in failed), failed[0].message


class WrongWhereOffered(NumpyBackend):
    """LayerNorm refuses rows of one element (NotImplementedError) and is 1% off on every
    other row."""

    def layer_norm(self, x, *args, **kwargs):
        if x.shape[-1] == 1:
            raise NotImplementedError("rows of one element")
        res = super().layer_norm(x, *args, **kwargs)
        return res._replace(output=(res.output.astype(np.float64) * 1.01).astype(x.dtype))


def test_one_unsupported_example_does_not_hide_the_case():
    """Found by a red team: the first drawn example's NotImplementedError ended the
    Hypothesis case, recorded unsupported, and the backend, wrong on every other example,
    passed. Now only that example is unsupported: the case fails, and a case whose
    examples all run says nothing of the kind."""
    records = run(WrongWhereOffered(), "F2.values", "float32")
    drawn = [r for r in records if "hypothesis" in r.case]
    assert any(r.status == "fail" for r in drawn), [(r.status, r.message[:100]) for r in drawn]
    assert all(r.status != "unsupported" for r in drawn), [(r.status, r.note) for r in drawn]
    noted = [r for r in run(NumpyBackend(), "F2.values", "float32") if "hypothesis" in r.case]
    assert noted and all("unsupported" not in r.note for r in noted)


class RewritesItsParams(OracleBackend):
    """An encoder layer computed with norm1's gain doubled, which then writes the doubled
    gain into the params dict it was handed (new arrays: no array is written into)."""

    def encoder_layer(self, x, params, *args, **kwargs):
        doubled = dict(params, **{"norm1.weight": params["norm1.weight"] * 2})
        params.update(doubled)
        return super().encoder_layer(x, doubled, *args, **kwargs)


class KeepsAndZeroesX(NumpyBackend):
    """LayerNorm keeps each x it is given and zeroes the last one at its next call."""

    kept = None

    def layer_norm(self, x, *args, **kwargs):
        if self.kept is not None:
            self.kept[...] = 0
        self.kept = x
        return super().layer_norm(x, *args, **kwargs)


class ZeroesItsWeight(NumpyBackend):
    """A BatchNorm layer that computes with its own copy of weight and zeroes the array it
    was built with at every forward."""

    def batch_norm(self, num_features, **kwargs):
        given = kwargs.get("weight")
        kwargs["weight"] = None if given is None else given.copy()
        layer = super().batch_norm(num_features, **kwargs)
        forward = layer.forward

        def zeroing(*args, **kw):
            if given is not None:
                given[...] = 0
            return forward(*args, **kw)
        layer.forward = zeroing
        return layer


@pytest.mark.parametrize("backend, check_id, says", [
    (RewritesItsParams(), "F8.post_ln", None),
    (KeepsAndZeroesX(), "B9.layer_norm", "after the call had returned"),
    (ZeroesItsWeight(), "F1.values", "weight modified in place after the call had returned"),
])
def test_inputs_written_into_later_or_through_a_dict_are_caught(backend, check_id, says):
    """Found by a red team, all passed: an encoder layer rewriting the params dict it was
    handed (the oracle read that dict after the call, and computed the backend's wrong
    answer); a LayerNorm zeroing the x of its last call at the next one; a BatchNorm
    layer zeroing, at every forward, the weight it was built with."""
    records = run(backend, check_id, "float32")
    failed = [r for r in records if r.status == "fail"]
    assert failed, [(r.status, r.message[:100]) for r in records]
    if says:
        assert all(r.quantity == "protocol" for r in failed)
        assert any(says in r.message for r in failed), failed[0].message


def test_an_input_written_into_by_fused_add_norm_is_named():
    """A fused_add_norm writing into its upstream gradients: the failure names the
    argument as the call writes it (it said "argument 5")."""
    class WritesGradResidual(NumpyBackend):
        def fused_add_norm(self, x, residual, *args, grad_outputs=None, **kwargs):
            res = super().fused_add_norm(x, residual, *args, grad_outputs=grad_outputs, **kwargs)
            if grad_outputs is not None:
                grad_outputs[1][...] = 0
            return res

    records = run(WritesGradResidual(), "F8.fused_add_layer_norm", "float32")
    failed = [r for r in records if r.status == "fail"]
    assert failed and all("got grad_residual modified in place" in r.message for r in failed), \
        [r.message[:100] for r in records]


class SetsNumpysState(NumpyBackend):
    """LayerNorm sets NumPy to raise on every floating-point error and to print as 1.13
    did, and leaves it so."""

    def layer_norm(self, *args, **kwargs):
        np.seterr(all="raise")
        np.set_printoptions(legacy="1.13")
        return super().layer_norm(*args, **kwargs)


@pytest.fixture
def numpy_state():
    err, opts = np.geterr(), np.get_printoptions()
    yield
    np.seterr(**err)
    np.set_printoptions(**opts)


def test_numpys_state_set_by_a_backend_stays_the_backends(numpy_state):
    """Found by a red team: a backend's np.seterr(all="raise") made the harness's own
    arithmetic raise FloatingPointError in later cases (RMSNorm's too, which the backend
    never touched), recorded as errors naming neither; its print options cut float32
    numbers in messages to 8 digits."""
    err, opts = np.geterr(), np.get_printoptions()
    records = run(SetsNumpysState(), "F2/F3.ranks", "float16")
    # its own LayerNorm may raise (its setting, its finding); nothing else may
    theirs = [r for r in records if r.status == "error"
              and not r.message.startswith("result = backend.layer_norm(")]
    assert not theirs, [r.message[:120] for r in theirs]
    assert any(r.op == "rms_norm" or "rms_norm" in r.case for r in records)
    assert (np.geterr(), np.get_printoptions()) == (err, opts)


def test_messages_print_shortest_round_trip_numbers_whatever_the_print_options():
    """A backend that set legacy="1.13" at import made every float32 in messages 8
    digits long: values an ULP apart read alike ("got 1.0, but the spec says 1.0")."""
    from normspec.conformance.assertions import fmt

    with np.printoptions(legacy="1.13"):
        assert fmt(9.3616705, "float32") == "9.3616705"
        assert fmt(1.0000001, "float32") != fmt(1.0, "float32")


class CapabilitiesRaise(NumpyBackend):
    """Its capabilities raise once checks start (a property computed from a broken
    probe); its conventions raise in the variant below."""

    @property
    def capabilities(self):
        raise RuntimeError("probe failed")


class ConventionsRaise(NumpyBackend):
    @property
    def conventions(self):
        raise RuntimeError("no table")


@pytest.mark.parametrize("backend, declared", [(CapabilitiesRaise(), "capabilities"),
                                               (ConventionsRaise(), "conventions")])
def test_a_declaration_that_raises_is_the_units_error_named(backend, declared):
    """Found by a red team: the harness read the declaration outside any guard, the
    exception ended the backend's process, and the record said "its process died"."""
    records = run(backend, "F2.values", "float32")
    assert [r.status for r in records] == ["error"], [(r.status, r.message) for r in records]
    assert records[0].message == (f"reading the backend's {declared} raised RuntimeError: "
                                  f"{'probe failed' if declared == 'capabilities' else 'no table'}")


def test_each_qk_score_is_judged_at_its_own_terms():
    """A one-hot query against an aligned key and a near-orthogonal one, the latter's
    score off by 2e-4 relative (a tail key normalized with a slightly wrong RMS): 1718
    ULPs at that score's own sum of |terms|, and 27 of the row's largest, which the bound
    (30) let pass (a review of every scale)."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops import qk_scores_case

    class LastKeyOff(NumpyBackend):
        def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
            s = super().qk_norm_scores(q, k, q_weight, k_weight, eps, scale).astype(np.float64)
            s[..., -1] *= 1 + 2e-4
            return s.astype(q.dtype)

    d = 64
    q, k = np.zeros((1, 1, d)), np.zeros((1, 2, d))
    q[..., 0], k[0, 0, :], k[0, 1, 1], k[0, 1, 0] = 1.0, 1.0, 1.0, 1e-3
    backend = LastKeyOff()
    ctx = Context(backend_name="t", source="tests", backend=backend, check_id="t", claim="F6",
                  op="qk_norm_scores", dtype=np.dtype(np.float32), seed=0, examples=1,
                  conventions=backend.conventions)
    with ctx.case("one-hot query, an aligned key and a near-orthogonal key"):
        qk_scores_case(ctx, q=Literal.of(q), k=Literal.of(k), eps=1e-6)
    rec = ctx.records[-1]
    assert rec.status == "fail" and rec.worst["index"] == [0, 0, 1], (rec.status, rec.worst)


@pytest.mark.parametrize("factory", ["CapabilitiesRaise", "ConventionsRaise"])
def test_a_declaration_that_raises_at_load_makes_the_backend_unusable_said_why(factory):
    """Read first by the registry when the backend loads: one that raised there ended
    the process that loaded it ("died while loading it"; a review)."""
    from normspec.impls import registry

    loaded = registry.load(f"test_protocol_breaches:{factory}")
    assert not loaded.available and "reading its declarations raised RuntimeError" in \
        loaded.error, loaded.error


class NoLayer(NumpyBackend):
    """batch_norm returns None."""

    def batch_norm(self, *args, **kwargs):
        return None


class StatlessLayer(NumpyBackend):
    """batch_norm's layer has no running_mean attribute at all."""

    def batch_norm(self, *args, **kwargs):
        layer = super().batch_norm(*args, **kwargs)

        class Bare:
            forward, train, eval = layer.forward, layer.train, layer.eval
        return Bare()


@pytest.mark.parametrize("backend, says", [
    (NoLayer(), "got layer = NoneType with no forward, train, eval method"),
    (StatlessLayer(), "got a layer without running statistics"),
])
def test_batch_norm_returning_no_layer_is_a_protocol_failure(backend, says):
    """Found by a red team: batch_norm() returning None was an AttributeError in the
    harness's code, an error record that did not say what the backend got wrong."""
    records = run(backend, "F1.matrix", "float32")
    judged = [r for r in records if r.status != "unsupported"]  # (cases numpy does not offer)
    assert judged and all(r.status == "fail" and r.quantity == "protocol" for r in judged), \
        [(r.status, r.message[:120]) for r in judged]
    assert all(says in r.message for r in judged), judged[0].message


class MaxRowsText(NumpyBackend):
    capabilities = Capabilities(ops={"layer_norm"}, dtypes={"float32"}, max_rows="100")


class MaxRowsZero(NumpyBackend):
    capabilities = Capabilities(ops={"layer_norm"}, dtypes={"float32"}, max_rows=0)


@pytest.mark.parametrize("factory, says", [("MaxRowsText", "max_rows = '100'"),
                                           ("MaxRowsZero", "max_rows = 0")])
def test_a_max_rows_that_is_not_a_row_count_is_refused_at_load(factory, says):
    """A max_rows of "100" was a TypeError error in every shapes check that compares it
    (a red team): the backend is unusable, said why, before any check."""
    from normspec.impls import registry

    loaded = registry.load(f"test_protocol_breaches:{factory}")
    assert not loaded.available and says in loaded.error, loaded.error


def test_a_property_that_raises_attribute_error_is_not_called_missing():
    """An AttributeError raised inside the backend's own running_mean property (a bug
    there) is that error, not "a layer without running statistics" (a review)."""
    class Buggy(NumpyBackend):
        def batch_norm(self, *args, **kwargs):
            layer = super().batch_norm(*args, **kwargs)

            class Wrapped:
                forward, train, eval = layer.forward, layer.train, layer.eval
                running_var = property(lambda self: layer.running_var)

                @property
                def running_mean(self):
                    return self._oops

            return Wrapped()

    records = [r for r in run(Buggy(), "F1.matrix", "float32") if r.status != "unsupported"]
    assert records and not any("without running statistics" in r.message for r in records)
    assert all("_oops" in r.message for r in records), records[0].message
