"""The driver's side of secure aggregation in silo mode: relay the keys, add the masked sums, unmask past dropouts.

The driver learns the silos' public keys, their sealed shares (which it
cannot open), and each step the masked fixed-point sums, whose ring total is
the only thing that decodes to anything: the sum of the silos that answered.
When a silo is lost during a step, the survivors reveal their shares of its
key, and its pairs' masks are taken out of the survivors' total; the lost
silo's sum counts as zero for that step. Every step has a keying round of its
own: were a round's keys kept for several steps, a key rebuilt after a loss
would also unmask that silo's parts of the round's earlier steps. The pure
protocol is ``workers.secure_aggregation``; docs/silos.md has the threat model.

With the noise in the silos (`place_noise_in_silos`), the scale is the
Skellam scale and each silo adds its share of integer noise before masking:
the total the driver unmasks is already noisy, and the driver adds none.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import ray

from orchestrator.errors import ShardTimeoutError
from workers.secure_aggregation import (
    MAX_SKELLAM_VARIANCE,
    check_no_wrap,
    check_round,
    fixed_point_scale,
    new_context,
    noise_tail_bound,
    skellam_scale,
    unmasked_total,
)

Slot = tuple[int, int]


class SecureAggregation:
    """The keying rounds and the unmasking of one run's secure aggregation over `silos` silos.

    `clip_bound` bounds one example's contribution to a coordinate (the
    clip norm, or the total of the per-layer norms) and `dataset_size` is N,
    the examples of all silos together: no step's total can exceed
    clip_bound * N in a coordinate, which sets the fixed-point scale
    (checked not to wrap the ring at start). `threshold` is how many shares
    rebuild a lost silo's key.
    """

    def __init__(self, silos: int, threshold: int, clip_bound: float, dataset_size: int):
        self.silos, self.threshold, self.clip_bound = silos, threshold, clip_bound
        self.value_bound = clip_bound * dataset_size
        self.scale = fixed_point_scale(self.value_bound, silos)
        self.keyed: dict[Slot, ray.actor.ActorHandle] = {}
        self.context = b""
        self.public_keys: dict[int, bytes] = {}
        # With the noise in the silos: how many silos' shares may be missing or known (None: the driver adds it).
        self.noise_share_tolerance: int | None = None

    def place_noise_in_silos(self, coordinates: int, largest_noise_multiplier: float, tolerance: int,
                             rounding_ratio: float) -> None:
        """Have each silo add a share of Skellam noise: the scale becomes the Skellam scale (√d ≤ r·s·C), checked
        at start not to wrap the ring with the noise of every silo (`largest_noise_multiplier` the run's largest σ)
        included.

        Each silo's share has variance (σ·s·C)² / (silos − `tolerance`), so
        the shares of any silos − tolerance silos add up to the target.
        """
        if not 0 <= tolerance < self.silos:
            raise ValueError(f"the noise share tolerance must lie in 0..{self.silos - 1} (got {tolerance})")
        self.scale = skellam_scale(self.clip_bound, coordinates, rounding_ratio)
        self.noise_share_tolerance = tolerance
        share = self.noise_share_variance(largest_noise_multiplier)
        if share >= MAX_SKELLAM_VARIANCE:
            raise ValueError(f"each silo's Skellam share would have variance {share:.3g}, beyond what the sampler "
                             f"draws ({MAX_SKELLAM_VARIANCE:.3g}); lower noise_multiplier or the model's size")
        check_no_wrap(self.scale, self.value_bound, self.silos, noise_tail_bound(self.silos * share, coordinates))

    def noise_share_variance(self, noise_multiplier: float) -> float:
        """The per-coordinate variance (ring units) of each silo's noise share at `noise_multiplier`; 0 when the
        driver adds the noise."""
        if self.noise_share_tolerance is None:
            return 0.0
        return (noise_multiplier * self.scale * self.clip_bound) ** 2 / (self.silos - self.noise_share_tolerance)

    def decoding_error(self, silos: int) -> float:
        """The most that fixed-point rounding moves one coordinate of a total over `silos` silos."""
        return silos / (2 * self.scale)

    def key(self, actors: Mapping[Slot, ray.actor.ActorHandle]) -> None:
        """Run a keying round among `actors` (one per silo): relay their public keys, then their sealed shares.

        A silo lost during the round raises ``ray.exceptions.RayActorError``;
        the caller handles the loss and keys the silos that are left.
        """
        parties = sorted(shard for shard, _ in actors)
        if len(parties) < self.threshold:
            raise ShardTimeoutError(f"only {len(parties)} silos are up; secure aggregation needs "
                                    f"mask_share_threshold = {self.threshold} to run a step")
        check_round(parties, self.threshold)
        self.keyed, self.context = {}, new_context()
        by_party = {shard: actor for (shard, _), actor in actors.items()}
        keys = ray.get([actor.secure_start.remote(self.context, parties, self.threshold, self.scale,
                                                  self.clip_bound) for actor in by_party.values()])
        self.public_keys = dict(zip(by_party, keys))
        sealed = dict(zip(by_party, ray.get([actor.secure_sealed_shares.remote(self.public_keys)
                                             for actor in by_party.values()])))
        ray.get([actor.secure_receive_shares.remote({sender: boxes[receiver] for sender, boxes in sealed.items()
                                                     if sender != receiver})
                 for receiver, actor in by_party.items()])
        self.keyed = dict(actors)

    def total(self, masked_parts: list[np.ndarray], dropped: list[Slot], step: int, size: int) -> np.ndarray:
        """The float64 sum of the silos that answered step `step`: the masked parts added, dropped masks removed.

        With silos dropped, the survivors reveal their shares of the dropped
        silos' keys (`revealed_shares`); fewer than the threshold of shares
        stops the run (ShardTimeoutError), and the next step keys afresh.
        """
        revealed = self.revealed_shares(dropped, step) if dropped else []
        dropped_shares = {shard: [shares[shard] for shares in revealed] for shard, _ in dropped}
        total = unmasked_total(masked_parts, dropped_shares, self.public_keys, self.threshold, self.context, step,
                               self.scale)
        # One round per step: a key rebuilt later must not unmask this step's parts (see the module's docstring).
        self.keyed = {}
        return total

    def revealed_shares(self, dropped: list[Slot], step: int) -> list[dict[int, bytes]]:
        """Each survivor's shares of the `dropped` silos' keys; a survivor lost meanwhile gives none."""
        survivors = [actor for slot, actor in self.keyed.items() if slot not in dropped]
        dropped_parties = [shard for shard, _ in dropped]
        revealed = []
        for answer in [actor.secure_reveal_shares.remote(dropped_parties) for actor in survivors]:
            try:
                revealed.append(ray.get(answer))
            except ray.exceptions.RayActorError:
                continue
        if len(revealed) < self.threshold:
            raise ShardTimeoutError(
                f"step {step + 1}: {len(revealed)} silos revealed shares of the lost silos' keys, fewer than "
                f"mask_share_threshold = {self.threshold}: the survivors' sum cannot be unmasked")
        return revealed
