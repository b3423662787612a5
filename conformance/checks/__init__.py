"""The conformance checks, one module per family. all_checks() registers them all in
CHECKS and lists them in the order the report shows them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

CHECKS: list[Check] = []


@dataclass(frozen=True)
class Check:
    """A check: `id` starts with the claim id it verifies ("F2.values"); `ops` are the
    backend ops it drives; `needs` names capability flags it requires ("gradients",
    "no_grad_mode", "cumulative_momentum", "untracked_stats"); `dtypes`, when given,
    restricts the dtypes it applies to; `also` names further claims it verifies on the
    way (B7's check runs E4's numbers)."""

    id: str
    claim: str
    title: str
    ops: tuple[str, ...]
    fn: Callable
    needs: tuple[str, ...] = ()
    dtypes: tuple[str, ...] | None = None
    also: tuple[str, ...] = ()

    def verifies(self, claim_id: str) -> bool:
        return claim_id == self.claim or claim_id in self.claim.split("/") or claim_id in self.also


def check(id: str, *, title: str, ops: tuple[str, ...], needs: tuple[str, ...] = (),
          dtypes: tuple[str, ...] | None = None, also: tuple[str, ...] = ()):
    def register(fn):
        CHECKS.append(Check(id=id, claim=id.split(".")[0], title=title, ops=ops, fn=fn,
                            needs=needs, dtypes=dtypes, also=also))
        return fn
    return register


#: The families, in the order the report shows them.
FAMILIES = ("worked_examples", "values", "gradients", "invariance", "batchnorm_state",
            "batchnorm_matrix", "accumulation", "data_parallel", "qk_bound", "robustness",
            "shapes", "batch_invariance", "wirings", "fused_residual", "rounding",
            "contract")


def _family(c: Check) -> int:
    return FAMILIES.index(c.fn.__module__.rsplit(".", 1)[-1])


def all_checks() -> list[Check]:
    """Every check, family by family in FAMILIES' order, each family's in the order its
    module defines them: whichever module was imported first (a test that imports
    checks.shapes, say), so docs/claims.md, the report and shards list them alike."""
    for family in FAMILIES:  # importing a family registers its checks
        importlib.import_module(f"{__name__}.{family}")
    return sorted(CHECKS, key=_family)
