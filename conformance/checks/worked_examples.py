"""The document's first worked examples on a backend (E1, E2): one short row, and the same
row shifted by 10, through LayerNorm and RMSNorm with eps = 0. The oracle gives the
document's numbers (tests/test_spec_claims.py); here the backend must give the oracle's."""

from __future__ import annotations

from ..cases import Literal
from ..ops import layer_norm_case, rms_norm_case
from . import check

ROWS = {"E1": ((1.0, 3.0),), "E2": ((11.0, 13.0),)}


def _example(ctx, claim):
    x = Literal(values=ROWS[claim])
    for op, run in (("layer_norm", layer_norm_case), ("rms_norm", rms_norm_case)):
        if op not in ctx.backend.capabilities.ops:
            continue
        with ctx.case(f"{op} of {list(ROWS[claim][0])}, eps = 0", op=op):
            ctx.require(op)
            run(ctx, x=x, normalized_shape=(2,), eps=0.0)


@check("E1.worked_example", title="x = [1, 3]: LayerNorm [-1, 1], RMSNorm [0.4472136, 1.3416408]",
       ops=("layer_norm", "rms_norm"))
def e1(ctx):
    _example(ctx, "E1")


@check("E2.worked_example", title="x = [11, 13]: LayerNorm still [-1, 1], RMSNorm "
       "[0.9135003, 1.0795912]", ops=("layer_norm", "rms_norm"))
def e2(ctx):
    _example(ctx, "E2")
