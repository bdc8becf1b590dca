"""Central Gaussian noise, drawn ahead of its step, and the noisy mean gradient.

Every noise vector is a pure function of the driver's secret key
(``workers.keys``, in memory only) and a noise key (which of the step's
vectors it is, and the step): fixed-size chunks of it come from independent
streams, each seeded by PRF(key, "noise", kind, step, chunk), so any number of
threads draws the same values, and a worker's death within a running driver
changes nothing. Nothing the run writes holds the key: a resumed run draws a
new one, and fresh noise for the steps that remain. ``NoiseFeed`` draws the
next step's vector on a background thread while the workers compute the
current step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from workers.keys import NOISE, SecretKey
# The drawing itself is shared with the collective path's ranks, which draw their slices' noise.
from workers.noise import (  # noqa: F401 - re-exported for the driver and its tests
    CHUNK_VALUES, COUNT_NOISE, GRADIENT_NOISE, SECURE_DRAWS, TREE_NOISE, GaussianNoise, chunk_bounds, driver_threads,
    fill_unit_normal,
)
from accounting.matrix_mechanisms import CorrelatedNoisePlan, tree_nodes


class TorchGaussianNoise(GaussianNoise):
    """GaussianNoise drawn by torch on `device` (the driver's GPU when it has one), as a float64 tensor there.

    Each vector comes from one torch generator seeded with 63 bits of
    PRF(key, "noise", kind, step), with the same SECURE_DRAWS-fold float64
    hardening. The values differ from GaussianNoise's. Runs on the CPU as
    well, which is how it is tested without a GPU.
    """

    def __init__(self, key: SecretKey | None = None, secure: bool = True, device: str | torch.device = "cuda"):
        super().__init__(key, secure, threads=1)
        self.device = torch.device(device)

    def draw(self, size: int, std: float, key: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The `size` independent N(0, std^2) float64 values of vector `key`, on the device."""
        generator = torch.Generator(self.device).manual_seed(self._key.torch_seed(NOISE, *key))
        if out is None:
            out = torch.empty(size, dtype=torch.float64, device=self.device)
        out.normal_(generator=generator)
        draws = self.draws_per_value
        if draws > 1:
            part = torch.empty_like(out)
            for _ in range(draws - 1):
                out += part.normal_(generator=generator)
            out *= 1.0 / np.sqrt(draws)
        if std != 1.0:
            out *= std
        return out


class NoiseFeed:
    """The driver's noise for each step, drawn on a background thread while the workers compute.

    Two buffers alternate: step t's vector is drawn into one while step
    t - 1's, in the other, is being added. `request(step)` starts the unit
    (std 1) vector of `step`; `take(step)` waits for it and hands it out, at
    most once per step: a recomputed shard or a retried call never gets a
    second draw. The trainer scales it by sigma * C when the step's clip norm
    is known.
    """

    def __init__(self, noise: GaussianNoise, size: int):
        self.noise, self.size = noise, size
        self._buffers: list[np.ndarray | torch.Tensor | None] = [None, None]
        self._drawing = ThreadPoolExecutor(1, thread_name_prefix="noise-feed")
        self._pending: dict[int, Future] = {}
        self._taken: int | None = None
        self._lock = threading.Lock()

    def request(self, step: int) -> None:
        """Start drawing step `step`'s unit noise in the background (no-op if it is already under way)."""
        with self._lock:
            if step in self._pending or (self._taken is not None and step <= self._taken):
                return
            slot = step % 2
            self._pending[step] = self._drawing.submit(self._draw, step, slot)

    def _draw(self, step: int, slot: int):
        self._buffers[slot] = self.noise.draw(self.size, 1.0, (GRADIENT_NOISE, step), out=self._buffers[slot])
        return self._buffers[slot]

    def take_once(self, step: int) -> None:
        """Mark step `step`'s noise as taken (drawn elsewhere); a second take of a step raises."""
        if self._taken is not None and step <= self._taken:
            raise RuntimeError(f"the noise of step {step} was already taken: each step adds noise exactly once")
        self._taken = step

    def take(self, step: int):
        """Step `step`'s unit noise vector (drawn now if it was not requested); a second take of a step raises."""
        if self._taken is not None and step <= self._taken:
            raise RuntimeError(f"the noise of step {step} was already taken: each step adds noise exactly once")
        self.request(step)
        with self._lock:
            pending = self._pending.pop(step)
            for stale in [other for other in self._pending if other < step]:
                self._pending.pop(stale).cancel()
        values = pending.result()
        self._taken = step
        return values

    def close(self) -> None:
        """Stop the background thread (a draw under way finishes first)."""
        self._drawing.shutdown(wait=True, cancel_futures=True)


def noisy_sum_at(
    partial_sums: Sequence[np.ndarray], unit_noise, noise_std: float, coordinates: np.ndarray
) -> np.ndarray:
    """The noisy sum (partial sums added up, then noise_std * unit_noise) at `coordinates`, as float64."""
    noisy = np.zeros(len(coordinates))
    for part in partial_sums:
        noisy += part[coordinates]
    return noisy + noise_std * np.asarray(torch.as_tensor(unit_noise)[torch.as_tensor(coordinates)].cpu())


_scratch = threading.local()


def _scratch_pair(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 buffers of `length` values, kept by this thread from call to call.

    Fresh temporaries of a chunk's size cost page faults on every chunk of
    every step; reused ones stay mapped.
    """
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None or buffers.shape[1] < length:
        buffers = _scratch.buffers = np.empty((2, length))
    return buffers[0, :length], buffers[1, :length]


def noisy_mean_gradient(
    partial_sums: Sequence[np.ndarray], unit_noise, noise_std: float, contributions: float, out,
    pool: ThreadPoolExecutor | None = None,
):
    """(sum of partial_sums + noise_std * unit_noise) / contributions in float64, written as float32 into `out`.

    `unit_noise` None adds none (the sum already carries its noise). The
    partial sums of clipped gradients are added up first, and the noise
    once to their sum; dividing by the expected batch size q*N (or the
    microbatch count), never the realised one, keeps the realised count (a
    raw, un-noised statistic) out of what is released. On the CPU this runs
    chunk by chunk in scratch buffers each thread keeps, on `pool`'s threads
    when given: one pass over memory instead of one per operation, and no
    fresh temporaries. `out` on a GPU takes the sum there.
    """
    if isinstance(out, torch.Tensor) and out.device.type != "cpu":
        noisy = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
        for part in partial_sums:
            noisy += torch.as_tensor(part).to(out.device)
        if unit_noise is not None:
            noisy.add_(unit_noise, alpha=noise_std)
        out.copy_(noisy.div_(contributions))
        return out
    array = np.asarray(out)
    unit_noise = None if unit_noise is None else np.asarray(unit_noise)

    def combine(bounds: tuple[int, int]) -> None:
        start, stop = bounds
        noisy, scaled_noise = _scratch_pair(stop - start)
        noisy.fill(0.0)
        for part in partial_sums:
            noisy += part[start:stop]
        if unit_noise is not None:
            noisy += np.multiply(unit_noise[start:stop], noise_std, out=scaled_noise)
        np.divide(noisy, contributions, out=array[start:stop])

    bounds = chunk_bounds(array.size)
    if pool is None:
        for chunk_bound in bounds:
            combine(chunk_bound)
    else:
        list(pool.map(combine, bounds))
    return out


def _copy(vector):
    """A copy of a numpy array or torch tensor (the feed's buffers are reused two steps later)."""
    return vector.clone() if isinstance(vector, torch.Tensor) else np.array(vector, copy=True)


class CorrelatedNoise:
    """Each step's correlated unit noise at the driver: row t of C⁻¹Z for BandMF, a prefix difference for DP-FTRL.

    BandMF: w_t = (z_t - Σ_{i=1}^{b-1} c_i w_{t-i}) / c_0, with z_t the
    step's independent vector (DP-SGD's, keyed (GRADIENT_NOISE, t)); the
    last b - 1 vectors w are kept, (b - 1)·P floats. With b = 1 it hands z_t
    on unchanged. DP-FTRL: the noise of the prefix 0..t is the sum of the
    tree nodes that cover it, each keyed (TREE_NOISE, tree, level, index);
    the step's noise is that prefix's minus the one before, which is kept.
    Both live in memory only, so such a run is never resumed (the trainer
    refuses it).
    """

    def __init__(self, plan: CorrelatedNoisePlan, noise: GaussianNoise, size: int):
        self.plan, self.noise, self.size = plan, noise, size
        self.coefficients = plan.coefficients
        self._history: list = []
        self._previous_prefix: tuple[int, object] | None = None

    def unit_noise(self, step: int, independent):
        """Step `step`'s correlated noise, in units of σ·C; `independent` is the step's z_t (BandMF only)."""
        if self.plan.mechanism == "band-mf":
            return self._banded(independent)
        return self._tree_difference(step)

    def _banded(self, independent):
        coefficients = self.coefficients
        if len(coefficients) == 1:
            return independent
        value = _copy(independent)
        for band, previous in enumerate(reversed(self._history), start=1):
            value -= coefficients[band] * previous
        value *= 1.0 / coefficients[0]
        self._history = (self._history + [value])[-(len(coefficients) - 1):]
        return value

    def _prefix(self, step: int):
        plan = self.plan
        leaves = plan.tree_leaves
        tree, position = divmod(step, leaves) if plan.tree_restart else (0, step)
        leaves = min(leaves, plan.steps - tree * leaves)
        total = None
        for level, index in tree_nodes(position, leaves, plan.tree_completion):
            node = self.noise.draw(self.size, 1.0, (TREE_NOISE, tree, level, index))
            total = node if total is None else total + node
        return tree, total

    def _tree_difference(self, step: int):
        tree, prefix = self._prefix(step)
        previous = None
        if self._previous_prefix is not None and self._previous_prefix[0] == step - 1:
            previous_tree, previous = self._previous_prefix[1]
        elif step > 0:
            previous_tree, previous = self._prefix(step - 1)
        self._previous_prefix = (step, (tree, prefix))
        if previous is None or previous_tree != tree:
            return prefix
        return prefix - previous


class CentralNoise:
    """A run's noise at the driver: each step's unit vector drawn ahead (`NoiseFeed`), added once to the sum.

    `noise` is the run's generator, keyed by the run key; `size` the
    number of parameters. The threads that add it take every core the
    driver has: the workers are idle while it runs. `close` stops both.
    With `at_driver` False (the noise is in the silos' sums) nothing is
    drawn: each step's `take` only marks it taken, and gives None.
    """

    def __init__(self, noise: GaussianNoise, size: int, steps: int, correlation: CorrelatedNoisePlan | None = None,
                 at_driver: bool = True):
        self.steps, self.at_driver = steps, at_driver
        self.feed = NoiseFeed(noise, size)
        self.arithmetic = ThreadPoolExecutor(driver_threads(), thread_name_prefix="driver")
        self.correlated = None if correlation is None else CorrelatedNoise(correlation, noise, size)
        # DP-FTRL draws its tree's nodes, not the feed's independent vectors.
        self._uses_feed = correlation is None or correlation.mechanism == "band-mf"

    def request(self, step: int) -> None:
        """Start drawing step `step`'s noise and the next step's, while the workers compute."""
        if not self._uses_feed or not self.at_driver:
            return
        self.feed.request(step)
        if step + 1 < self.steps:
            self.feed.request(step + 1)

    def take(self, step: int):
        """Step `step`'s unit noise vector, handed out once (`NoiseFeed.take`); correlated across steps with a
        correlated mechanism (`CorrelatedNoise`); None when the noise is not the driver's."""
        if not self.at_driver:
            self.feed.take_once(step)
            return None
        if self.correlated is None:
            return self.feed.take(step)
        if not self._uses_feed:
            self.feed.take_once(step)
            return self.correlated.unit_noise(step, None)
        return self.correlated.unit_noise(step, self.feed.take(step))

    def mean_gradient(self, partial_sums: Sequence[np.ndarray], unit_noise, noise_std: float, contributions: float,
                      out) -> None:
        """Write (sum of `partial_sums` + noise_std * unit_noise) / contributions into `out` (`noisy_mean_gradient`)."""
        noisy_mean_gradient(partial_sums, unit_noise, noise_std, contributions, out, self.arithmetic)

    def close(self) -> None:
        """Stop drawing and adding."""
        self.feed.close()
        self.arithmetic.shutdown()
