"""The secure aggregation core: fixed point on the ring, masks that cancel, Shamir shares and dropout recovery.

Pure functions and the party state machine, without Ray: the loopback
cluster tests are in tests/test_secure_silos.py.
"""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from workers.secure_aggregation import (
    SiloParty,
    check_no_wrap,
    combine_shares,
    decode,
    dropped_masks,
    encode,
    expand_mask,
    fixed_point_scale,
    new_context,
    recover_private_key,
    ring_sum,
    noise_tail_bound,
    split_secret,
    unmasked_total,
)
from workers.secure_aggregation.fixed_point import HALF_RING

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@given(parts=st.lists(arrays(np.float64, 7, elements=finite), min_size=1, max_size=6),
       extra=st.floats(0, 1e6))
def test_the_ring_sum_decodes_to_the_float_sum_within_the_stated_error(parts, extra):
    # Every coordinate of every part lies within ±1e3, so the total within ±1e3 per party (plus slack).
    bound = 1e3 * len(parts) + extra
    scale = fixed_point_scale(bound, len(parts))
    total = decode(ring_sum([encode(part, scale, bound) for part in parts]), scale)
    exact = np.sum(parts, axis=0)
    # Rounding costs 1/(2 scale) per party; the float64 decode of a value near the bound costs its ulp.
    assert np.abs(total - exact).max() <= len(parts) / (2 * scale) + 4 * np.spacing(bound)


def test_the_scale_is_the_largest_power_of_two_that_cannot_wrap_and_a_larger_one_is_refused():
    bound, parties = 60_000 * 1.5, 3
    scale = fixed_point_scale(bound, parties)
    assert scale == 2.0**45 and bound * scale < HALF_RING / 2
    check_no_wrap(scale, bound, parties)
    with pytest.raises(ValueError, match=r"wraps the ring Z_2\^64 .* lower the scale"):
        check_no_wrap(scale * 2**18, bound, parties)


def test_the_extreme_sum_of_all_parties_at_the_bound_does_not_wrap():
    bound, parties = 90_000.0, 3
    scale = fixed_point_scale(bound, parties)
    parts = [np.full(4, bound / parties), np.full(4, bound / parties), np.full(4, bound / parties)]
    assert decode(ring_sum([encode(-part, scale, bound) for part in parts]), scale) == pytest.approx(-bound)
    assert decode(ring_sum([encode(part, scale, bound) for part in parts]), scale) == pytest.approx(bound)


def test_a_value_beyond_the_bound_or_not_finite_is_refused_before_it_can_wrap():
    with pytest.raises(ValueError, match="outside ±10"):
        encode(np.array([0.0, 10.5]), 2.0**20, 10.0)
    with pytest.raises(ValueError, match="not finite"):
        encode(np.array([np.nan]), 2.0**20, 10.0)


def keyed_round(parties=(0, 1, 2), threshold=2, scale=2.0**30, value_bound=1e3):
    """The parties of one finished keying round, the driver's relay played by this function."""
    context = new_context()
    silos = {party: SiloParty(party, parties, threshold, context, scale, value_bound) for party in parties}
    public_keys = {party: silo.public_key() for party, silo in silos.items()}
    sealed = {party: silo.sealed_shares(public_keys) for party, silo in silos.items()}
    for receiver, silo in silos.items():
        silo.receive_shares({sender: boxes[receiver] for sender, boxes in sealed.items() if sender != receiver})
    return silos, public_keys, context


@settings(max_examples=20, deadline=None)
@given(parties=st.integers(2, 5), step=st.integers(0, 2**40), size=st.integers(1, 50), data=st.data())
def test_the_pairwise_masks_cancel_in_the_sum_and_each_masked_part_looks_nothing_like_its_sum(parties, step, size,
                                                                                                data):
    silos, _, _ = keyed_round(tuple(range(parties)), threshold=2)
    sums = [data.draw(arrays(np.float64, size, elements=st.floats(-100, 100))) for _ in range(parties)]
    masked = [silos[party].masked(sums[party], step) for party in range(parties)]
    assert np.abs(decode(ring_sum(masked), 2.0**30) - np.sum(sums, axis=0)).max() <= parties / 2**31
    for party, part in enumerate(masked):
        # The masked part decodes to values spread over the whole ring, not near the silo's sum (|x| ≤ 100).
        assert not np.allclose(decode(part, 2.0**30), sums[party], atol=1e3)


