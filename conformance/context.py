"""What a check sees: one backend, one dtype, a seed, and guarded calls into the backend.

Every call into a backend goes through `Context.call` (or `Context.raises`, where
raising is the finding), which enforces the protocol's contract for every check alike:
inputs are not modified, outputs are NumPy arrays of the expected shape and dtype; a
raise is an error unless the backend's conventions declare that refusal, and
NotImplementedError means unsupported.

The context also owns what a record is made of, so checks only state what they
compare: `case()` opens a record, `conforms()` / `holds()` / `differs()` compare and
collect the worst error into it, `oracle()` writes the oracle's side of the repro, and
the repro snippet is built only for a record that needs one.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from normspec.impls.protocol import compute_dtype
from normspec.spec import round_to

from .assertions import (
    CheckFailure,
    Measure,
    assert_conforms,
    assert_differs,
    assert_holds,
)
from .cases import repro_snippet
from .deviations import PROTOCOL
from .diagnosis import Alternatives, diagnose
from .results import Record
from .tolerances import unit_roundoff
from .twins import modified, twin

#: Shrinking re-runs a failing backend many times; it is opt-in (--shrink). Every drawn
#: example is a printable recipe, so an unshrunk failure replays just as well.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
PHASES_WITH_SHRINK = PHASES + (Phase.shrink,)


_draw_guard = {"depth": 0, "saved": None}
_draw_guard_lock = threading.Lock()  # the pytest plugin and coverage run checks in threads


@contextlib.contextmanager
def seed_only_draws():
    """Hypothesis draws that depend on the seed alone. Hypothesis (since 6.131) collects
    the literals (numbers, strings, bytes) in the source of every loaded module outside
    site-packages, and tries a collected or built-in constant in about one draw in
    twenty: with local ones among them, the same seed drew different examples from an
    editable install of normspec than from a normal one (8 of 12 drawn records of two
    checks), or with a user's backend file kept in their own repository. Inside this
    context Hypothesis sees no local constants, only its own; a normal install has none
    anyway, so its draws do not change. Internal API: where it is missing there is
    nothing to switch off.

    The switch is process-wide: while any thread is inside (an abandoned, timed-out
    check included), other Hypothesis tests in the process draw without local constants
    too; the last thread out restores them. Nested and overlapping uses are counted."""
    try:
        from hypothesis.internal.conjecture import providers
        cache = providers.CONSTANTS_CACHE.cache
        empty = providers.Constants()
        providers._get_local_constants  # noqa: B018 - present in this Hypothesis?
    except (ImportError, AttributeError):
        yield
        return
    with _draw_guard_lock:
        if _draw_guard["depth"] == 0:
            _draw_guard["saved"] = providers._get_local_constants
            providers._get_local_constants = lambda: empty
            cache.clear()  # permitted constants are cached with the local ones mixed in
        _draw_guard["depth"] += 1
    try:
        yield
    finally:
        with _draw_guard_lock:
            _draw_guard["depth"] -= 1
            if _draw_guard["depth"] == 0:
                providers._get_local_constants = _draw_guard["saved"]
                cache.clear()


class Unsupported(Exception):
    """The backend does not offer this (declared, or NotImplementedError)."""


class Refused(Exception):
    """The backend raised where the spec gives a value, as its conventions declare."""


class BackendError(Exception):
    """The adapter crashed or broke the protocol."""


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        kind = "array" if type(a) is np.ndarray else f"{type(a).__module__}.{type(a).__name__}"
        return f"{kind} of shape {a.shape} and dtype {a.dtype}"
    return f"{type(a).__name__} {a!r}"[:200]


#: Characters of a backend's exception message a record keeps (its head and tail).
MAX_MESSAGE = 4000
#: Set in a worker process, which ignores SIGINT: a KeyboardInterrupt raised in a backend
#: call there is the backend's, a finding like any exception.
BACKEND_INTERRUPTS_ARE_FINDINGS = False


def _users_interrupt(exc: BaseException) -> bool:
    """Whether `exc` (a KeyboardInterrupt or SystemExit out of backend code) is the
    user's Ctrl-C, to let through: in-process (the pytest plugin) a KeyboardInterrupt
    may be; in a worker, which ignores SIGINT, it is the backend's own."""
    return isinstance(exc, KeyboardInterrupt) and not BACKEND_INTERRUPTS_ARE_FINDINGS


