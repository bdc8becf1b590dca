"""The driver's side of secure aggregation in silo mode: relay each round's messages, unmask the survivors' total.

Every step has a round of its own (``workers.secure_aggregation.protocol``):
the driver relays the silos' signed public keys and their sealed boxes of
shares (which it cannot open), adds the masked inputs that arrive, and sends
the one unmasking request of the round; from the survivors' answers it takes
out their self-masks and the masks of their pairs with the silos that
dropped. What it learns is the survivors' total; docs/silos.md has what each
party sees and the collusion bounds.

With the noise in the silos (`place_noise_in_silos`), the scale is the silo
noise's scale and each silo adds a discrete Gaussian share of the whole
target variance before masking: a step may lose all but t silos and t − 1
of those may collude with the driver, so one honest silo's share must carry
the target alone. The total the driver unmasks is already noisy; it adds
none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import ray

from orchestrator.errors import ShardTimeoutError
from workers.secure_aggregation import (
    MAX_DISCRETE_GAUSSIAN_VARIANCE,
    MaskedInput,
    Revealed,
    UnmaskRequest,
    check_no_wrap,
    check_round,
    fixed_point_scale,
    new_round,
    noise_scale_for,
    noise_tail_bound,
    silo_noise_scale,
    unmask_request,
    unmasked_total,
)

Slot = tuple[int, int]


class SecureAggregation:
    """The rounds and the unmasking of one run's secure aggregation over `silos` silos.

    `clip_bound` bounds one example's contribution to a coordinate (the
    clip norm, or the total of the per-layer norms) and `dataset_size` is N,
    the examples of all silos together: no step's total can exceed
    clip_bound * N in a coordinate, which sets the fixed-point scale
    (checked not to wrap the ring at start). `threshold` t (a majority) is
    how many shares rebuild a secret. `registry` holds every silo's
    Ed25519 public identity, by silo number, or is None (the driver is then
    trusted to relay the keys as the silos made them).
    """

    def __init__(self, silos: int, threshold: int, clip_bound: float, dataset_size: int,
                 registry: Sequence[bytes] | None = None):
        check_round(range(silos), threshold)
        self.silos, self.threshold, self.clip_bound = silos, threshold, clip_bound
        self.registry = None if registry is None else tuple(registry)
        self.value_bound = clip_bound * dataset_size
        self.scale = fixed_point_scale(self.value_bound, silos)
        self.keyed: dict[Slot, ray.actor.ActorHandle] = {}
        self.round = None
        # What the driver relayed in the current round: the advertised keys and the sealed boxes (sender → receiver).
        self.advertised: dict = {}
        self.boxes: dict = {}
        self.noise_in_silos = False

    def place_noise_in_silos(self, coordinates: int, largest_noise_multiplier: float, rounding_ratio: float) -> None:
        """Have each silo add a discrete Gaussian share of std σ·s·C: the scale becomes the silo noise's scale
        (√d ≤ r·s·C), checked at start not to wrap the ring with every silo's noise at the run's largest σ."""
        self.scale = silo_noise_scale(self.clip_bound, coordinates, rounding_ratio)
        self.noise_in_silos = True
        share = self.noise_share_variance(largest_noise_multiplier)
        if share > MAX_DISCRETE_GAUSSIAN_VARIANCE:
            raise ValueError(f"each silo's noise share would have variance {share:.3g}, beyond what the exact "
                             f"sampler draws ({MAX_DISCRETE_GAUSSIAN_VARIANCE:.3g}); lower noise_multiplier or the "
                             "model's size")
        check_no_wrap(self.scale, self.value_bound, self.silos,
                      noise_tail_bound(self.silos * noise_scale_for(share) ** 2, coordinates))

    def noise_share_variance(self, noise_multiplier: float) -> float:
        """The per-coordinate variance (ring units) each silo's share must have at `noise_multiplier`: the whole
        (σ·s·C)²; 0 when the driver adds the noise."""
        if not self.noise_in_silos:
            return 0.0
        return (noise_multiplier * self.scale * self.clip_bound) ** 2

    def decoding_error(self, silos: int) -> float:
        """The most that fixed-point rounding moves one coordinate of a total over `silos` silos."""
        return silos / (2 * self.scale)

    def key(self, actors: Mapping[Slot, ray.actor.ActorHandle], step: int) -> None:
        """Run step `step`'s keying among `actors` (one per silo): relay the advertised keys, then the boxes.

        A silo lost during the keying raises ``ray.exceptions.RayActorError``;
        the caller handles the loss and keys the silos that are left. Fewer
        silos than the threshold stop the run (ShardTimeoutError).
        """
        parties = sorted(shard for shard, _ in actors)
        if len(parties) < self.threshold:
            raise ShardTimeoutError(f"only {len(parties)} silos are up; secure aggregation needs "
                                    f"mask_share_threshold = {self.threshold} of them to run a step")
        self.keyed, self.round = {}, new_round(step, parties, self.threshold)
        by_party = {shard: actor for (shard, _), actor in actors.items()}
        advertised = ray.get([actor.secure_start.remote(self.round, self.scale, self.clip_bound, self.registry)
                              for actor in by_party.values()])
        self.advertised = dict(zip(by_party, advertised))
        self.boxes = dict(zip(by_party, ray.get([actor.secure_share_keys.remote(self.advertised)
                                                 for actor in by_party.values()])))
        ray.get([actor.secure_receive_shares.remote({sender: boxes[receiver] for sender, boxes in self.boxes.items()
                                                     if sender != receiver})
                 for receiver, actor in by_party.items()])
        self.keyed = dict(actors)

    def total(self, inputs: list[MaskedInput], step: int) -> np.ndarray:
        """The float64 sum of the silos whose inputs arrived for step `step`, from the survivors' answers to the
        round's one request.

        Fewer than the threshold of survivors, or of answers, abort the step
        (ShardTimeoutError): nothing of it is released, and the next step
        keys afresh.
        """
        request = unmask_request(self.round, inputs)
        if len(request.survivors) < self.threshold:
            raise ShardTimeoutError(
                f"step {step + 1}: {len(request.survivors)} silos sent their input, fewer than mask_share_threshold "
                f"= {self.threshold}: the step is aborted, its sum is not unmasked")
        answers = self.answers(request)
        if len(answers) < self.threshold:
            raise ShardTimeoutError(
                f"step {step + 1}: {len(answers)} silos answered the unmasking request, fewer than "
                f"mask_share_threshold = {self.threshold}: the step is aborted, its sum is not unmasked")
        return unmasked_total(self.round, self.advertised, inputs, answers, self.scale, self.registry)

    def answers(self, request: UnmaskRequest) -> list[Revealed]:
        """Each surviving silo's answer to the round's one `request`; a silo lost meanwhile gives none. Nothing
        of the round is used afterwards."""
        survivors = [actor for (shard, _), actor in self.keyed.items() if shard in request.survivors]
        answers = []
        for answer in [actor.secure_reveal.remote(request) for actor in survivors]:
            try:
                answers.append(ray.get(answer))
            except ray.exceptions.RayActorError:
                continue
        self.keyed = {}
        return answers