def test_masks_differ_by_step_and_pair_and_are_uniform_on_the_ring():
    a, b = expand_mask(bytes(32), 0, 100_000), expand_mask(bytes(32), 1, 100_000)
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, expand_mask(b"\1" + bytes(31), 0, 100_000))
    # Each of the 64 bits is set in half the values (± 5 standard errors).
    bits = np.unpackbits(a.view(np.uint8)).mean()
    assert abs(bits - 0.5) < 5 * 0.5 / np.sqrt(64 * 100_000)


@settings(max_examples=30, deadline=None)
@given(shares=st.integers(2, 8), data=st.data())
def test_shamir_recovers_from_any_t_shares_and_not_from_t_minus_one(shares, data):
    threshold = data.draw(st.integers(2, shares))
    secret = data.draw(st.binary(min_size=32, max_size=32))
    pieces = split_secret(secret, shares, threshold)
    chosen = data.draw(st.permutations(pieces))[:threshold]
    assert combine_shares(chosen) == secret
    fewer = chosen[:threshold - 1]
    try:
        assert combine_shares(fewer) != secret
    except ValueError:
        pass  # the t - 1 shares interpolate to a value that is not even 32 bytes long


def test_t_minus_one_shares_fit_every_secret_alike():
    """Two secrets' shares at t - 1 points are equally likely: the first share alone is uniform on the field."""
    from workers.secure_aggregation.shamir import PRIME
    firsts = [split_secret(bytes(32), 3, 2)[0].y for _ in range(200)]
    others = [split_secret(b"\xff" * 32, 3, 2)[0].y for _ in range(200)]
    # Both spread over the whole field (a share that leaked its secret would sit near it).
    for ys in (firsts, others):
        assert 0.3 < np.mean(ys) / PRIME < 0.7 and max(ys) > 2**500


def test_a_dropped_partys_masks_are_rebuilt_from_t_shares_and_the_survivors_sum_unmasks():
    silos, public_keys, context = keyed_round((0, 1, 2, 3), threshold=2)
    sums = {party: np.arange(5.0) * (party + 1) for party in silos}
    survivors = {0: silos[0], 1: silos[1], 3: silos[3]}  # party 2 dropped after the keys were agreed
    masked = [silo.masked(sums[party], 7) for party, silo in survivors.items()]
    revealed = [silo.reveal_shares([2])[2] for silo in survivors.values()]
    private_key = recover_private_key(revealed[:2], public_keys[2], threshold=2)
    total = ring_sum(masked) - dropped_masks(private_key, 2, {party: public_keys[party] for party in survivors},
                                             context, 7, 5)
    assert np.allclose(decode(total, 2.0**30), sums[0] + sums[1] + sums[3], atol=1e-8)
    with pytest.raises(ValueError, match="needs 2 shares"):
        recover_private_key(revealed[:1], public_keys[2], threshold=2)
    # Without the recovery the survivors' sum is noise on the ring.
    assert not np.allclose(decode(ring_sum(masked), 2.0**30), sums[0] + sums[1] + sums[3], atol=1e3)


def test_a_tampered_share_or_sealed_box_is_refused():
    silos, public_keys, context = keyed_round()
    revealed = [silos[1].reveal_shares([0])[0], silos[2].reveal_shares([0])[0]]
    altered = revealed[0][:-1] + bytes([revealed[0][-1] ^ 1])
    with pytest.raises(ValueError, match="do not rebuild"):
        recover_private_key([altered, revealed[1]], public_keys[0], threshold=2)
    fresh, keys, _ = keyed_round()
    other = SiloParty(0, (0, 1, 2), 2, context, 2.0**30, 1e3)
    with pytest.raises(ValueError, match="as it made it"):
        other.sealed_shares(keys)


def test_a_party_that_revealed_shares_masks_no_more_and_never_reveals_itself_or_leaves_memory():
    silos, _, _ = keyed_round()
    with pytest.raises(ValueError, match="reveals shares of its peers only"):
        silos[0].reveal_shares([0])
    silos[0].reveal_shares([1])
    with pytest.raises(RuntimeError, match="start a new keying round"):
        silos[0].masked(np.zeros(3), 0)
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(silos[1])
    assert "hidden" in repr(silos[1]) and "y=<hidden>" in repr(split_secret(bytes(32), 2, 2)[0])