def exception_text(exc: BaseException, *, with_type: bool = True) -> str:
    """'Type: message' of an exception a backend raised, whatever it holds: a __str__
    that raises, a lone surrogate (escaped, so the results and the report can be
    written), or megabytes of text (cut to MAX_MESSAGE characters, head and tail)."""
    try:
        said = str(exc)
    except Exception as inner:  # noqa: BLE001 - the backend's own __str__
        said = f"(its message could not be read: {type(inner).__name__})"
    said = said.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(said) > MAX_MESSAGE:
        half = MAX_MESSAGE // 2
        said = f"{said[:half]} [... {len(said) - MAX_MESSAGE} characters ...] {said[-half:]}"
    if not with_type:
        return said
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def _finding(check: str, dtype: str, case: str, status: str, measure: Measure) -> str:
    """The record a repro snippet replays, in words: which quantity decided it and by how
    much, and why the snippet's own ULP counts may differ from the record's."""
    head = f"normspec {check} {dtype} ({case}): {status}"
    worst = measure.worst
    if measure.comparisons and worst.get("quantity") and measure.max_ulp is not None:
        index = worst.get("index")
        at = f"[{', '.join(map(str, index))}]" if index else ""
        head += (f" on {worst['quantity']}{at}: {measure.max_ulp:.3g} ULPs at the check's "
                 f"scale (bound {measure.bound_ulp:.3g})\nshow() prints each quantity's worst "
                 "element in ULPs at its row's largest |expected|, a plainer scale than the "
                 "check's: its counts can differ from the record's")
    return head


def _shows_result(code: str) -> str:
    """A repro line printing what the call `code` (`name = ...`) returned, field by field:
    each array's shape and dtype, anything else's type."""
    name = code.split(" = ")[0] if " = " in code else "result"
    return ("print('protocol: got', {k: (v.shape, str(v.dtype)) if isinstance(v, np.ndarray) "
            f"else type(v).__name__ for k, v in ({name}._asdict().items() if hasattr({name}, "
            f"'_asdict') else [('output', {name})])}})")


