"""Each budget's composed PLD, kept as state that new commits extend, so a PLD figure costs one composition of
the steps committed since the last one, not a replay of the budget's whole history.

A composed distribution is a pure function of the events it composes: a
state says which events it holds, and a budget's committed events, which
only grow, are reached from it by composing their difference (one self-
composition per mechanism that gained steps). Pessimistic distributions
compose pessimistically, so the extended distribution is a rigorous upper
bound like the replayed one, and equals it up to tail truncation (a test
holds them within 1%). A state that is not contained in the events asked
for is not used: they are composed from the start.

States live in memory per budget (`lineage`: any hashable name of one, a
hint to find the state, never trusted for correctness) and a ledger keeps
them in its database (`ComposedPld.to_bytes`) under the history key, so
that a restart composes only what was committed since the last one it kept.
The PLD figure stays a report: admission is the RDP filter's (DP rule 9).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np

from accounting.accountants import composed_pld, privacy_loss_distribution
from accounting.events import Composition, event_of

# Budgets whose composed distribution is kept in memory (each up to a few MB); one a status has not asked for
# lately is read back from the database, or composed again, when next asked.
COMPOSED_STATES = 64

_Mechanism = tuple[float, ...]


def _steps_by_mechanism(events: Composition) -> dict[_Mechanism, int]:
    steps: dict[_Mechanism, int] = {}
    for event in events.events:
        steps[event.mechanism_key] = steps.get(event.mechanism_key, 0) + event.steps
    return steps


def new_steps(held: Composition, committed: Composition) -> Composition | None:
    """The steps of `committed` that `held` lacks, one record per mechanism; None when `held` has steps that
    `committed` does not (it is not an earlier state of the same budget)."""
    held_steps, committed_steps = _steps_by_mechanism(held), _steps_by_mechanism(committed)
    if any(steps > committed_steps.get(mechanism, 0) for mechanism, steps in held_steps.items()):
        return None
    return Composition(tuple(
        event_of(mechanism, steps - held_steps.get(mechanism, 0))
        for mechanism, steps in sorted(committed_steps.items())
        if steps > held_steps.get(mechanism, 0)
    ))


@dataclass(frozen=True)
class ComposedPld:
    """The pessimistic PLD (`distribution`) of `events` (a budget's committed steps, one record per mechanism).

    `rdp_tally` is the exact RDP tally of the same events (admission.RdpTally's
    JSON), kept and authenticated with the distribution so that a restart reads
    it back instead of computing each mechanism's RDP curve again; empty where
    the keeper did not give it.
    """

    events: Composition
    distribution: privacy_loss_distribution.PrivacyLossDistribution
    rdp_tally: str = ""

    @classmethod
    def empty(cls) -> "ComposedPld":
        """The distribution of no events."""
        return cls(Composition(), composed_pld(Composition()))

    def extended_to(self, committed: Composition) -> "ComposedPld":
        """The distribution of `committed`: this one with the new steps composed onto it (or from the start
        when this one holds steps `committed` lacks)."""
        added = new_steps(self.events, committed)
        if added is None:
            return ComposedPld.empty().extended_to(committed)
        if not added.events:
            return self
        return ComposedPld(committed, composed_pld(added, onto=self.distribution))

    def epsilon(self, delta: float) -> float:
        """The PLD ε at `delta` (check `rdp_fallback_epsilon` of the events first: where PLD's grid is
        impractical, do not compose them at all)."""
        if not self.events.events:
            return 0.0
        return float(self.distribution.get_epsilon_for_delta(delta))

    def to_bytes(self, key: bytes) -> bytes:
        """The state as stored: an HMAC under `key`, then its events, both loss distributions and its RDP tally."""
        body = _pack(self)
        return hmac.new(key, body, hashlib.sha256).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes, key: bytes) -> "ComposedPld | None":
        """Inverse of `to_bytes`; None when the HMAC under `key` does not match (edited, or another key)."""
        tag, body = data[:32], data[32:]
        if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
            return None
        return _unpack(body)


_PMF_HEADER = struct.Struct("<dqdqq")  # discretisation, lower loss, infinity mass, pessimistic, length


def _pack(state: ComposedPld) -> bytes:
    events = state.events.to_json().encode()
    distribution = state.distribution
    pmfs = [distribution._pmf_remove] if distribution._symmetric else [distribution._pmf_remove, distribution._pmf_add]
    parts = [struct.pack("<qq", len(events), len(pmfs)), events]
    for pmf in pmfs:
        dense = pmf.to_dense_pmf()
        probabilities = np.ascontiguousarray(dense._probs, dtype="<f8")
        parts.append(_PMF_HEADER.pack(
            dense._discretization, dense._lower_loss, dense._infinity_mass, int(dense._pessimistic_estimate),
            probabilities.size,
        ))
        parts.append(probabilities.tobytes())
    tally = state.rdp_tally.encode()
    parts += [struct.pack("<q", len(tally)), tally]
    return b"".join(parts)


def _unpack(body: bytes) -> ComposedPld:
    from dp_accounting.pld import pld_pmf

    events_length, count = struct.unpack_from("<qq", body)
    offset = 16
    events = Composition.from_json(body[offset:offset + events_length].decode())
    offset += events_length
    pmfs = []
    for _ in range(count):
        discretisation, lower_loss, infinity_mass, pessimistic, length = _PMF_HEADER.unpack_from(body, offset)
        offset += _PMF_HEADER.size
        probabilities = np.frombuffer(body, dtype="<f8", count=length, offset=offset).astype(np.float64)
        offset += 8 * length
        pmfs.append(pld_pmf.DensePLDPmf(discretisation, lower_loss, probabilities, infinity_mass, bool(pessimistic)))
    tally = ""
    if offset < len(body):  # states kept before the tally was kept with them end here
        (tally_length,) = struct.unpack_from("<q", body, offset)
        tally = body[offset + 8:offset + 8 + tally_length].decode()
    return ComposedPld(events, privacy_loss_distribution.PrivacyLossDistribution(*pmfs), tally)


class ComposedStates:
    """The last composed state of up to `size` budgets, by lineage; safe to share between threads."""

    def __init__(self, size: int = COMPOSED_STATES) -> None:
        self._size = size
        self._states: OrderedDict[Hashable, ComposedPld] = OrderedDict()
        self._lock = threading.Lock()
        self._extending: dict[Hashable, threading.Lock] = {}  # one per budget asked about, as states are

    def get(self, lineage: Hashable) -> ComposedPld | None:
        """The state kept for `lineage`, or None."""
        with self._lock:
            state = self._states.get(lineage)
            if state is not None:
                self._states.move_to_end(lineage)
            return state

    def keep(self, lineage: Hashable, state: ComposedPld) -> None:
        """Keep `state` as `lineage`'s, unless the one kept holds more steps (a later one)."""
        with self._lock:
            kept = self._states.get(lineage)
            if kept is not None and new_steps(state.events, kept.events) not in (None, Composition()):
                return
            self._states[lineage] = state
            self._states.move_to_end(lineage)
            while len(self._states) > self._size:
                self._states.popitem(last=False)

    def states(self) -> list[ComposedPld]:
        """Every state kept, least recently used first."""
        with self._lock:
            return list(self._states.values())

    def clear(self) -> None:
        """Forget every state (as a restart does)."""
        with self._lock:
            self._states.clear()

    def extended(
        self,
        lineage: Hashable,
        committed: Composition,
        extend: Callable[[ComposedPld, Composition], ComposedPld] = ComposedPld.extended_to,
    ) -> ComposedPld:
        """`lineage`'s state extended to `committed` by `extend` (kept for next time).

        One extension of a lineage at a time: a status asking while the
        background composition (store.composed) extends it waits, then
        composes only what was committed since, not the same steps again.
        `extend` may compose elsewhere (caches: in a process with a deadline).
        """
        with self._lock:
            extending = self._extending.setdefault(lineage, threading.Lock())
        with extending:
            state = extend(self.get(lineage) or ComposedPld.empty(), committed)
            self.keep(lineage, state)
        return state


# The states of every budget this process reports on.
COMPOSED = ComposedStates()