SHARDS = [{"dataset": "mnist", "part": part, "parts": 3, "resources": {f"silo-{part}": 1}} for part in range(3)]


@pytest.mark.parametrize("values, message", [
    (dict(secure_aggregation=True), "runs only in silo mode with two or more shards"),
    (dict(secure_aggregation=True, shards=SHARDS[:1]), r"two or more shards \(got 1\)"),
    (dict(secure_aggregation=True, shards=[{**SHARDS[0], "workers": 2}, *SHARDS[1:]]),
     r"shards \[0\] have more: give each shard workers = 1"),
    (dict(secure_aggregation=True, shards=SHARDS, mask_share_threshold=4), r"must lie in 2..3 .* got 4"),
    (dict(shards=SHARDS, mask_share_threshold=2), "applies only with secure_aggregation = true"),
    (dict(shards=SHARDS, noise_placement="silos"), "set secure_aggregation = true"),
    (dict(secure_aggregation=True, shards=SHARDS, noise_share_tolerance=1), 'only with noise_placement = "silos"'),
    (dict(secure_aggregation=True, shards=SHARDS, noise_placement="silos", noise_share_tolerance=0),
     r"must lie in 1..2: at least the 1 silos a step may lose .*got 0"),
    (dict(secure_aggregation=True, shards=SHARDS, noise_placement="silos", noise_share_tolerance=3),
     r"must lie in 1..2"),
    (dict(secure_aggregation=True, shards=SHARDS, noise_placement="silos", microbatch_size=4),
     "cannot be combined with microbatch_size"),
])
def test_secure_aggregation_outside_silo_mode_or_with_a_bad_threshold_is_refused_with_the_reason(values, message):
    from orchestrator.config import build_config
    from orchestrator.errors import UsageError
    with pytest.raises(UsageError, match=message):
        build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, **values})


def test_the_threshold_defaults_to_a_majority_of_the_silos():
    from orchestrator.config import build_config
    config = build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, "shards": SHARDS,
                           "secure_aggregation": True})
    assert config.mask_share_threshold == 2


def test_the_noise_share_tolerance_defaults_to_the_dropouts_a_step_survives():
    from orchestrator.config import build_config
    config = build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, "shards": SHARDS,
                           "secure_aggregation": True, "noise_placement": "silos"})
    assert (config.mask_share_threshold, config.noise_share_tolerance) == (2, 1)
    assert build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, "shards": SHARDS,
                         "secure_aggregation": True}).noise_placement == "driver"


def test_skellam_noise_shares_go_in_before_the_masks_and_come_out_in_the_total():
    context, parties = new_context(), [0, 1, 2]
    silos = [SiloParty(party, parties, 2, context, 2.0**10, 100.0) for party in parties]
    keys = {silo.party: silo.public_key() for silo in silos}
    sealed = {silo.party: silo.sealed_shares(keys) for silo in silos}
    for silo in silos:
        silo.receive_shares({sender: boxes[silo.party] for sender, boxes in sealed.items() if sender != silo.party})
    values = [np.full(4, float(party)) for party in parties]
    noise = [np.array([-3, 0, 5, 2**40], dtype=np.int64) * (party + 1) for party in parties]
    parts = [silo.masked(value, 7, share) for silo, value, share in zip(silos, values, noise)]
    total = unmasked_total(parts, {}, keys, 2, context, 7, 2.0**10)
    assert np.array_equal(total, 3.0 + np.sum(noise, axis=0) / 2.0**10)


def test_the_ring_bound_counts_the_noise():
    scale, value_bound = 2.0**20, 2.0**40
    check_no_wrap(scale, value_bound, 3)
    with pytest.raises(ValueError, match="noise up to .* wraps the ring"):
        check_no_wrap(scale, value_bound, 3, noise_tail_bound(2.0**122, 10**6))
    # Bernstein's bound: √(2Lv) + 2L/3 with L = ln(2·d / 2^-40), far beyond the noise's std.
    level = np.log(2 * 10**6 * 2.0**40)
    assert noise_tail_bound(4.0, 10**6) == pytest.approx(np.sqrt(8 * level) + 2 * level / 3)