def _parameter(fn, i: int) -> str:
    """The name of fn's parameter i (as the protocol names it: x, weight, ...), or
    "argument i" where its signature does not say."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return f"argument {i}"
    if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY,
                                               params[i].POSITIONAL_OR_KEYWORD):
        return params[i].name
    return f"argument {i}"


def _owned(out):
    """The arrays a call returned, copied: a backend that hands back one buffer at every
    call (a static output, a cache) would otherwise overwrite an earlier result with a
    later one, and two calls a check compares would always agree (found by a review:
    B9.deterministic passed a nondeterministic backend that reused its buffer)."""
    if isinstance(out, np.ndarray):
        return out.copy()
    if isinstance(out, tuple) and hasattr(out, "_replace"):
        return out._replace(**{k: v.copy() for k, v in out._asdict().items()
                               if isinstance(v, np.ndarray)})
    return out


@dataclass
class Context:
    backend_name: str
    source: str
    backend: Any
    check_id: str
    claim: str
    op: str
    dtype: np.dtype
    seed: int
    examples: int
    conventions: Any = None
    shrink: bool = False
    records: list[Record] = field(default_factory=list)
    #: called with each record as its case ends, so the run can stream it to disk
    on_record: Callable[[Record], None] | None = None
    calls: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    #: (call, fn, argument names, the originals, their twins) of each backend call of the
    #: case (see call): the twins are held until the case ends, and checked again then
    held: list = field(default_factory=list)
    measure: Measure = field(default_factory=Measure)
    notes: list[str] = field(default_factory=list)
    #: (message, reason) of each comparison the spec's answer missed and a declared
    #: convention's met: the case goes on, and ends as a deviation unless it fails
    explained: list[tuple[str, str]] = field(default_factory=list)
    #: the message of the current case if it passes: a measured property the reader
    #: should see without opening the record ("batch-invariant: ...")
    said: str = ""

    @property
    def dtype_name(self) -> str:
        return self.dtype.name

    # ---------------------------------------------------------------- repro
    def repro(self, finding: str = "") -> str:
        return repro_snippet(backend_source=self.source, dtype_name=self.dtype_name,
                             inputs=self.inputs, calls=self.calls, finding=finding)

    def use(self, **recipes):
        """Register the input recipes of the current case; return them built in dtype
        (a None recipe registers the name as None, so the repro defines it)."""
        self.inputs.update(recipes)
        built = [None if r is None else r.build(self.dtype) for r in recipes.values()]
        return built[0] if len(built) == 1 else built

    def oracle(self, *lines: str) -> None:
        """The oracle's side of the current case, as the repro writes it."""
        self.calls.extend(lines)

    # ---------------------------------------------------------------- conventions
    def convention(self, name: str, default=None):
        return getattr(self.conventions, name, default)

    def accepts_eps_zero(self, op: str) -> bool:
        """Whether the backend's conventions say it accepts eps = 0 for `op` (default yes)."""
        return bool((self.convention("eps_zero", {}) or {}).get(op, True))

    def reason(self, convention: str) -> str:
        """The declared reason for a convention, for the records it explains."""
        value = self.convention(convention)
        why = (self.convention("reasons", {}) or {}).get(convention, "")
        return f"declared convention {convention} = {value!r}" + (f": {why}" if why else "")

    def effective(self, value: float | None, what: str) -> float | None:
        """A parameter (eps, momentum) as the backend holds it: rounded to its declared
        `parameter_dtype` where that is coarser than this dtype's compute precision.
        The oracle is evaluated at it, and the record says so."""
        held = self.convention("parameter_dtype")
        if value is None or held is None:
            return value
        if unit_roundoff(held) <= unit_roundoff(compute_dtype(self.dtype)):
            return value
        if what == "momentum" and self.convention("momentum_held_as") == "old":
            rounded = 1.0 - float(round_to(np.float64(1.0 - value), held))
            how = f"1 - {held}(1 - {value!r})"
        else:
            rounded = float(round_to(np.float64(value), held))
            how = f"{held}({value!r})"
        if rounded != value:
            note = f"oracle at {what} = {how} = {rounded!r} (declared parameter_dtype)"
            if note not in self.notes:
                self.notes.append(note)
        return rounded

    # ---------------------------------------------------------------- calls
    def call(self, code: str, fn, *args, outputs_like=None, bare: bool = False,
             refusable: bool = False, arg_names: tuple[str, ...] = ()):
        """Call the backend. `code` is the call as the repro writes it; `outputs_like`
        maps Result field names to the (shape, dtype) the protocol requires, or with
        `bare` (ops that return their output as an array: qk_norm_scores, softcap,
        forward_no_grad) "output" to the array's; each must be a numpy.ndarray itself, not
        a subclass (np.matrix broke the checks' own arithmetic: a red team); `arg_names`
        names the arguments as `code` does, where their positions there are not fn's (an
        argument written into is named by them)."""
        self.calls.append(code)
        twins = {i: twin(a) for i, a in enumerate(args) if isinstance(a, np.ndarray)}
        # held until the case ends: no two calls of a case get arrays of one id(), which
        # a backend caching its results by id() would take for the same input (found by
        # a review: B9.deterministic then compared a cached answer with itself)
        self.held.append((code, fn, arg_names, args, twins))
        try:
            # NumPy's error handling and print options as they were: a backend's np.seterr
            # made the harness's own arithmetic raise in later cases, and its print options
            # the records' numbers (found by a red team)
            with np.errstate(), np.printoptions():
                out = fn(*(twins[i][0] if i in twins else a for i, a in enumerate(args)))
        except NotImplementedError as exc:
            said = exception_text(exc, with_type=False)
            raise Unsupported(f"{code}: not implemented ({said})" if said else
                              f"{code}: not implemented") from exc
        except (KeyboardInterrupt, SystemExit) as exc:
            if _users_interrupt(exc):
                raise
            raise BackendError(f"{code} raised {exception_text(exc)}") from exc
        except Exception as exc:  # noqa: BLE001 - a backend's failure is a finding
            message = exception_text(exc)
            if refusable:
                raise Refused(message) from exc
            raise BackendError(f"{code} raised {message}") from exc
        for name, (shape, dtype) in (outputs_like or {}).items():
            if not bare and (isinstance(out, np.ndarray) or not hasattr(out, name)):
                raise self._breach(f"got {_describe(out)}, with no .{name}, but the protocol "
                                   f"says a Result whose {name} is a NumPy array [{code}]",
                                   _shows_result(code))
            value = out if bare else getattr(out, name)
            if type(value) is not np.ndarray:
                said = "a Result" if bare and hasattr(value, "_fields") else _describe(value)
                raise self._breach(f"got {name} = {said}, but the protocol says a NumPy array "
                                   f"(numpy.ndarray) [{code}]", _shows_result(code))
            if value.shape != tuple(shape) or value.dtype != np.dtype(dtype):
                raise self._breach(
                    f"got {name} of shape {value.shape} and dtype {value.dtype}, but the "
                    f"spec says shape {tuple(shape)} and dtype {np.dtype(dtype)} [{code}]",
                    _shows_result(code))
        owned = _owned(out)
        # after all the backend's code the call runs (its result's attributes too)
        self._inputs_untouched(self.held[-1])
        return owned

    def _inputs_untouched(self, held, later: bool = False) -> None:
        """Raise the protocol failure of a call (one entry of `held`) whose inputs' twins
        the backend wrote into; `later`: found after the call had returned."""
        code, fn, arg_names, args, twins = held
        for i, made in twins.items():
            how = modified(args[i], *made)
            if how:
                what = arg_names[i] if i < len(arg_names) else _parameter(fn, i)
                where = ("modified in place" if how == "elements" else
                         "'s memory written outside its elements (through wrong strides?)")
                when = " after the call had returned" if later else ""
                raise self._breach(f"got {what}{' ' if how == 'elements' else ''}{where}{when}, "
                                   f"but the spec says inputs are never modified [{code}]",
                                   self._shows_inputs())

    def _inputs_untouched_since(self) -> None:
        """Every call of the case (or of a drawn example) checked again at its end: a
        backend that keeps an input and writes into it later, at another call (found by a
        red team: x zeroed at the next call, a BatchNorm layer zeroing the weight it was
        built with at every forward, all passed), corrupts its callers' arrays as surely."""
        for held in self.held:
            self._inputs_untouched(held, later=True)

    def _breach(self, message: str, shows: str) -> CheckFailure:
        """The failure of a call that broke its contract (quantity "protocol"), and the
        repro line `shows` that prints the breach."""
        self.calls.append(shows)
        return CheckFailure(message, protocol=True)

    def _shows_inputs(self) -> str:
        """A repro line printing which inputs differ, bit for bit, from their recipes."""
        pairs = ", ".join(f"({name!r}, {name}, {recipe.code(self.dtype_name)})"
                          for name, recipe in self.inputs.items() if recipe is not None)
        return ("print('protocol: modified in place:', [n for n, now, made in "
                f"[{pairs}] if np.asarray(now).tobytes() != np.asarray(made).tobytes()])")

    def raises(self, code: str, fn, *args) -> str | None:
        """Call the backend through the same guard as `call` where raising is the
        finding: the exception's text, or None if it returned. NotImplementedError is
        still `unsupported`, and inputs must still be left alone."""
        try:
            self.call(code, fn, *args, refusable=True)
        except Refused as exc:
            return str(exc)
        return None

    def require(self, op: str, *, gradient: bool = False) -> None:
        """Raise Unsupported unless the backend offers `op` (and its gradient) in this
        dtype: the case is recorded `unsupported`, never skipped silently."""
        caps = self.backend.capabilities
        if not caps.supports(op, self.dtype_name):
            raise Unsupported(f"capabilities list no {op} in {self.dtype_name}")
        if gradient and not caps.has_gradient(op, self.dtype_name):
            raise Unsupported(f"capabilities list no gradient of {op} in {self.dtype_name}")

    def has_gradient(self, op: str) -> bool:
        return self.backend.capabilities.has_gradient(op, self.dtype_name)

    # ---------------------------------------------------------------- comparisons
    def conforms(self, *, expected, actual, scale, bound, quantity: str, call: str,
                 what: str | None = None, dtype=None, explained=(),
                 variants: Alternatives | None = None) -> Measure:
        """assert_conforms in this case's dtype, its measure collected into the record.

        `explained`: (expected under a declared convention, convention name) pairs. When
        the spec's answer is missed but a declared convention's is met, the record is a
        deviation with the convention's reason; when neither is met, a fail.
        `variants`: how to recompute `expected` under the catalogue's formula variants;
        only a failed comparison is diagnosed (the failure carries the diagnosis)."""
        dtype = self.dtype if dtype is None else dtype
        try:
            m = assert_conforms(expected=expected, actual=actual, dtype=dtype,
                                scale=scale, bound=bound, quantity=quantity, what=what, call=call)
        except CheckFailure as exc:
            for alt, convention in explained:
                try:
                    assert_conforms(expected=alt, actual=actual, dtype=dtype,
                                    scale=scale, bound=bound, quantity=quantity, what=what,
                                    call=call)
                except CheckFailure:
                    continue
                self.explain(str(exc), convention)
                missed = exc.measure or Measure()
                self.measure.absorb(missed)
                return missed
            if variants is not None and exc.measure is not None:
                exc.diagnosis = diagnose(variants, actual=actual, dtype=dtype, scale=scale,
                                         bound=bound)
            raise
        self.measure.absorb(m)
        return m

    def say(self, message: str) -> None:
        """What the current case's record says if it passes (a fail's message is the
        failure's, a deviation's the explained miss)."""
        self.said = message

    def explain(self, message: str, convention: str) -> None:
        """Note that the spec was missed where a declared convention was met."""
        self.explained.append((message, self.reason(convention)))

    def holds(self, *, condition: bool, got: str, spec_says: str, call: str,
              explained_by: str | None = None, measured: bool = False) -> None:
        """assert_holds; `explained_by` names a declared convention under which the
        property does not hold by design (the record is then a deviation). `measured`:
        the property is about what this case measured (B9's bit differences), whose worst
        comparison is then the failure's quantity and ULPs; a failure names none
        otherwise (see case)."""
        try:
            assert_holds(condition=condition, got=got, spec_says=spec_says, call=call)
        except CheckFailure as exc:
            if measured:
                exc.measure = replace(self.measure)
            if explained_by is None:
                raise
            self.explain(str(exc), explained_by)

    def differs(self, *, first, second, scale, at_least: float, what: str, call: str,
                dtype=None, explained_by: str | None = None) -> None:
        try:
            assert_differs(first=first, second=second,
                           dtype=self.dtype if dtype is None else dtype, scale=scale,
                           at_least=at_least, what=what, call=call)
        except CheckFailure as exc:
            if explained_by is None:
                raise
            self.explain(str(exc), explained_by)

    # ---------------------------------------------------------------- cases
    @contextlib.contextmanager
    def case(self, name: str, *, op: str | None = None):
        """One record: pass unless the body raises. Collects the body's measures."""
        self.calls, self.inputs, self.notes, self.explained = [], {}, [], []
        self.held = []
        self.said = ""
        self.measure = measure = Measure()
        start = time.perf_counter()
        status, message, reason = "pass", "", ""
        diagnosis: dict = {}
        protocol = False
        try:
            yield measure
            self._inputs_untouched_since()
            message = self.said
            if self.explained:
                status, message = "deviation", self.explained[0][0]
                reason = "; ".join(dict.fromkeys(r for _, r in self.explained))
        except CheckFailure as exc:
            status, message = "fail", str(exc)
            diagnosis = getattr(exc, "diagnosis", {})
            if exc.measure is not None:
                measure.absorb(exc.measure)
                # the comparison that failed decides the record, not a larger miss that a
                # declared convention explained (deviation entries match its quantity)
                measure.max_ulp, measure.bound_ulp = exc.measure.max_ulp, exc.measure.bound_ulp
                measure.worst = exc.measure.worst
            else:
                # a yes/no failure (a property, the protocol) has no quantity or ULPs of its
                # own: a comparison that passed before it would lend it its quantity, and a
                # deviation entry scoped to that quantity would explain it away (found by a
                # review: a float16 eval() that updated the running statistics passed as
                # the documented 'batch_norm.eval' float16 arithmetic)
                measure.comparisons, measure.worst = 0, {}
                if exc.protocol:
                    protocol = True
        except Unsupported as exc:
            status, message = "unsupported", str(exc)
        except Refused as exc:
            status, message = "refused", str(exc)
        except BackendError as exc:
            status, message = "error", str(exc)
        except (KeyboardInterrupt, SystemExit) as exc:  # from the backend (see call)
            if _users_interrupt(exc):
                raise
            status, message = "error", exception_text(exc)
        except BaseException as exc:  # noqa: BLE001 - e.g. a Hypothesis error about the backend,
            # or a backend's own BaseException (which ended its process: found by a review)
            status, message = "error", exception_text(exc)
        finally:
            self.held = []
        measured = measure.comparisons > 0
        rec = Record(
            backend=self.backend_name, check=self.check_id, claim=self.claim,
            op=op or self.op, dtype=self.dtype_name, case=name, status=status,
            message=message, quantity=(PROTOCOL if protocol else
                                       str(measure.worst.get("quantity", ""))),
            max_ulp=measure.max_ulp if measured else None,
            bound_ulp=measure.bound_ulp if measured else None,
            max_abs=measure.max_abs if measured else None,
            max_rel=measure.max_rel if measured else None,
            worst=measure.worst, note="; ".join(self.notes),
            inputs="; ".join(f"{k} = {v.code(self.dtype_name)}" for k, v in self.inputs.items()
                             if v is not None)[:4000],
            repro=(self.repro(_finding(self.check_id, self.dtype_name, name, status, measure))
                   if status in ("fail", "error", "refused", "deviation") else ""),
            reason=reason, diagnosis=diagnosis, seed=self.seed,
            duration_s=round(time.perf_counter() - start, 4))
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)

    def explore(self, name: str, strategy, body, *, op: str | None = None):
        """A Hypothesis-driven case: `body(example)` runs for each drawn example (seeded
        with the run's seed, so a failure replays); the failing example is what the
        record shows. An example the backend does not offer (Unsupported: declared, or
        NotImplementedError) is one example, not the case: the others still run (one
        NotImplementedError ended the case as unsupported, and a backend wrong on every
        other example passed: a red team). The case is unsupported only when no example
        ran; otherwise the record notes how many did not."""
        tried, unsupported = [0], []
        with self.case(f"{name} (hypothesis, {self.examples} examples, seed {self.seed})",
                       op=op):

            @seed(self.seed)
            @settings(max_examples=self.examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), print_blob=False,
                      phases=PHASES_WITH_SHRINK if self.shrink else PHASES)
            @given(strategy)
            def run(example):
                self.calls, self.inputs, self.held = [], {}, []
                tried[0] += 1
                try:
                    body(example)
                except Unsupported as exc:
                    unsupported.append(str(exc))
                    return
                self._inputs_untouched_since()

            with seed_only_draws():
                run()
            if unsupported and len(unsupported) == tried[0]:
                raise Unsupported(unsupported[0])
            if unsupported:
                self.notes.append(f"{len(unsupported)} of {tried[0]} drawn examples "
                                  f"unsupported (the first: {unsupported[0]})"[:400])
