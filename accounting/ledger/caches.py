"""The ledger's costly accountant figures, each computed once and shared: one step's RDP curve, and the PLD ε
of a dataset's committed events.

The one part of the budget arithmetic that is not pure. A curve costs milliseconds per mechanism (tens under a
heavy load; accountants.sampled_gaussian_rdp) and a PLD figure up to a second, so callers asking for the same
one at once share one computation (`shared_cache`);
a server may compute curves in processes of its own (`compute_curves_in_processes`) and compose PLDs in one
with a deadline (`compose_plds_in_process`), a budget past `pld_is_practical` gets no PLD figure (its RDP bound
stands), a caller that will not
wait gets a PLD figure started on a background thread (`spent_pld_epsilon`), and the store computes a missing
curve outside its write lock (`rdp_curves_cached_only`). The pure arithmetic (accounting.ledger.admission)
asks this module for curves and starts no thread or process itself.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Hashable, Iterator

from accounting.accountants import forget_plds, forget_rdp_curves, get_accountant, has_skellam, rdp_vector
from accounting.events import Composition, event_of
from accounting.ledger.composed import COMPOSED, ComposedPld

# Renyi divergences are tallied in integer units of 2**-60 nats: exact under
# addition and subtraction, and finer than any float we would compare.
_UNIT_BITS = 60
UNITS_PER_NAT = 2**_UNIT_BITS


class CurveNotCached(Exception):
    """An RDP curve was needed where only cached ones may be used (under the store's write lock).

    Not a LedgerError: the store catches it, computes `mechanism`'s curve with no lock held and runs the change
    again.
    """

    def __init__(self, mechanism: tuple[float, ...]) -> None:
        self.mechanism = mechanism
        super().__init__(f"the RDP curve of mechanism {mechanism} is not cached")


_CURVE_MODE = threading.local()


@contextlib.contextmanager
def rdp_curves_cached_only() -> Iterator[None]:
    """Within this block, on this thread, a mechanism whose RDP curve is not cached raises CurveNotCached.

    The store wraps the body of its write transactions in it, so that no
    curve computation ever holds the lock that every other
    tenant's commit waits for.
    """
    previous = getattr(_CURVE_MODE, "cached_only", False)
    _CURVE_MODE.cached_only = True
    try:
        yield
    finally:
        _CURVE_MODE.cached_only = previous


def is_curve_cached(mechanism: tuple[float, ...]) -> bool:
    """True when the RDP curve of `mechanism` (an event's `mechanism`: sampling rate, noise multiplier,
    sensitivity factor[, rounding ratio]) is cached."""
    return _step_curve.peek(*mechanism) is not None


def compute_curve(mechanism: tuple[float, ...]) -> None:
    """Compute and cache one mechanism's RDP curve (outside any lock; concurrent askers share one computation)."""
    _step_curve(*mechanism)


def step_units(*mechanism: float) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """`_computed_step_units` of `mechanism` (an event's `mechanism` fields), cached; see `rdp_curves_cached_only`."""
    if getattr(_CURVE_MODE, "cached_only", False):
        curve = _step_curve.peek(*mechanism)
        if curve is None:
            raise CurveNotCached(mechanism)
        return curve
    return _step_curve(*mechanism)


def _computed_step_units(*mechanism: float) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per-order RDP of one step of `mechanism` in units, rounded up, and which orders are unbounded."""
    divergences = rdp_vector(event_of(mechanism, 1))
    units = []
    unbounded = []
    for divergence in divergences:
        scaled = float(divergence) * UNITS_PER_NAT  # exact: a power-of-two scaling
        if math.isfinite(scaled):
            units.append(max(0, math.ceil(scaled)))
            unbounded.append(False)
        else:
            # dp-accounting reports inf (or gives up) at orders it cannot bound.
            units.append(0)
            unbounded.append(True)
    return tuple(units), tuple(unbounded)


def shared_cache(maxsize: int) -> Callable[[Callable], SharedCache]:
    """A least-recently-used cache of `maxsize` results, like functools.lru_cache, computed once per arguments.

    Callers that ask for arguments already being computed wait for that
    computation rather than start their own; if it raises, each of them
    gets the error and the next call tries again. The cached function's
    `start(*args)` asks without waiting: see `SharedCache.start`.
    """
    return lambda function: SharedCache(function, maxsize)


class SharedCache:
    """`function` with its results for the `maxsize` arguments used last kept, each computed once (`shared_cache`)."""

    def __init__(self, function: Callable, maxsize: int) -> None:
        functools.update_wrapper(self, function)
        self._function = function
        self._maxsize = maxsize
        self._results: OrderedDict = OrderedDict()
        self._computing: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._background: Future | None = None

    def _claim(self, args: tuple, background: bool = False) -> tuple[Future | None, bool]:
        """The result's future, and whether the caller must compute it; for a background computation, None when
        the last one is still running."""
        with self._lock:
            if args in self._results:
                self._results.move_to_end(args)
                done: Future = Future()
                done.set_result(self._results[args])
                return done, False
            pending = self._computing.get(args)
            if pending is not None:
                return pending, False
            if background and self._background is not None and not self._background.done():
                return None, False
            pending = self._computing[args] = Future()
            if background:
                self._background = pending
            return pending, True

    def _compute(self, args: tuple, pending: Future) -> None:
        try:
            value = self._function(*args)
        except BaseException as error:
            with self._lock:
                del self._computing[args]
            pending.set_exception(error)
            return
        with self._lock:
            del self._computing[args]
            self._results[args] = value
            if len(self._results) > self._maxsize:
                self._results.popitem(last=False)
        pending.set_result(value)

    def __call__(self, *args: object) -> object:
        pending, owner = self._claim(args)
        if owner:
            self._compute(args, pending)
        return pending.result()

    def start(self, *args: object) -> Future | None:
        """The result's future without waiting: done when cached, pending while some caller computes it.

        Otherwise the computation starts on a background thread and its
        future is returned, unless an earlier background computation is
        still running: then None, and nothing starts. One background
        thread at most, so callers that never wait cannot pile up work.
        """
        pending, owner = self._claim(args, background=True)
        if owner:
            threading.Thread(target=self._compute, args=(args, pending), name="dpfleet-cache", daemon=True).start()
        return pending

    def clear(self) -> None:
        """Forget every cached result (computations under way finish for their callers)."""
        with self._lock:
            self._results.clear()

    def peek(self, *args: object) -> object | None:
        """The cached result, or None when it is not cached (nothing is computed)."""
        with self._lock:
            if args not in self._results:
                return None
            self._results.move_to_end(args)
            return self._results[args]


# The processes RDP curves are computed in, once a server asked for them (compute_curves_in_processes).
_CURVE_PROCESSES: list[ProcessPoolExecutor] = []
_CURVE_PROCESSES_LOCK = threading.Lock()


def compute_curves_in_processes(workers: int) -> None:
    """From now on compute RDP curves in `workers` processes of their own (once per process; later calls keep
    the first pool).

    A curve is milliseconds of Python and numpy that holds the GIL; computed in a request
    thread it slows every other request of the server, however short. In a
    process of its own it costs the server only the wait for its result.
    """
    with _CURVE_PROCESSES_LOCK:
        if not _CURVE_PROCESSES:
            # Spawned, not forked: the server's gRPC threads do not survive a fork.
            processes = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_end_with_parent, initargs=(os.getpid(),),
            )
            # Started and importing this module now (seconds on a busy machine), not on a request's deadline.
            for started in [processes.submit(_curve_process_ready) for _ in range(workers)]:
                started.result()
            _CURVE_PROCESSES.append(processes)


def _end_with_parent(parent_pid: int) -> None:
    """In a curve process: exit once the server that started it is gone, even by kill -9."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="dpfleet-curve-parent", daemon=True).start()


def _curve_process_ready() -> bool:
    """Nothing: unpickling it makes a curve process import this module."""
    return True


def _curve_anywhere(*mechanism: float) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """`_computed_step_units` in the curve processes when there are some, else in this thread."""
    if _CURVE_PROCESSES:
        try:
            return _CURVE_PROCESSES[0].submit(_computed_step_units, *mechanism).result()
        except BrokenProcessPool:
            pass  # a worker died (killed, out of memory): the answer is the same computed here
    return _computed_step_units(*mechanism)


# Milliseconds per mechanism; threads asking for the same one at once share the computation.
_step_curve = shared_cache(maxsize=4096)(_curve_anywhere)


# A budget's PLD is composed while it holds at most this many steps and its RDP ε is at most this: past either,
# PLD's grid and its composition grow without a useful bound, and the RDP bound is the figure reported.
PLD_MAX_STEPS = 10**6
PLD_MAX_RDP_EPSILON = 100.0
# How long one budget's PLD composition may take, counted from its request, before the RDP bound is reported.
PLD_DEADLINE_SECONDS = 30.0


class CompositionTimedOut(Exception):
    """A PLD composition ran past its deadline and its process was killed; the RDP bound stands in its place."""


class CompositionProcess:
    """One process that extends composed PLDs (`extended`), killed and started again when one runs past
    `deadline_seconds`, so that no composition holds the server's GIL or runs without end."""

    def __init__(self, deadline_seconds: float) -> None:
        self.deadline_seconds = deadline_seconds
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection = None

    def _started(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        context = multiprocessing.get_context("spawn")  # the server's gRPC threads do not survive a fork
        self._connection, theirs = context.Pipe()
        self._process = context.Process(
            target=_compose_forever, args=(theirs, os.getpid()), name="dpfleet-composition", daemon=True
        )
        self._process.start()
        theirs.close()

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = None

    def extended(self, state: ComposedPld, committed: Composition) -> ComposedPld:
        """`state.extended_to(committed)` in the process; raises CompositionTimedOut past the deadline, the wait
        for another composition included."""
        deadline = time.monotonic() + self.deadline_seconds
        if not self._lock.acquire(timeout=self.deadline_seconds):
            raise CompositionTimedOut(f"another composition held the process for {self.deadline_seconds:g} s")
        try:
            self._started()
            self._connection.send((state, committed))
            if not self._connection.poll(max(0.0, deadline - time.monotonic())):
                self._kill()
                raise CompositionTimedOut(f"composing {committed.steps} steps took over {self.deadline_seconds:g} s")
            try:
                failed, result = self._connection.recv()
            except EOFError:  # the process died (out of memory, killed)
                self._kill()
                raise CompositionTimedOut(f"the composition process died composing {committed.steps} steps") from None
        finally:
            self._lock.release()
        if failed:
            raise result
        return result

    def close(self) -> None:
        """Stop the process (a composition under way is lost)."""
        with self._lock:
            self._kill()


def _compose_forever(connection: object, parent_pid: int) -> None:
    """In the composition process: extend each state sent until the pipe or the server is gone."""
    _end_with_parent(parent_pid)
    while True:
        try:
            state, committed = connection.recv()
        except EOFError:
            return
        try:
            connection.send((False, state.extended_to(committed)))
        except Exception as error:
            connection.send((True, error))


# The process PLDs are composed in, once a server asked for one (compose_plds_in_process).
_COMPOSITION_PROCESS: list[CompositionProcess] = []


def compose_plds_in_process(deadline_seconds: float = PLD_DEADLINE_SECONDS) -> CompositionProcess:
    """From now on compose budgets' PLDs in a process of their own, each within `deadline_seconds` (once per
    process; a later call sets the deadline of the first)."""
    with _CURVE_PROCESSES_LOCK:
        if not _COMPOSITION_PROCESS:
            _COMPOSITION_PROCESS.append(CompositionProcess(deadline_seconds))
        process = _COMPOSITION_PROCESS[0]
        process.deadline_seconds = deadline_seconds
        return process


def pld_is_practical(committed_events: Composition, rdp_epsilon: float) -> bool:
    """Whether a budget's PLD is composed at all: no Skellam noise, at most PLD_MAX_STEPS steps, and an RDP ε
    (`rdp_epsilon`, the committed tally's, at the budget's δ) of at most PLD_MAX_RDP_EPSILON."""
    if has_skellam(committed_events) or committed_events.steps > PLD_MAX_STEPS:
        return False
    return rdp_epsilon <= PLD_MAX_RDP_EPSILON


@shared_cache(maxsize=1024)
def _spent_pld_epsilon(
    committed_events: Composition, delta: float, rdp_epsilon: float, lineage: Hashable | None
) -> float | None:
    # A budget's composed distribution is extended by the steps committed since it was last asked (composed.py);
    # statuses asking at once after a commit wait for one computation.
    if lineage is None:
        return get_accountant("pld").epsilon(committed_events, delta)
    if not pld_is_practical(committed_events, rdp_epsilon):
        return None
    if not _COMPOSITION_PROCESS:
        return COMPOSED.extended(lineage, committed_events).epsilon(delta)
    try:
        return COMPOSED.extended(lineage, committed_events, _COMPOSITION_PROCESS[0].extended).epsilon(delta)
    except CompositionTimedOut:
        return None


def spent_pld_epsilon(
    committed_events: Composition, delta: float, rdp_epsilon: float, wait: bool = True,
    lineage: Hashable | None = None,
) -> float | None:
    """The PLD ε at `delta` of a dataset's committed events, as if every job had been fixed in advance; None
    where it is not composed (see `pld_is_practical`, given their RDP ε `rdp_epsilon` at `delta`, and a
    composition past its deadline): the rigorous RDP bound is the figure then, labelled so.

    `lineage` names the budget (any hashable): its composed distribution is
    kept and extended by the steps committed since (accounting.ledger.composed);
    None composes the events from the start. Cached, and computed once for
    callers asking at once. With `wait` False, None until the figure is
    ready: it is computed on a background thread (one at a time) and a later
    call finds it.
    """
    if not committed_events.events:
        return 0.0
    if wait:
        return _spent_pld_epsilon(committed_events, delta, rdp_epsilon, lineage)
    pending = _spent_pld_epsilon.start(committed_events, delta, rdp_epsilon, lineage)
    if pending is None or not pending.done() or pending.exception() is not None:
        return None
    return pending.result()


def forget_pld_figures() -> None:
    """Forget every PLD figure and distribution held in memory (one-step, composed), as a restart does."""
    _spent_pld_epsilon.clear()
    COMPOSED.clear()
    forget_plds()


def forget_curves() -> None:
    """Forget every RDP curve computed in this process (as a restart does)."""
    _step_curve.clear()
    forget_rdp_curves()
