"""The Ray shell of a shard's gradient worker: it holds its own examples and samples them itself.

The driver sends the weights and the step number; the worker draws its own
Poisson sample of its examples at the common rate q (or, under a correlated
mechanism's fixed-order participation, takes its next slice of a fixed
shuffle of them) and answers with the sum of
their clipped gradients and the raw count of examples left out for a
non-finite gradient. Neither an example, an index nor a realised batch size
leaves the worker. Under secure aggregation the worker is its silo's party:
it answers with its sum in fixed point plus its self-mask and pairwise masks
(``SiloParty``), and its keys and shares stay in its memory; with the noise
in the silos it adds its discrete Gaussian share first. A shard of Parquet files is read
in batches planned ahead: the worker plans its own windows of samples and
gathers them with Ray Data on its own node
(`workers.planned_batches.PlannedWindows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from workers.actor import GradientWorker
from workers.clipping import LayerClipNorms
from workers.fingerprints import dataset_identity
from workers.planned_batches import PlannedRunSource, PlannedWindows, auto_window_steps, read_planned_dataset_beside, \
    remove_stale_window_folders
from workers.sampling import SiloFixedOrder, local_poisson_sample, local_sampling_key, silo_fixed_order_batch
from workers.secure_aggregation import (
    AdvertisedKeys,
    MaskedInput,
    RandomWords,
    Revealed,
    Round,
    RoundHistory,
    SiloParty,
    UnmaskRequest,
    check_registry,
    load_identity_key,
    noise_share,
)
from workers.shards import ShardSpec, load_shard_examples, worker_bounds
from workers.sources import InMemorySource


class ShardWorker(GradientWorker):
    """A gradient worker over worker ``worker_index``'s range of shard number ``shard_index``.

    Each step's sample derives from a key this worker draws from OS entropy
    and keeps in its own memory (``seed`` is None in production), so a
    retried step draws the same examples and nothing outside the worker can
    recompute any step's sample; a replacement worker draws a new key. A seed
    (tests only) derives the key from (seed, shard, worker). A shard whose
    dataset is a Parquet table is read in windows of ``plan_ahead_steps``
    steps (a number or "auto") that this worker plans and gathers on its
    node. The other arguments are ``GradientWorker``'s.
    """

    def __init__(
        self,
        shard: ShardSpec,
        shard_index: int,
        worker_index: int,
        seed: int | None,
        model_spec: str | dict,
        max_physical_batch: int,
        threads: int = 1,
        data_root: str | None = None,
        engine: str = "fast",
        loss: str = "cross_entropy",
        train_transforms: Sequence[Mapping[str, Any]] = (),
        augmentations_per_example: int = 1,
        plan_ahead_steps: int | str | None = None,
    ) -> None:
        if not 0 <= worker_index < shard.workers:
            raise ValueError(f"worker_index must be in 0..{shard.workers - 1} for a shard of {shard.workers} "
                             f"worker(s) (got {worker_index})")
        self.shard, self.shard_index, self.worker_index = shard, shard_index, worker_index
        self._sampling_key = local_sampling_key(seed, shard_index, worker_index)
        self.sampling_rate: float | None = None
        # Under a correlated mechanism's fixed-order participation: its shuffle of this worker's examples.
        self._fixed_order: tuple[SiloFixedOrder, np.ndarray] | None = None
        self._secure: SiloParty | None = None
        # What this silo remembers across rounds: a replayed round or a second input for a step is refused.
        self._rounds = RoundHistory()
        self.plan_ahead_steps, self.windows = plan_ahead_steps, None
        # Killed runs' windows on this node (sealed, but sampled rows) go as any run's silo worker starts here.
        remove_stale_window_folders()
        super().__init__(model_spec, shard.dataset, None, max_physical_batch, threads=threads, data_root=data_root,
                         engine=engine, loss=loss, train_transforms=train_transforms,
                         augmentations_per_example=augmentations_per_example,
                         planned_dataset=(read_planned_dataset_beside(shard.dataset)
                                          if isinstance(shard.dataset, Mapping) else None))

    def _training_source(
        self, dataset: str | dict, train_subset: int | None, data_root: str | None
    ) -> tuple[InMemorySource | PlannedRunSource, int]:
        if self.planned_dataset is not None:
            self.row_offset, stop = worker_bounds(self.planned_dataset.size, self.shard, self.worker_index)
            source = PlannedRunSource(dataset, self.planned_dataset, self.row_offset, stop)
        else:
            source = InMemorySource(*load_shard_examples(self.shard, self.worker_index, data_root))
        return source, len(source)

    def example_count(self) -> int:
        """How many training examples this worker holds (public: the driver adds them up to N)."""
        return self.train_size

    def fingerprint(self) -> dict:
        """The identity of this shard's training files, read here on the silo's node (``dataset_identity``)."""
        return dataset_identity(self.shard.dataset)

    def set_sampling_rate(self, sampling_rate: float, total_steps: int | None = None,
                          fixed_order: SiloFixedOrder | None = None) -> None:
        """Set q, the probability with which each example joins a step's sample (the same on every worker).

        With `fixed_order` (a correlated mechanism's fixed-order
        participation) each step takes this worker's next slice in that order
        instead (`silo_fixed_order_batch`), and q is only the expected batch's
        share. A Parquet shard also needs the run's `total_steps`: its first
        window starts gathering here.
        """
        if not 0.0 < sampling_rate <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1] (got {sampling_rate})")
        self.sampling_rate = sampling_rate
        self._fixed_order = None if fixed_order is None else (fixed_order, fixed_order.order(self.train_size))
        if self.planned_dataset is not None:
            if total_steps is None:
                raise ValueError("a Parquet shard's worker plans its windows up to the run's end: give total_steps")
            self._plan_windows(total_steps)

    def _plan_windows(self, total_steps: int) -> None:
        """Windows of this worker's own samples, gathered on this node's disk by Ray Data tasks kept on it."""
        if self.windows is not None:
            self.windows.close()
        window_steps = self.plan_ahead_steps
        if window_steps == "auto":
            window_steps = auto_window_steps(self.sampling_rate * self.train_size, self.planned_dataset.row_bytes,
                                             total_steps)
        self.windows = PlannedWindows(self.planned_dataset, int(window_steps), total_steps,
                                      lambda step: [self.row_offset + self._local_sample(step)],
                                      self.sampling_rate * self.train_size,
                                      node_id=ray.get_runtime_context().get_node_id())
        self.windows.start()

    def release(self) -> None:
        """Stop gathering and delete every window's folder (before the actor is stopped)."""
        if self.windows is not None:
            self.windows.close()

    def sampled_clipped_grad_sum(
        self, weights: np.ndarray, step: int, clip_norm: float | LayerClipNorms
    ) -> np.ndarray:
        """Poisson-sample this worker's examples for step ``step`` (0-based) and return their clipped sum.

        Returns the flat float32 sum of the sampled examples' gradients at
        ``weights``, each clipped to ``clip_norm``, followed by one raw count:
        the examples left out for a non-finite gradient (see
        ``GradientWorker.clipped_grad_sum``). A retried call draws the same
        sample.
        """
        if self.windows is None:
            return self.clipped_grad_sum(weights, self._local_sample(step), clip_norm, count_zeroed=True)
        # The windows before this step's have all run (a retried step is this one): their folders go now.
        self.windows.done_with(step - 1)
        return self.clipped_grad_sum(weights, self._local_sample(step), clip_norm, count_zeroed=True,
                                     planned=self.windows.batch(step, 0), next_planned=self.windows.batch(step + 1, 0))

    def secure_start(self, round_: Round, scale: float, clip_bound: float,
                     registry: Sequence[bytes] | None) -> AdvertisedKeys:
        """Start `round_` as party ``shard_index``: two new X25519 key pairs; return their public keys, signed
        with this silo's identity when the silos have registered ones (`registry`).

        The identity's private key is read from the shard's
        ``identity_key_file`` on this node; the registry must hold its public
        key at this silo's number, and match this node's pin when it has one.
        Each coordinate of this silo's sum is bounded by `clip_bound` times
        the examples it holds, a Poisson batch's largest size.
        """
        identity = None
        if registry is not None:
            if self.shard.identity_key_file is None:
                raise ValueError(f"the silos have registered identities but shard {self.shard_index} names no "
                                 "identity_key_file on its node")
            identity = load_identity_key(self.shard.identity_key_file)
            check_registry(registry, self.shard_index, identity)
        self._secure = SiloParty(self.shard_index, round_, scale, clip_bound * self.train_size, self._rounds,
                                 identity, registry)
        return self._secure.advertise()

    def secure_share_keys(self, advertised: Mapping[int, AdvertisedKeys]) -> dict[int, bytes]:
        """Check the relayed keys; each peer's sealed box of this silo's shares (`SiloParty.share_keys`)."""
        return self._secure_party().share_keys(advertised)

    def secure_receive_shares(self, sealed: Mapping[int, bytes]) -> None:
        """Keep the shares the peers sealed for this silo (`SiloParty.receive_shares`)."""
        self._secure_party().receive_shares(sealed)

    def masked_clipped_grad_sum(
        self, weights: np.ndarray, step: int, clip_norm: float | LayerClipNorms, noise_variance: float = 0.0
    ) -> MaskedInput:
        """This silo's input for step ``step``: its clipped sum in fixed point, plus a discrete Gaussian share
        of variance at least `noise_variance` (ring units, per coordinate) when that is > 0, plus its masks.

        The noise is drawn from ChaCha20 under a fresh key from OS entropy,
        which no other process holds. The raw count of examples left out for
        a non-finite gradient stays here: it would go out un-noised and
        unmasked.
        """
        party = self._secure_party()
        if party.round.step != step:
            raise ValueError(f"the round was keyed for step {party.round.step}, not step {step}")
        clipped = self.sampled_clipped_grad_sum(weights, step, clip_norm)[:-1]
        noise = noise_share(RandomWords(), noise_variance, clipped.size) if noise_variance > 0 else None
        return party.masked(clipped, noise)

    def secure_reveal(self, request: UnmaskRequest) -> Revealed:
        """This silo's answer to the round's one unmasking request (`SiloParty.reveal`)."""
        return self._secure_party().reveal(request)

    def _secure_party(self) -> SiloParty:
        if self._secure is None:
            raise RuntimeError("secure_start must begin a round before shares or masked sums")
        return self._secure

    def _local_sample(self, step: int) -> np.ndarray:
        """Positions of this worker's examples in step ``step``'s Poisson sample, or its fixed-order slice (they
        never leave the worker)."""
        if self.sampling_rate is None:
            raise RuntimeError("set_sampling_rate must be called before the first step")
        if self._fixed_order is not None:
            fixed_order, order = self._fixed_order
            return silo_fixed_order_batch(order, step, fixed_order.steps_per_epoch)
        return local_poisson_sample(self._sampling_key, step, self.train_size, self.sampling_rate)


ShardWorkerActor = ray.remote(ShardWorker)
