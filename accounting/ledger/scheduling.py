"""Which waiting jobs the ledger admits next: the scheduling policies, as pure functions.

A job that does not fit may wait in a dataset's queue. Whenever budget is
released, unlocked or a job arrives, the ledger asks `schedule` which queued
jobs to admit now. A policy only chooses the *order* in which queued jobs are
considered and *how much* of each block's budget is unlocked; a job is
admitted only when it fits the unlocked budget by the filter's own rule (at
one order at least, held + demand within the unlocked capacity), and the
store then admits it through the RDP filter itself (admission.check_admission).
The unlocked fraction is at most 1, so no policy admits what the filter
would refuse.

Everything is in the filter's terms, per block and per filter order k (a
dataset without blocks is one block): `capacity[k]` is the Renyi divergence
at which the filter's epsilon reaches the budget (AdmissionRule.capacities),
`held[k]` what committed and reserved steps hold, a job's `demand[k]` the
divergence of its plan.

Policies (`POLICIES`):
- "fcfs": in order of arrival; each job is admitted as soon as it fits the
  whole budget. A large job may wait behind a stream of small ones.
- "dpf": PrivateKube's Dominant Private Block Fairness (Luo et al., OSDI
  2021): a block unlocks 1/N of its budget per job that arrives asking for
  it (DPF-N), or in proportion to its age over a lifetime T (DPF-T); waiting
  jobs are considered smallest dominant share first, the dominant share
  being the largest, over the blocks a job asks for, of its demand over the
  block's capacity (at the order where that is least, as the filter needs
  only one order).
- "dpack": DPack's greedy packing (Tholoniat et al., EuroSys 2025): as dpf
  unlocks, but each block first gets its best order, the one at which the
  most waiting jobs fit in what is unlocked and free, and the most
  efficient job goes first, its efficiency being 1 over the sum, over its
  blocks, of its demand over what is free there at the block's best order.
  Jobs whose RDP curves suit the order a block is filling at pack it
  tighter.
Higher `priority` comes first under every policy; the policy orders within
a priority.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

FCFS = "fcfs"
DPF = "dpf"
DPACK = "dpack"
POLICIES = (FCFS, DPF, DPACK)
PRIORITY_RANGE = (-1000, 1000)


@dataclass(frozen=True)
class SchedulingPolicy:
    """How a dataset's queue is served: `name` (one of POLICIES) and how its blocks unlock.

    `unlock_jobs` = N unlocks 1/N of a block per arriving job (DPF-N);
    `unlock_seconds` = T unlocks a block linearly over T seconds from its
    creation (DPF-T). With both, whichever has unlocked more counts; with
    neither, or under fcfs, the whole budget is unlocked.
    """

    name: str = FCFS
    unlock_jobs: int | None = None
    unlock_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)} (got {self.name!r})")
        if self.unlock_jobs is not None and not (isinstance(self.unlock_jobs, int) and self.unlock_jobs >= 1):
            raise ValueError(f"unlock_jobs must be an integer >= 1 (got {self.unlock_jobs!r}); leave it out to "
                             "unlock by time or not at all")
        if self.unlock_seconds is not None and not (
            isinstance(self.unlock_seconds, (int, float)) and math.isfinite(self.unlock_seconds)
            and self.unlock_seconds > 0
        ):
            raise ValueError(f"unlock_seconds must be a finite number of seconds > 0 (got {self.unlock_seconds!r})")

    def unlocked_fraction(self, arrived_jobs: int, age_seconds: float) -> float:
        """The fraction of a block's budget unlocked after `arrived_jobs` arrivals and `age_seconds` of life."""
        if self.name == FCFS or (self.unlock_jobs is None and self.unlock_seconds is None):
            return 1.0
        by_jobs = arrived_jobs / self.unlock_jobs if self.unlock_jobs is not None else 0.0
        by_time = max(0.0, age_seconds) / self.unlock_seconds if self.unlock_seconds is not None else 0.0
        return min(1.0, max(by_jobs, by_time))

    def to_dict(self) -> dict:
        """JSON-ready dict, as stored with a dataset."""
        return {"policy": self.name, "unlock_jobs": self.unlock_jobs, "unlock_seconds": self.unlock_seconds}

    @classmethod
    def from_dict(cls, data: dict) -> "SchedulingPolicy":
        """Inverse of `to_dict`."""
        return cls(data["policy"], data.get("unlock_jobs"), data.get("unlock_seconds"))


@dataclass(frozen=True)
class BlockBudget:
    """One block as the filter sees it: per-order `capacity` and `held` divergence (nats), and what is unlocked."""

    block: str
    capacity: tuple[float, ...]
    held: tuple[float, ...]
    unlocked_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.unlocked_fraction <= 1.0:
            raise ValueError(f"unlocked_fraction must be in [0, 1] (got {self.unlocked_fraction!r})")
        if len(self.capacity) != len(self.held):
            raise ValueError(f"block {self.block!r} has {len(self.capacity)} capacities and {len(self.held)} held")


