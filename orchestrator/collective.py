"""The collective path: the gradient workers all-reduce among themselves and the driver is a control plane.

With ``aggregation = "collective"`` the workers are the ranks of one
torch.distributed group (gloo on CPUs, NCCL on GPUs; ``workers.collective``):
they reduce-scatter their clipped sums, each noises and steps its own slice of
the coordinates and they all-gather the new weights. The driver sends each
rank, per step, its share of the step's Poisson sample, the slice key of its
noise and a few scalars, and gets back scalars: no vector of P values passes
through it on a training step. It still samples, charges the ledger,
accounts, evaluates and checkpoints (asking the ranks for the weights and
their optimizer slices when it does).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import ray

from orchestrator.config import TrainConfig
from orchestrator.fleet import gradient_worker
from workers.collective import CollectiveRankActor
from workers.noise import GaussianNoise

# `aggregation = "auto"` picks the driver path for every run for now, although the collective path was
# measured faster from 1M parameters with 2 workers (docs/benchmarks.md, "Driver path against collective path",
# 2026-11-26, 2-core VM: 123 against 152 ms a step at 1M, 1260 against 2551 ms at 10M): a lost rank stops a
# collective run, where the driver path replaces a lost worker and recomputes its share, and the collective path
# does not run shards, users or ema_decay. Once it re-forms its group after a loss, pick "collective" from
# 1M parameters x 2 workers. With 1 worker it lost at 10M (1733 against 1329 ms: the rank draws its noise itself).
AUTO_AGGREGATION = "driver"


def resolved_aggregation(config: TrainConfig) -> str:
    """The path a run's sums take: "driver" or "collective" (``auto`` resolves by AUTO_AGGREGATION)."""
    return AUTO_AGGREGATION if config.aggregation == "auto" else config.aggregation


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


class CollectiveFleet:
    """`config.workers` collective ranks in one process group, started with the run's initial `weights`.

    Ray places the actors; rank 0 names the group's address and a free port
    and every rank joins with its rank number, as Ray Train does for torch.
    A rank lost mid-run stops the run with a message saying to resume it
    from its checkpoint: the group is not re-formed within a run.
    """

    def __init__(self, config: TrainConfig, weights: np.ndarray, learning_rate: float,
                 say: Callable[[str], None]):
        self.say = say
        self.workers = [gradient_worker(config, CollectiveRankActor, restarts=0) for _ in range(config.workers)]
        address, port = ray.get(self.workers[0].rendezvous.remote())
        # NCCL takes one GPU per rank; ranks that share a GPU (gpus_per_worker < 1) reduce over gloo on the host.
        backend = "nccl" if config.gpus_per_worker >= 1 else "gloo"
        shared_weights = ray.put(np.asarray(weights, dtype=np.float32))
        ray.get([worker.join_group.remote(rank, len(self.workers), address, port, backend, shared_weights,
                                          config.optimizer.name, dict(config.optimizer.parameters), learning_rate,
                                          config.secure_noise)
                 for rank, worker in enumerate(self.workers)])
        say(f"collective path: {len(self.workers)} ranks over {backend} at {address}:{port}")

    def step(self, step: int, shares: list[np.ndarray], group_shares: list[np.ndarray] | None, clip_norm,
             noise: GaussianNoise, noise_std: float, contributions: float, learning_rate: float,
             count_unclipped: bool) -> CollectiveStep:
        """Run step `step` on the group: rank r gets `shares[r]` and slice r's noise key; returns what came back."""
        groups = group_shares or [None] * len(shares)
        calls = [(step, shares[rank], clip_norm, groups[rank], noise.slice_key(step, rank), noise.seeded, noise_std,
                  contributions, learning_rate, count_unclipped) for rank in range(len(self.workers))]
        pending = [worker.train_step.remote(*arguments) for worker, arguments in zip(self.workers, calls)]
        started = time.perf_counter()
        try:
            results = ray.get(pending)
        except ray.exceptions.RayActorError as error:
            raise RuntimeError(
                "a collective rank was lost mid-step; the collective path does not re-form its group within a run: "
                "resume from the last checkpoint (dpfleet train --resume RUN_DIR)") from error
        wait = time.perf_counter() - started
        return CollectiveStep(
            slowest_worker_seconds=max(result["worker_seconds"] for result in results), wait_seconds=wait,
            driver_bytes=sum(call_bytes(*arguments) for arguments in calls) + sum(map(call_bytes, results)),
            unclipped=sum(result["unclipped"] or 0.0 for result in results))

    def weights(self) -> np.ndarray:
        """The group's current flat float32 weights (rank 0's: every rank holds the same)."""
        return ray.get(self.workers[0].current_weights.remote())

    def optimizer_slices(self) -> list[dict]:
        """Each rank's slice bounds and optimizer state, in rank order, for a checkpoint."""
        return ray.get([worker.optimizer_slice.remote() for worker in self.workers])

    def load_optimizer_slices(self, slices: list[dict]) -> None:
        """Give each rank its slice's optimizer state from a checkpoint taken with as many ranks."""
        if len(slices) != len(self.workers):
            raise ValueError(f"the checkpoint holds the optimizer slices of {len(slices)} ranks, this run has "
                             f"{len(self.workers)}; resume with workers = {len(slices)}")
        ray.get([worker.load_optimizer_slice.remote(saved) for worker, saved in zip(self.workers, slices)])

    def close(self) -> None:
        """Leave the group and let go of the ranks."""
        try:
            ray.get([worker.leave_group.remote() for worker in self.workers])
        except ray.exceptions.RayActorError:
            pass  # a lost rank has left already
        self.workers.clear()
