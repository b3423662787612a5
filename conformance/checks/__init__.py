"""The conformance checks, one module per family. Importing this package registers
them all in CHECKS, in the order the report lists them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CHECKS: list[Check] = []


@dataclass(frozen=True)
class Check:
    """A check: `id` starts with the claim id it verifies ("F2.values"); `ops` are the
    backend ops it drives; `needs` names capability flags it requires ("gradients",
    "no_grad_mode", "cumulative_momentum", "untracked_stats"); `dtypes`, when given,
    restricts the dtypes it applies to."""

    id: str
    claim: str
    title: str
    ops: tuple[str, ...]
    fn: Callable
    needs: tuple[str, ...] = ()
    dtypes: tuple[str, ...] | None = None


def check(id: str, *, title: str, ops: tuple[str, ...], needs: tuple[str, ...] = (),
          dtypes: tuple[str, ...] | None = None):
    def register(fn):
        CHECKS.append(Check(id=id, claim=id.split(".")[0], title=title, ops=ops, fn=fn,
                            needs=needs, dtypes=dtypes))
        return fn
    return register


def all_checks() -> list[Check]:
    from . import (  # noqa: F401 - imported for their registrations
        accumulation,
        batchnorm_state,
        contract,
        gradients,
        invariance,
        qk_bound,
        robustness,
        values,
    )
    return list(CHECKS)
