"""The shape and layout matrix (conformance/checks/shapes.py): layouts are real views
whose recipe prints and rebuilds them, the groups have the cases the issue lists, and
the broken backends fail exactly where their bug class says (at the thresholds)."""

from __future__ import annotations

import broken_backends as bb
import numpy as np
import pytest
from normspec.conformance import runner
from normspec.conformance.cases import LAYOUTS, ArraySpec
from normspec.conformance.checks import all_checks, shapes
from normspec.impls.registry import LoadedBackend

CHECKS = {c.id: c for c in all_checks()}


def _offset(a):
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return a.__array_interface__["data"][0] - root.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_hold_the_same_values_and_rebuild_from_their_code(layout, dtype):
    spec = ArraySpec((3, 4, 5, 6), 1, 1.0, 2.0, layout)
    a, plain = spec.build(dtype), ArraySpec((3, 4, 5, 6), 1, 1.0, 2.0).build(dtype)
    assert np.array_equal(a, plain)
    again = eval(spec.code(dtype), {"ArraySpec": ArraySpec})  # noqa: S307 - our own recipe
    assert np.array_equal(again, a) and again.strides == a.strides and again.dtype == a.dtype
    item = a.itemsize
    if layout == "contiguous":
        assert a.flags.c_contiguous
        return
    assert not a.flags.c_contiguous
    if layout == "strided":
        assert a.strides[-1] == 2 * item
    elif layout == "sliced":
        assert _offset(a) > 0 and a.strides[-1] == item and a.strides[-2] != 6 * item
    elif layout == "channels_last":
        assert a.strides[1] == item
    elif layout == "transposed":
        assert a.strides[-2] == item
    elif layout == "split_heads":  # no one row stride: row (i, j) is not at (i n + j) s
        assert a.strides[-1] == item and a.strides[-3] != a.shape[-2] * a.strides[-2]


def test_the_gaps_of_a_view_hold_nan():
    """A kernel that reads outside the view sees NaN, not a plausible number."""
    a = ArraySpec((2, 5), 0, layout="strided").build("float32")
    assert np.isnan(a.base).sum() == a.size


def test_the_groups_have_the_issues_cases():
    assert [c["shape"][0] for c in shapes.row_count_cases()][:12] == [
        0, 1, 2, 255, 256, 257, 300, 4096, 65535, 65536, 65537, 131072]
    assert {c["shape"][1] for c in shapes.hidden_size_cases()} == {
        17, 100, 160, 512, 1039, 1536, 3584, 5120, 70_003}
    # the prefills' triggers (see PREFILL_ROWS): past 64 rows, a count no block of 4 or
    # 32 rows divides; in inference a row past one block of 1024 with a tail a vector of
    # 16 leaves, for both norms
    rows, d = shapes.PREFILL_ROWS, shapes.PREFILL_INFER_D
    assert rows > 64 and rows % 4 and rows % 32 and 1024 < d <= 65536 and d % 16
    assert {(c["op"], c["shape"]) for c in shapes.hidden_size_cases() if c.get("forward_alone")} \
        == {("layer_norm", (rows, d)), ("rms_norm", (rows, d))}
    assert {c["shape"][0] for c in shapes.hidden_size_cases() if c["mean"] != 1.0} == {300}
    assert {len(c["shape"]) for c in shapes.rank_cases()} == {2, 3, 4}
    assert {len(c["normalized_shape"]) for c in shapes.rank_cases()} == {1, 2, 3}
    layouts = list(shapes.layout_cases())
    assert {c.get("layout") for c in layouts} >= {"strided", "sliced", "transposed"}
    assert {c.get("grad_layout") for c in layouts} >= {"strided", "sliced", "transposed"}
    bn = list(shapes.batchnorm_layout_cases())
    assert {"channels_last", "strided", "sliced"} <= {c["layout"] for c in bn}
    assert any(c["layout"] == "channels_last" and len(c["shape"]) == 4 for c in bn)
    for case in shapes.row_count_cases():
        assert np.prod(case["shape"]) * 8 < 50e6  # every array under ~50 MB in float64


def _failing_rows(backend, check_id):
    loaded = LoadedBackend(backend.name, "tests", backend=backend)
    records = runner.run_check(loaded, CHECKS[check_id], "float32", seed=0, examples=1)
    return {(r.op, int(r.case.split(": ")[1].split(" ")[0])) for r in records
            if r.status == "fail"}


def test_a_grid_that_stops_at_65535_rows_fails_past_it_only():
    failing = _failing_rows(bb.GridStopsAt65535(), "F2/F3.row_counts")
    assert failing == {(op, n) for op in ("layer_norm", "rms_norm") for n in (65536, 65537, 131072)}


def test_a_fast_path_from_256_rows_fails_on_partial_blocks_only():
    failing = _failing_rows(bb.FastPathFrom256(), "F2/F3.row_counts")
    assert failing == {(op, n) for op in ("layer_norm", "rms_norm") for n in (257, 300, 65535, 65537)}


def test_unwritten_gradients_of_an_empty_batch_fail_there_only():
    failing = _failing_rows(bb.EmptyBatchSkipsBackward(), "F2/F3.row_counts")
    assert failing == {("layer_norm", 0), ("rms_norm", 0)}
    assert _failing_rows(bb.EmptyBatchSkipsDbeta(), "F2/F3.row_counts") == {("layer_norm", 0)}


@pytest.mark.parametrize("check_id", ["F2/F3.layouts", "F6.row_counts"])
def test_one_row_stride_fails_on_split_heads_only(check_id):
    """A kernel that walks rows at stride(-2) reads every view with one row stride right
    (the strided ones it copies): only heads split from a fused buffer catch it."""
    loaded = LoadedBackend("numpy", "tests", backend=bb.OneRowStride())
    records = runner.run_check(loaded, CHECKS[check_id], "float32", seed=0, examples=1)
    failing = {r.case for r in records if r.status != "pass"}
    assert failing and all("split_heads" in case for case in failing), failing
