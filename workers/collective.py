"""A gradient worker that is one rank of a torch.distributed group: the collective path's data plane.

Each step the driver sends a rank its share of the step's sample, the step's
scalars (clip norm, noise std, q·N, learning rate) and the 32-byte key of its
slice's noise; nothing of size P. The ranks then:

1. compute their clipped sums (float32, as every gradient worker does);
2. reduce-scatter them in float64, so rank r holds the total of slice r of
   the coordinates (`slice_bounds`), and only that;
3. add the Gaussian noise of slice r, drawn from PRF(run key, "slice noise",
   step, r) (`workers.noise.GaussianNoise.slice_key`): the slices are
   disjoint and cover every coordinate, so each coordinate is noised exactly
   once, with std σ·C, by the same secure generator as the driver's;
4. divide by q·N and step the optimizer on slice r, which holds that
   slice's optimizer state alone (ZeRO-1: every optimizer offered updates a
   coordinate from its own gradient and state), and with ``ema_decay`` move
   the slice's moving average of the weights (post-processing of the noisy
   update, coordinate by coordinate, as the driver path does for the whole);
5. all-gather the new weights, so every rank ends the step with the same
   weights.

Under ``privacy_unit = "user"`` a rank's share holds user numbers and step 1
is ``GradientWorker.user_clipped_sum``: each sampled user's rows are read and
clipped whole, so one user moves the total by at most C, and the rest is the
same. With DP-FedAvg's ``local_steps`` each user's contribution is its
clipped model delta, and step 4 hands the optimizer minus the noisy mean
delta as its gradient, as the driver path does.

The ranks see the un-noised totals of their slices: the path assumes that
the workers trust each other (docs/scaling.md). The noise keys live in the
ranks' memory for one step and are never written anywhere.
"""

from __future__ import annotations

import datetime
import socket
import time

import numpy as np
import ray
import torch
import torch.distributed as dist

from workers.actor import GradientWorker
from workers.keys import SecretKey
from workers.noise import GRADIENT_NOISE, GaussianNoise
from workers.optimizers import torch_optimizer, update_ema
from workers.shard_worker import ShardWorker

# How long a rank waits in a collective for the others (a rank lost mid-step leaves the rest waiting this long).
GROUP_TIMEOUT = datetime.timedelta(minutes=5)


