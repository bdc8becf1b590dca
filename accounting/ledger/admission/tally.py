"""Exact RDP tallies: a budget's Renyi divergences at every order of RDP_ORDERS, summed in integer units.

RDP composes by addition, so a dataset's tally of everything committed or
reserved-but-unrun is a sum; it is kept in exact integers so that adding a
plan and later subtracting its unrun part leaves no floating drift, and
nothing needs recomputing when the store is reopened. Every per-step Renyi
divergence is rounded up to a multiple of 2**-60 nats and a sum is converted
back to a float rounded up, so rounding can only make the ledger refuse
something at the exact edge, never admit something over it.
"""

from __future__ import annotations

import hashlib
import json
import itertools
import math
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from accounting.accountants import RDP_ORDERS, epsilon_from_rdp
from accounting.events import Composition, EventsLike, as_composition
from accounting.ledger.caches import UNITS_PER_NAT, step_units


@dataclass(frozen=True)
class RdpTally:
    """Renyi divergences at every order of RDP_ORDERS, summed exactly.

    `units[i]` is the divergence at order i in units of 2**-60 nats (each
    step rounded up); `unbounded_steps[i]` counts the steps whose divergence
    at order i is unbounded, which makes the total infinite there. The tally
    of a composition is linear in its steps, so the tally of the first k
    steps plus the tally of the rest equals the tally of the whole, exactly.
    """

    units: tuple[int, ...]
    unbounded_steps: tuple[int, ...]

    @classmethod
    def zero(cls) -> "RdpTally":
        """The tally of no events."""
        return cls((0,) * len(RDP_ORDERS), (0,) * len(RDP_ORDERS))

    @classmethod
    def of(cls, events: EventsLike) -> "RdpTally":
        """The tally of a composition (one dp-accounting call per distinct mechanism, cached)."""
        units = (0,) * len(RDP_ORDERS)
        unbounded = (0,) * len(RDP_ORDERS)
        for event in as_composition(events).events:
            units_of_step, unbounded_in_step = step_units(*event.mechanism_key)
            steps = itertools.repeat(event.steps)
            units = tuple(map(operator.add, units, map(operator.mul, units_of_step, steps)))
            unbounded = tuple(map(operator.add, unbounded, map(operator.mul, unbounded_in_step, steps)))
        return cls(units, unbounded)

    def __add__(self, other: "RdpTally") -> "RdpTally":
        return RdpTally(
            tuple(map(operator.add, self.units, other.units)),
            tuple(map(operator.add, self.unbounded_steps, other.unbounded_steps)),
        )

    def __sub__(self, other: "RdpTally") -> "RdpTally":
        units = tuple(a - b for a, b in zip(self.units, other.units))
        unbounded = tuple(a - b for a, b in zip(self.unbounded_steps, other.unbounded_steps))
        if min(units) < 0 or min(unbounded) < 0:
            raise ValueError("cannot take from an RDP tally more than was added to it; the ledger file is inconsistent")
        return RdpTally(units, unbounded)

    def divergence(self, order_index: int) -> float:
        """The Renyi divergence at the `order_index`-th order of RDP_ORDERS in nats, rounded up to the next float."""
        if self.unbounded_steps[order_index]:
            return math.inf
        units = self.units[order_index]
        return math.nextafter(units / UNITS_PER_NAT, math.inf) if units else 0.0

    def divergences(self) -> np.ndarray:
        """The per-order Renyi divergences in nats, each rounded up to the next float."""
        return np.array(
            [
                math.inf if infinite else (math.nextafter(units / UNITS_PER_NAT, math.inf) if units else 0.0)
                for units, infinite in zip(self.units, self.unbounded_steps)
            ],
            dtype=np.float64,
        )

    def epsilon(self, delta: float) -> float:
        """RDP epsilon at `delta` (best order of RDP_ORDERS)."""
        return epsilon_from_rdp(self.divergences(), delta, warn=False)

    def to_json(self) -> str:
        """Exact JSON (integers of any size)."""
        return json.dumps({"units": list(self.units), "unbounded_steps": list(self.unbounded_steps)})

    @classmethod
    def from_json(cls, text: str) -> "RdpTally":
        """Inverse of `to_json`; refuses a tally over a different order grid."""
        data = json.loads(text)
        if len(data["units"]) != len(RDP_ORDERS) or len(data["unbounded_steps"]) != len(RDP_ORDERS):
            raise ValueError(
                f"stored RDP tally has {len(data['units'])} orders but this dpfleet uses {len(RDP_ORDERS)}; "
                "open the ledger with the dpfleet version that wrote it"
            )
        return cls(tuple(data["units"]), tuple(data["unbounded_steps"]))


# A commit adds its block's tally to the one of the events before it (`remember_stored_tally`), so a budget's
# tally of committed events is computed afresh only once per process (or after another server's commit).
_STORED_TALLIES: OrderedDict[bytes, RdpTally] = OrderedDict()
_STORED_TALLIES_SIZE = 1024
_STORED_TALLIES_LOCK = threading.Lock()


def _stored_key(committed_json: str) -> bytes:
    return hashlib.sha256(committed_json.encode()).digest()


def stored_tally(committed_json: str) -> RdpTally:
    """The tally of committed events as a budget stores them (JSON): remembered, else computed."""
    tally = remembered_tally(committed_json)
    if tally is None:
        tally = RdpTally.of(Composition.from_json(committed_json))
        remember_stored_tally(committed_json, tally)
    return tally


def remembered_tally(committed_json: str) -> RdpTally | None:
    """The tally remembered for the committed events stored as `committed_json`, or None (nothing is computed)."""
    key = _stored_key(committed_json)
    with _STORED_TALLIES_LOCK:
        tally = _STORED_TALLIES.get(key)
        if tally is not None:
            _STORED_TALLIES.move_to_end(key)
        return tally


def remember_stored_tally(committed_json: str, tally: RdpTally) -> None:
    """Remember `tally` as that of the committed events stored as `committed_json` (its tally, exactly)."""
    with _STORED_TALLIES_LOCK:
        _STORED_TALLIES[_stored_key(committed_json)] = tally
        _STORED_TALLIES.move_to_end(_stored_key(committed_json))
        while len(_STORED_TALLIES) > _STORED_TALLIES_SIZE:
            _STORED_TALLIES.popitem(last=False)


def forget_stored_tallies() -> None:
    """Forget every remembered tally (as a restart does)."""
    with _STORED_TALLIES_LOCK:
        _STORED_TALLIES.clear()