@dataclass(frozen=True)
class QueuedDemand:
    """A waiting job: its per-order divergence on each block it asks for, when it arrived, its priority."""

    job: str
    demand: Mapping[str, tuple[float, ...]]
    arrival: float
    priority: int = 0


@dataclass(frozen=True)
class Decision:
    """What `schedule` decided for one job: admitted now, or its place in the queue (1 = next) and why it waits."""

    job: str
    admitted: bool
    position: int
    reason: str


def dominant_share(demand: Mapping[str, tuple[float, ...]], blocks: Mapping[str, BlockBudget]) -> float:
    """The largest, over the job's blocks, of its demand over the block's capacity at the order where it is least."""
    return max(
        min(need / capacity if capacity > 0 else math.inf for need, capacity in zip(needs, blocks[name].capacity))
        for name, needs in demand.items()
    )


def _free(block: BlockBudget, held: tuple[float, ...], unlock: bool) -> tuple[float, ...]:
    """Per order, what is unlocked and not held."""
    fraction = block.unlocked_fraction if unlock else 1.0
    return tuple(fraction * capacity - taken for capacity, taken in zip(block.capacity, held))


def _fits(needs: tuple[float, ...], free: tuple[float, ...]) -> bool:
    # The filter's rule: one order with room is enough.
    return any(need <= room for need, room in zip(needs, free))


def _packed(needs: list[float], room: float) -> int:
    """How many of `needs` fit in `room`, smallest first."""
    count, taken = 0, 0.0
    for need in sorted(needs):
        if taken + need > room:
            break
        count, taken = count + 1, taken + need
    return count


def best_orders(queue: list[QueuedDemand], free: Mapping[str, tuple[float, ...]]) -> dict[str, int]:
    """Per block, the filter order at which the most waiting jobs fit in what is free (DPack's best alpha)."""
    best = {}
    for name, room in free.items():
        asking = [job.demand[name] for job in queue if name in job.demand]
        best[name] = max(range(len(room)), key=lambda k: (_packed([needs[k] for needs in asking], room[k]), -k))
    return best


def _efficiency(
    demand: Mapping[str, tuple[float, ...]], free: Mapping[str, tuple[float, ...]], orders: Mapping[str, int]
) -> float:
    total = 0.0
    for name, needs in demand.items():
        room = free[name][orders[name]]
        total += needs[orders[name]] / room if room > 0 else math.inf
    return 1.0 / total if total > 0 else math.inf


def _shortfall(job: QueuedDemand, blocks: Mapping[str, BlockBudget], free: Mapping[str, tuple[float, ...]]) -> str:
    """Why a job that does not fit waits: its first block without room, at the order closest to fitting."""
    name, needs = next((name, needs) for name, needs in job.demand.items() if not _fits(needs, free[name]))
    capacity = blocks[name].capacity
    order = min(range(len(needs)), key=lambda k: (needs[k] - free[name][k]) / capacity[k] if capacity[k] > 0
                else math.inf)
    need, room = needs[order] / capacity[order], max(0.0, free[name][order] / capacity[order])
    where = "" if len(blocks) == 1 else f"block {name!r}: "
    return f"{where}needs {need:.1%} of the budget; {room:.1%} is unlocked and not held"


def schedule(
    policy: SchedulingPolicy, blocks: Mapping[str, BlockBudget], queue: list[QueuedDemand]
) -> list[Decision]:
    """Which of the `queue`d jobs to admit now, in admission order, then the waiting ones in queue order.

    Jobs are considered higher priority first, then in the policy's order;
    each one that fits what is unlocked and not yet held (counting the jobs
    admitted before it in this call) is admitted. Every job must name only
    blocks in `blocks`.
    """
    for job in queue:
        unknown = set(job.demand) - set(blocks)
        if unknown or not job.demand:
            raise ValueError(f"job {job.job!r} asks for blocks {sorted(unknown) or 'none'} the dataset does not have")
    unlock = policy.name != FCFS
    held = {name: block.held for name, block in blocks.items()}
    free = {name: _free(block, held[name], unlock) for name, block in blocks.items()}
    if policy.name == FCFS:
        def key(job: QueuedDemand) -> tuple:
            return (-job.priority, job.arrival, job.job)
    elif policy.name == DPF:
        def key(job: QueuedDemand) -> tuple:
            return (-job.priority, dominant_share(job.demand, blocks), job.arrival, job.job)
    else:
        orders = best_orders(queue, free)

        def key(job: QueuedDemand) -> tuple:
            return (-job.priority, -_efficiency(job.demand, free, orders), job.arrival, job.job)
    admitted, waiting = [], []
    for job in sorted(queue, key=key):
        if all(_fits(needs, free[name]) for name, needs in job.demand.items()):
            for name, needs in job.demand.items():
                held[name] = tuple(taken + need for taken, need in zip(held[name], needs))
                free[name] = _free(blocks[name], held[name], unlock)
            admitted.append(Decision(job.job, True, 0, "admitted"))
        else:
            waiting.append(job)
    return admitted + [
        Decision(job.job, False, position, _shortfall(job, blocks, free))
        for position, job in enumerate(waiting, start=1)
    ]
