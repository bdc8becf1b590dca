"""The collective path: the gradient workers all-reduce among themselves and the driver is a control plane.

With ``aggregation = "collective"`` the workers are the ranks of one
torch.distributed group (gloo on CPUs, NCCL on GPUs; ``workers.collective``):
they reduce-scatter their clipped sums, each noises and steps its own slice of
the coordinates and they all-gather the new weights. The driver sends each
rank, per step, its share of the step's Poisson sample, the slice key of its
noise and a few scalars, and gets back scalars: no vector of P values passes
through it on a training step. It still samples, charges the ledger,
accounts, evaluates and checkpoints (asking the ranks for the weights,
their optimizer slices and, with ``ema_decay``, their slices of the weights'
moving average when it does).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import ray

from orchestrator import release
from orchestrator.config import TrainConfig, collective_refusals
from orchestrator.fleet import gradient_worker
from workers.collective import CollectiveRankActor
from workers.noise import GaussianNoise

# `aggregation = "auto"` picks the collective path from this many parameters times workers, with 2 workers or more,
# for a config that path runs. Measured (bench/results/paths.json, docs/benchmarks.md "Driver path against collective
# path", 2026-11-26, the 2-core VM, `python -m bench.scaling --paths`): with 2 workers the collective step was
# shorter from the smallest product measured, 1M parameters x 2 workers (123 against 152 ms), and at 10M x 2
# (1,260 against 2,551 ms); later at 40M x 2 (8,790 against 13,369 ms, bench/results/paths-40m-2.json) and even at
# 1M x 3 (212 against 213 ms, paths-3-workers.json), so the crossover lies at about 2-3M. With 1 worker there is
# no sum to share and the rank draws all of the noise inside its step, where the driver path draws it on the
# driver's threads during the workers' computation: it lost at 10M (1,733 against 1,329 ms), so one worker stays
# on the driver path.
AUTO_COLLECTIVE_FROM = 2_000_000
AUTO_COLLECTIVE_WORKERS = 2


def resolved_aggregation(config: TrainConfig, parameters: int, planned: bool | None = None) -> str:
    """The path a run's sums take, "driver" or "collective"; `auto` resolves by the measured crossover above.

    `parameters` is the model's parameter count P; `auto` picks the
    collective path when the run has AUTO_COLLECTIVE_WORKERS workers or more,
    P x workers >= AUTO_COLLECTIVE_FROM and the path runs the config
    (`collective_refusals`; `planned`: whether the run reads planned batches,
    None as the config alone says).
    """
    if config.aggregation != "auto":
        return config.aggregation
    return "collective" if _large_enough(config, parameters) and not collective_refusals(config, planned) \
        else "driver"


def kept_on_driver_by_planned_batches(config: TrainConfig, parameters: int, planned: bool) -> bool:
    """Whether `auto` took the driver path for the run's planned batches alone (else it would take the collective).

    Planned batches win over the collective path: 2M rows of Parquet with
    pyarrow's default row groups, read one row at a time, took 99x the
    in-memory step (1,191 against 12 ms; docs/benchmarks.md, "Planned
    batches without the key"), where the collective path saves at most about
    half a step (1,260 against 2,551 ms at 10M parameters x 2).
    """
    return config.aggregation == "auto" and planned and _large_enough(config, parameters) \
        and not collective_refusals(config, planned=False)


def _large_enough(config: TrainConfig, parameters: int) -> bool:
    return config.workers >= AUTO_COLLECTIVE_WORKERS and parameters * config.workers >= AUTO_COLLECTIVE_FROM


@dataclass
class CollectiveStep:
    """What the driver learns of one collective step: timings, bytes it moved, and the raw unclipped count."""

    slowest_worker_seconds: float = 0.0
    wait_seconds: float = 0.0
    driver_bytes: int = 0
    unclipped: float = 0.0


def call_bytes(*values) -> int:
    """The size of `values` as they are sent or received through Ray (pickled, out-of-band buffers inline)."""
    return len(pickle.dumps(values, protocol=5))


# Ranks lost and replaced within one step before the run stops (each time the group is re-formed and replayed).
RANK_REPLACEMENTS = 2
# After a rank is found lost, how long the others may take to fail out of their collectives (gloo sees a closed
# connection at once; a rank still inside a call after this is stuck and is replaced too).
LOST_PEER_SECONDS = 60.0


class RanksLost(Exception):
    """Ranks of the group died (or stuck in a collective after a peer died) within a step: their indices."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"collective ranks {ranks} were lost")
        self.ranks = ranks


@dataclass
class RestorePoint:
    """What every rank restarts from when the group is re-formed: the weights and optimizer slices after `step`.

    `weights` is in the driver's object store; `slices` is None before the
    optimizers have state of record (a new run's start: fresh optimizers);
    `averaged` is the weights' moving average with ema_decay (else None),
    in the object store too.
    """

    step: int
    weights: ray.ObjectRef
    slices: list[dict] | None
    averaged: ray.ObjectRef | None = None

    @classmethod
    def put(cls, step: int, weights: np.ndarray, slices: list[dict] | None,
            averaged: np.ndarray | None) -> "RestorePoint":
        """The restore point of these flat weights and moving average (None without), put as float32 in the store."""
        return cls(step, ray.put(np.asarray(weights, dtype=np.float32)), slices,
                   None if averaged is None else ray.put(np.asarray(averaged, dtype=np.float32)))


class CollectiveFleet:
    """`config.workers` collective ranks in one process group, started at `step` with `weights` and `slices`.

    Ray places the actors; rank 0 names the group's address and a free port
    and every rank joins with its rank number, as Ray Train does for torch.
    `slices` are the ranks' optimizer slices from a checkpoint (None: fresh
    optimizers); `averaged_weights` the weights' moving average to continue
    with `config.ema_decay` (None without); `noise` is the run's generator,
    whose slice keys the ranks get step by step.

    With shards (silo mode), `ranks` are the shards' workers, already
    placed on their silos, and each samples its own examples.

    Faults: a rank that dies within a step is replaced. Its replacement
    takes its rank, the group is re-formed (a new rendezvous on the new rank
    0), every rank goes back to the restore point (the weights and optimizer
    slices of the last checkpoint, `checkpoint`) and the steps since are run
    again with the calls they had, then the lost step. Samples and noise are
    functions of the run key, the step and the slice, so the replayed steps
    repeat the same noisy updates: the run ends with the weights of an
    undisturbed run and spends nothing more, the steps being accounted once
    by the driver. The calls since the restore point (sample shares and
    scalars, no noise key) are kept in the driver's memory for this.

    With shards a lost rank is not replaced within the run: each silo's
    worker samples from a key of its own that dies with it, so a replacement
    could not repeat the lost rank's samples, and a step replayed with the
    same noise over other samples would release the difference of two sums.
    The run stops and is resumed from its last checkpoint, with new keys.
    """

    def __init__(self, config: TrainConfig, weights: np.ndarray, slices: list[dict] | None, step: int,
                 noise: GaussianNoise, learning_rate: float, say: Callable[[str], None],
                 ranks: list[ray.actor.ActorHandle] | None = None, averaged_weights: np.ndarray | None = None):
        self.config, self.noise, self.say = config, noise, say
        if slices is not None and len(slices) != config.workers:
            raise ValueError(f"the checkpoint holds the optimizer slices of {len(slices)} ranks, this run has "
                             f"{config.workers}; resume with workers = {len(slices)}")
        self.replaceable = ranks is None
        self.workers = [self._new_rank() for _ in range(config.workers)] if ranks is None else list(ranks)
        # NCCL takes one GPU per rank; ranks that share a GPU (gpus_per_worker < 1) reduce over gloo on the host.
        self.backend = "nccl" if config.gpus_per_worker >= 1 else "gloo"
        self.learning_rate = learning_rate
        self.restore_point = RestorePoint.put(step, weights, slices, averaged_weights)
        self.replay: list[tuple[int, list[tuple]]] = []
        self.replacements = 0
        self._form_group()

    def _new_rank(self) -> ray.actor.ActorHandle:
        # Ray does not restart a rank: a restarted process would hang in a group that no longer exists.
        return gradient_worker(self.config, CollectiveRankActor, restarts=0)

    def _form_group(self) -> None:
        """Rendezvous on rank 0 and have every rank join with the restore point's weights and optimizer slices."""
        config, restore = self.config, self.restore_point
        address, port = self._on_ranks(lambda rank, worker: worker.rendezvous.remote(), ranks=[0])[0]
        self._on_ranks(lambda rank, worker: worker.join_group.remote(
            rank, len(self.workers), address, port, self.backend, restore.weights, config.optimizer.name,
            dict(config.optimizer.parameters), self.learning_rate, config.secure_noise, config.ema_decay,
            restore.averaged))
        if restore.slices is not None:
            self._on_ranks(lambda rank, worker: worker.load_optimizer_slice.remote(restore.slices[rank]))
        self.say(release.line("collective_start", ranks=len(self.workers), backend=self.backend,
                              address=f"{address}:{port}"))

    def _on_ranks(self, call: Callable, ranks: list[int] | None = None) -> list:
        """`call(rank, worker)` for each of `ranks` (all by default), waited for; the results in rank order.

        Raises RanksLost naming the ranks that died, or that were still
        inside a call LOST_PEER_SECONDS after a rank was found dead (they
        are killed: stuck in a collective with a dead peer); a rank's own
        error is raised as it is when no rank was lost.
        """
        ranks = range(len(self.workers)) if ranks is None else ranks
        pending = {call(rank, self.workers[rank]): rank for rank in ranks}
        results, lost, failed = {}, [], []
        remaining = list(pending)
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=1, timeout=LOST_PEER_SECONDS if lost else None)
            if not done:
                for ref in remaining:
                    ray.kill(self.workers[pending[ref]])
                lost.extend(pending[ref] for ref in remaining)
                break
            (ref,) = done
            try:
                results[pending[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError:
                lost.append(pending[ref])
            except ray.exceptions.RayTaskError as error:  # a rank whose collective failed, or an error of its own
                failed.append(error)
        if lost:
            raise RanksLost(sorted(lost))
        if failed:
            raise failed[0]
        return [results[rank] for rank in ranks]

    def _despite_losses(self, step: int, attempt: Callable[[], object]):
        """`attempt()`, after replacing the ranks lost in it and bringing the group back to `step`, as often as needed.

        Bringing it back: the group re-formed at the restore point, then the
        steps since run again (`replay`). At most RANK_REPLACEMENTS times.
        """
        lost, replacements = None, 0
        while True:
            try:
                if lost is not None:
                    self._replace(lost, step)
                    for replayed_step, arguments in self.replay:
                        self._train_ranks(replayed_step, arguments)
                return attempt()
            except RanksLost as error:
                if not self.replaceable:
                    raise RuntimeError(
                        f"step {step}: the shard worker(s) of collective rank(s) {error.ranks} were lost; on the "
                        "collective path a silo's rank is not replaced within a run (its sampling key died with it): "
                        f"resume from the last checkpoint, step {self.restore_point.step}, once its node is back "
                        f"(dpfleet train --resume {self.config.run_dir})") from error
                if replacements == RANK_REPLACEMENTS:
                    raise RuntimeError(f"collective ranks were lost again after {RANK_REPLACEMENTS} replacements "
                                       f"at step {step}; check the workers' logs (ray logs)") from error
                lost, replacements = error.ranks, replacements + 1

    def step(self, step: int, shares: list[np.ndarray], group_shares: list[np.ndarray] | None, clip_norm,
             noise_std: float, contributions: float, learning_rate: float, count_unclipped: bool) -> CollectiveStep:
        """Run step `step` on the group: rank r gets `shares[r]` and slice r's noise key; returns what came back.

        A rank lost in the step is replaced and the step redone with the
        same keys (see the class).
        """
        groups = group_shares or [None] * len(shares)
        arguments = [(shares[rank], clip_norm, groups[rank], noise_std, contributions, learning_rate, count_unclipped)
                     for rank in range(len(self.workers))]
        self.driver_bytes, started = 0, time.perf_counter()
        results = self._despite_losses(step, lambda: self._train_ranks(step, arguments))
        self.replay.append((step, arguments))
        return CollectiveStep(
            slowest_worker_seconds=max(result["worker_seconds"] for result in results),
            wait_seconds=time.perf_counter() - started, driver_bytes=self.driver_bytes,
            unclipped=sum(result["unclipped"] or 0.0 for result in results))

    def _train_ranks(self, step: int, arguments: list[tuple]) -> list[dict]:
        """Every rank's `train_step` of `step` with its `arguments` and its slice's noise key; the bytes are counted."""
        calls = [(step, share, clip_norm, groups, self.noise.slice_key(step, rank), self.noise.seeded, noise_std,
                  contributions, learning_rate, count)
                 for rank, (share, clip_norm, groups, noise_std, contributions, learning_rate, count)
                 in enumerate(arguments)]
        results = self._on_ranks(lambda rank, worker: worker.train_step.remote(*calls[rank]))
        self.driver_bytes += sum(map(call_bytes, calls)) + sum(map(call_bytes, results))
        return results

    def _replace(self, lost: list[int], step: int) -> None:
        """Replace the `lost` ranks in place, re-form the group and put every rank back at the restore point."""
        self.say(release.line("collective_rank_lost", step=step, lost=lost, replayed=len(self.replay),
                              restore_step=self.restore_point.step))
        for rank in lost:
            ray.kill(self.workers[rank])
            self.workers[rank] = self._new_rank()
        self.replacements += len(lost)
        self._form_group()

    def checkpoint(self, step: int) -> tuple[np.ndarray, list[dict], np.ndarray | None]:
        """The group's weights, each rank's optimizer slice and the moving average (None without ema_decay) after
        `step`, which become the restore point."""
        slices = self._despite_losses(
            step, lambda: self._on_ranks(lambda rank, worker: worker.optimizer_slice.remote()))
        weights = self.weights(step)
        averaged = None if self.config.ema_decay is None else self.averaged_weights(step)
        self.restore_point = RestorePoint.put(step, weights, slices, averaged)
        self.replay.clear()
        return weights, slices, averaged

    def weights(self, step: int) -> np.ndarray:
        """The group's flat float32 weights after `step` (rank 0's: every rank holds the same)."""
        return self._despite_losses(step, lambda: self._on_ranks(
            lambda rank, worker: worker.current_weights.remote(), ranks=[0])[0])

    def averaged_weights(self, step: int) -> np.ndarray:
        """The weights' flat float32 moving average after `step`: each rank's slice of it, in rank order."""
        return np.concatenate(self._despite_losses(step, lambda: self._on_ranks(
            lambda rank, worker: worker.averaged_slice.remote())))

    def close(self) -> None:
        """Leave the group and let go of the ranks (a shard's ranks stay with the shards' fleet, which stops them)."""
        try:
            ray.get([worker.leave_group.remote() for worker in self.workers])
        except ray.exceptions.RayActorError:
            pass  # a lost rank has left already
        self.workers.clear()
