"""Fan a step out to the gradient workers and gather their clipped sums, one buffer per node.

Workers on the driver's own node are called directly, and their sums are
read in place from the node's shared object store (no copy): the driver adds
them up within its one pass that also adds the noise. On every other node, a
reducer actor (``workers.reducer``) calls that node's workers and adds their
sums there, so the driver receives one buffer per node whatever the number of
workers on it, and sends one call per node. A node with one worker needs no
reducer: its worker's sum is already that node's one buffer.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import release
from workers.reducer import NodeReducerActor

Name = Hashable  # the driver's name for a worker: its index, or a shard's (shard, worker) slot


def group_by_node(nodes: Mapping[Name, str], names) -> dict[str, list[Name]]:
    """`names` grouped by the node each runs on, in the order given."""
    groups: dict[str, list[Name]] = {}
    for name in names:
        groups.setdefault(nodes[name], []).append(name)
    return groups


def split_counts(parts: list[np.ndarray], size: int, counts: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Each part's first `size` values (views), and the float64 sum of the `counts` raw counts after them."""
    tail = np.zeros(counts)
    for part in parts:
        tail += part[size:]
    return [part[:size] for part in parts], tail


@dataclass
class Gathered:
    """One step's partial sums as the driver holds them: one per remote node, one per worker on its own node.

    `failed` names the workers whose part is missing (a lost worker, or a
    node's reducer that failed); `values_in` and `bytes_in` count the values
    and bytes that arrived (under secure aggregation, the masked parts that
    `parts`' one unmasked total replaces).
    """

    parts: list[np.ndarray] = field(default_factory=list)
    failed: list[Name] = field(default_factory=list)
    slowest_worker_seconds: float = 0.0
    wait_seconds: float = 0.0
    values_in: int = 0
    bytes_in: int = 0

    def add(self, other: Gathered) -> None:
        """Take in `other`'s parts and times (a recomputation within the same step); its failures are not kept."""
        self.parts += other.parts
        self.slowest_worker_seconds = max(self.slowest_worker_seconds, other.slowest_worker_seconds)
        self.wait_seconds += other.wait_seconds
        self.values_in += other.values_in
        self.bytes_in += other.bytes_in


@dataclass(frozen=True)
class Pending:
    """A started part of a step: the workers it covers, its result, and whether a reducer computes it."""

    names: list[Name]
    result: ray.ObjectRef
    reduced: bool


class NodeAggregation:
    """The reducers of a set of workers, placed one per node that runs two or more of them (not the driver's)."""

    def __init__(self) -> None:
        self.reducers: dict[str, ray.actor.ActorHandle] = {}
        self.members: dict[str, dict[Name, ray.actor.ActorHandle]] = {}
        self.driver_node = ray.get_runtime_context().get_node_id()

    def place(self, workers: Mapping[Name, ray.actor.ActorHandle], nodes: Mapping[Name, str]) -> None:
        """Give each remote node with two or more of `workers` its reducer, holding that node's workers."""
        wanted = {node: {name: workers[name] for name in names}
                  for node, names in group_by_node(nodes, workers).items()
                  if node != self.driver_node and len(names) > 1}
        for node in set(self.reducers) - set(wanted):
            ray.kill(self.reducers.pop(node))
            self.members.pop(node, None)
        for node, members in wanted.items():
            if node not in self.reducers:
                self.reducers[node] = NodeReducerActor.options(
                    **release.UNRECORDED_BY_RAY, num_cpus=0, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote()
            if self.members.get(node) != members:
                self.reducers[node].set_workers.remote(members)
                self.members[node] = members

    def run(
        self, workers: Mapping[Name, ray.actor.ActorHandle], nodes: Mapping[Name, str], method: str,
        weights: ray.ObjectRef, calls: Mapping[Name, tuple], options: Mapping[str, Any], direct: bool = False,
    ) -> list[Pending]:
        """Start ``method(weights, *calls[name], **options)`` on each named worker.

        One part per remote node (its reducer's sum, or its only worker's)
        and one per worker on the driver's node; with `direct`, one per
        worker (a recomputation, which need not wait for a new reducer).
        Call `place` first.
        """
        pending = []
        for node, names in group_by_node(nodes, calls).items():
            if not direct and node in self.reducers and len(names) > 1:
                node_calls = {name: calls[name] for name in names}
                pending.append(Pending(names, self.reducers[node].reduce.remote(method, [weights], node_calls,
                                                                                options), True))
                continue
            for name in names:
                pending.append(Pending([name], workers[name].timed_call.remote(method, weights, *calls[name],
                                                                               **options), False))
        return pending

    def gather(self, pending: list[Pending]) -> Gathered:
        """Wait for every part of `run`; the workers of a part that was lost are in `failed`.

        A worker's lost actor fails its part, and any error of a reducer
        fails its node's part (the driver then calls those workers itself);
        a worker's own error is raised.
        """
        gathered = Gathered()
        started = time.perf_counter()
        try:
            # One call for every part: each ray.get costs the driver a round of IPC, so not one per node.
            results = ray.get([part.result for part in pending])
        except ray.exceptions.RayError:
            results = [self._get_or_fail(part, gathered) for part in pending]
        for result in results:
            if result is None:
                continue
            values, seconds = result
            gathered.parts.append(values)
            gathered.slowest_worker_seconds = max(gathered.slowest_worker_seconds, seconds)
            gathered.values_in += values.size
            gathered.bytes_in += values.nbytes
        gathered.wait_seconds = time.perf_counter() - started
        return gathered

    @staticmethod
    def _get_or_fail(part: Pending, gathered: Gathered) -> tuple[np.ndarray, float] | None:
        """`part`'s result, or None with its workers added to ``gathered.failed`` when it was lost."""
        try:
            return ray.get(part.result)
        except ray.exceptions.RayError as error:
            if not (part.reduced or isinstance(error, ray.exceptions.RayActorError)):
                raise
            gathered.failed.extend(part.names)
            return None

    def forget(self, names) -> None:
        """Drop the reducers that held any of `names` (lost workers): `place` starts them afresh."""
        for node, members in list(self.members.items()):
            if any(name in members for name in names):
                ray.kill(self.reducers.pop(node))
                del self.members[node]

    def close(self) -> None:
        """Stop every reducer."""
        for reducer in self.reducers.values():
            ray.kill(reducer)
        self.reducers.clear()
        self.members.clear()
