"""Secure aggregation of silo sums: fixed point on Z_2^64, X25519 pairwise masks, Shamir-shared keys for dropouts."""

from workers.secure_aggregation.fixed_point import (
    MAX_SKELLAM_VARIANCE,
    RING_BITS,
    check_no_wrap,
    decode,
    encode,
    fixed_point_scale,
    noise_tail_bound,
    ring_sum,
    skellam_scale,
    skellam_share,
)
from workers.secure_aggregation.masks import expand_mask, pair_secrets
from workers.secure_aggregation.protocol import (
    SiloParty,
    check_round,
    dropped_masks,
    new_context,
    recover_private_key,
    unmasked_total,
)
from workers.secure_aggregation.shamir import Share, combine_shares, split_secret

__all__ = [
    "MAX_SKELLAM_VARIANCE",
    "RING_BITS",
    "Share",
    "SiloParty",
    "check_no_wrap",
    "check_round",
    "combine_shares",
    "decode",
    "dropped_masks",
    "encode",
    "expand_mask",
    "fixed_point_scale",
    "new_context",
    "noise_tail_bound",
    "pair_secrets",
    "recover_private_key",
    "ring_sum",
    "skellam_scale",
    "skellam_share",
    "split_secret",
    "unmasked_total",
]
