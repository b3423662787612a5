"""Known deviations as data: entries that turn a failing record into `deviation` with
the entry's reason, and the entries no record needed any more (stale).

An entry names any of `check` (an id, an id prefix, or a claim id), `op`, `dtype` and
`quantity` (a stable quantity id or its dotted prefix: "batch_norm" covers every
BatchNorm quantity, "batch_norm.eval" the eval-mode ones, "batch_norm.eval.output" one);
everything it names must match, and nothing is matched on message text. `except_check`
(the same forms as `check`) leaves out records its reason does not explain, so that a
broad entry cannot turn another cause's failure into a deviation. A deviation
that a declared convention explains needs no entry: the convention turns exactly the
records it explains into deviations (see impls/protocol.py, Conventions)."""

from __future__ import annotations

KEYS = ("check", "except_check", "op", "dtype", "quantity", "reason")
#: The quantity id of a failed record whose backend broke the call's contract (wrote into
#: an input, returned something other than an array of the shape and dtype asked): no
#: entry matches it, whatever it selects (found by a review: an entry scoped to a check
#: turned "x modified in place" into a deviation).
PROTOCOL = "protocol"
SELECTORS = ("check", "op", "dtype", "quantity")


def problems(entry: dict) -> list[str]:
    """What is wrong with an entry (unknown keys, no reason, nothing selected), for the
    registry."""
    out = [f"unknown key {k!r} (known: {', '.join(KEYS)})" for k in entry if k not in KEYS]
    out += [f"{k} must be one string (an id, id prefix or claim id), got {entry[k]!r}"
            for k in ("check", "except_check") if k in entry and not isinstance(entry[k], str)]
    if not str(entry.get("reason", "")).strip():
        out.append("no reason")
    if not any(entry.get(k) for k in SELECTORS):
        out.append(f"selects every record: name at least one of {', '.join(SELECTORS)}")
    if str(entry.get("quantity") or "").split(".")[0] == PROTOCOL:
        out.append(f"quantity {entry['quantity']!r}: a breach of the protocol is never a "
                   "deviation")
    return out


def _prefix(value: str, target: str) -> bool:
    return value == target or value.startswith(target + ".")


def _check_is(rec: dict, target: str) -> bool:
    return _prefix(rec["check"], target) or rec["claim"] == target


def applies(entry: dict, rec: dict) -> bool:
    """The entry's check (less its except_check), op and dtype select this record (its
    quantity aside)."""
    target, excepted = entry.get("check"), entry.get("except_check")
    if (target and not _check_is(rec, target)) or (excepted and _check_is(rec, excepted)):
        return False
    return entry.get("dtype") in (None, rec["dtype"]) and entry.get("op") in (None, rec["op"])


def matches(entry: dict, rec: dict) -> bool:
    quantity, got = entry.get("quantity"), rec.get("quantity") or ""
    return (got != PROTOCOL and applies(entry, rec)
            and (not quantity or _prefix(got, quantity)))


def reason_for(rec: dict, entries: list[dict]) -> str | None:
    """The reason of the first entry that matches a failed record, or None."""
    for entry in entries:
        if matches(entry, rec):
            return str(entry["reason"])
    return None


def stale(entries: list[dict], records: list[dict]) -> list[dict]:
    """Entries that select records of this run yet explained none of them: the backend
    no longer deviates there (or the entry is wrong), and the entry should go."""
    out = []
    for entry in entries:
        selected = [r for r in records if applies(entry, r)]
        used = any(r["status"] == "deviation" and r.get("reason") == entry["reason"]
                   and matches(entry, r) for r in selected)
        if selected and not used:
            out.append(entry)
    return out