def slice_bounds(size: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's slice of `size` coordinates: ceil(size / world_size) each, the last ones shorter.

    The slices are disjoint and cover 0..size - 1, so each coordinate has
    exactly one owner (a trailing slice may be empty when world_size > size).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    length = -(-size // world_size)
    return [(min(size, rank * length), min(size, (rank + 1) * length)) for rank in range(world_size)]


def free_port() -> int:
    """A TCP port that is free on this host now, for the group's rendezvous on rank 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class CollectiveRank(GradientWorker):
    """A gradient worker that trains as one rank of a process group (see the module); `GradientWorker`'s arguments."""

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP address and a free port: where the group meets when this worker is rank 0.

        As Ray Train does for torch: the driver asks rank 0 for them and
        hands them to every rank with its rank number.
        """
        return ray.util.get_node_ip_address(), free_port()

    def join_group(
        self, rank: int, world_size: int, address: str, port: int, backend: str, weights: np.ndarray,
        optimizer: str, optimizer_options: dict, learning_rate: float, secure_noise: bool,
        ema_decay: float | None = None, averaged_weights: np.ndarray | None = None,
    ) -> None:
        """Join the group as `rank` of `world_size` (gloo on CPUs, nccl on GPUs) and hold the run's weights.

        `weights` are the flat float32 weights to start from, the same for
        every rank; the rank's optimizer (`optimizer`, `optimizer_options`)
        covers its slice of them only, with a fresh state (`load_optimizer_slice`
        restores one). With `ema_decay` the rank also keeps the moving
        average of its slice, starting from its slice of `averaged_weights`
        (the whole flat average, as a checkpoint holds it). A rank that was
        in a group before leaves it first: the driver re-forms the group this
        way after losing a rank, with every rank's weights and state back at
        one earlier step.
        """
        if (ema_decay is None) != (averaged_weights is None):
            raise ValueError("ema_decay and averaged_weights go together: give both (the moving average to "
                             "continue from) or neither")
        self.leave_group()
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                                timeout=GROUP_TIMEOUT)
        self.rank, self.world_size, self.secure_noise = rank, world_size, secure_noise
        self.collective_device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        self.size = int(np.asarray(weights).size)
        self.slice_start, self.slice_stop = slice_bounds(self.size, world_size)[rank]
        self.slice_length = -(-self.size // world_size)
        # Padded to world_size equal slices, as reduce-scatter and all-gather need; the padding stays zero.
        self.weights = torch.zeros(self.slice_length * world_size, dtype=torch.float32, device=self.collective_device)
        self.weights[:self.size] = torch.as_tensor(np.asarray(weights, dtype=np.float32))
        self.slice_weights = torch.nn.Parameter(self.weights[self.slice_start:self.slice_stop].clone())
        self.optimizer = torch_optimizer(optimizer, learning_rate, [self.slice_weights], optimizer_options)
        self.ema_decay = ema_decay
        self.slice_average = None if ema_decay is None else torch.as_tensor(
            np.asarray(averaged_weights, dtype=np.float32)[self.slice_start:self.slice_stop].copy(),
            device=self.collective_device)

    def train_step(
        self, step: int, indices: np.ndarray, clip_norm, group_ids: np.ndarray | None, noise_key: bytes,
        seeded: bool, noise_std: float, contributions: float, learning_rate: float, count_unclipped: bool,
    ) -> dict:
        """One DP-SGD step of the group (see the module); only scalars come back.

        `indices` are this rank's share of the step's sample: example
        positions, or under privacy_unit = "user" user numbers.
        `noise_key` is this rank's slice key for `step` (32 bytes, in memory
        only; `seeded` when it derives from a test seed); `noise_std` is σ·C;
        `contributions` the expected batch size q·N that the noisy sum is
        divided by. Returns the seconds of the clipped sum and of the whole
        step, and with `count_unclipped` this rank's raw count of unclipped
        examples (the driver noises their total, as on the driver path).
        """
        started = time.perf_counter()
        flat_weights = self.weights[:self.size].cpu().numpy()
        if self.users is None:
            part = self.clipped_grad_sum(flat_weights, indices, clip_norm, group_ids, count_unclipped,
                                         count_zeroed=True)
        else:  # the same sum and trailing raw count as the driver path's, user by user
            part = self.user_clipped_sum(flat_weights, indices, clip_norm, step)
        worker_seconds = time.perf_counter() - started
        sums = torch.zeros(self.slice_length * self.world_size, dtype=torch.float64, device=self.collective_device)
        sums[:self.size] = torch.as_tensor(part[:self.size])
        total = torch.empty(self.slice_length, dtype=torch.float64, device=self.collective_device)
        dist.reduce_scatter_tensor(total, sums)
        owned = self.slice_stop - self.slice_start
        noisy = total[:owned].cpu().numpy()
        noisy += self._slice_noise(noise_key, seeded, step, owned, noise_std)
        noisy /= contributions
        if self.users is not None and self.users.local_steps is not None:
            # DP-FedAvg's noisy mean is a model delta: the server optimizer takes it as minus a gradient.
            np.negative(noisy, out=noisy)
        self.slice_weights.grad = torch.as_tensor(noisy.astype(np.float32), device=self.collective_device)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        if self.slice_average is not None:
            update_ema(self.slice_average, self.slice_weights.detach(), self.ema_decay, step)
        self._gather_weights()
        return {"worker_seconds": worker_seconds, "step_seconds": time.perf_counter() - started,
                "unclipped": float(part[self.size]) if count_unclipped else None}

    def _slice_noise(self, noise_key: bytes, seeded: bool, step: int, owned: int, noise_std: float) -> np.ndarray:
        """N(0, noise_std^2) for each of the `owned` coordinates of this rank's slice, from its slice key."""
        noise = GaussianNoise(SecretKey(noise_key, seeded), secure=self.secure_noise,
                              threads=torch.get_num_threads())
        try:
            return noise.draw(owned, noise_std, (GRADIENT_NOISE, step))
        finally:
            noise.close()

    def _gather_weights(self) -> None:
        """Every rank's new slice into every rank's weights (one all-gather)."""
        mine = torch.zeros(self.slice_length, dtype=torch.float32, device=self.collective_device)
        mine[:self.slice_stop - self.slice_start] = self.slice_weights.detach()
        dist.all_gather_into_tensor(self.weights, mine)

    def current_weights(self) -> np.ndarray:
        """The flat float32 weights this rank holds (every rank holds the same after each step)."""
        return self.weights[:self.size].cpu().numpy().copy()

    def averaged_slice(self) -> np.ndarray:
        """This rank's slice of the weights' moving average (float32; `ema_decay` must be set)."""
        if self.slice_average is None:
            raise RuntimeError("averaged_slice needs a group joined with ema_decay")
        return self.slice_average.cpu().numpy().copy()

    def optimizer_slice(self) -> dict:
        """This rank's slice bounds and its optimizer's state, for the driver's checkpoint."""
        return {"start": self.slice_start, "stop": self.slice_stop, "state": self.optimizer.state_dict()}

    def load_optimizer_slice(self, saved: dict) -> None:
        """Restore this rank's optimizer state from `optimizer_slice`'s record of the same slice."""
        if (saved["start"], saved["stop"]) != (self.slice_start, self.slice_stop):
            raise ValueError(f"the checkpoint's optimizer slice {saved['start']}..{saved['stop']} is not this rank's "
                             f"({self.slice_start}..{self.slice_stop}); resume with the same number of workers")
        self.optimizer.load_state_dict(saved["state"])

    def leave_group(self) -> None:
        """Leave the process group (the run is over, or the group is re-formed without a lost rank)."""
        if dist.is_initialized():
            dist.destroy_process_group()


CollectiveRankActor = ray.remote(CollectiveRank)


class ShardCollectiveRank(CollectiveRank, ShardWorker):
    """A collective rank over a shard's examples (silo mode): it Poisson-samples them itself, as `ShardWorker` does.

    Its arguments are `ShardWorker`'s. The driver sends no indices; the
    rank's sample comes from its own sampling key and never leaves it. The
    rank still sees the un-noised total of its slice of the coordinates,
    added over every silo: the silos trust each other on this path.
    """

    def train_step(self, step: int, indices: None, *arguments) -> dict:
        """`CollectiveRank.train_step` over this rank's own Poisson sample of its shard for `step` (0-based)."""
        return super().train_step(step, self._local_sample(step), *arguments)


ShardCollectiveRankActor = ray.remote(ShardCollectiveRank)
