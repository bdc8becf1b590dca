"""The secure aggregation core: fixed point on the ring, masks that cancel, Shamir shares, the round's rules.

Pure functions and the party state machines, without Ray: the attacks are in
tests/test_secure_attacks.py and the loopback cluster in
tests/test_secure_silos.py.
"""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from secagg_attacker import identities, keyed_round

from workers.secure_aggregation import (
    RoundHistory,
    SiloParty,
    check_no_wrap,
    check_round,
    combine_shares,
    decode,
    encode,
    expand_mask,
    fixed_point_scale,
    new_round,
    noise_tail_bound,
    parse_identity,
    ring_sum,
    split_secret,
    unmask_request,
    unmasked_total,
)
from workers.secure_aggregation.fixed_point import HALF_RING

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)
SCALE, BOUND = 2.0**30, 1e3



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




def play(parties=(0, 1, 2), threshold=2, step=7, sums=None, dropped=(), signed=False, histories=None):
    """One round to its end: keyed, the inputs of all but `dropped`, every survivor's answer; what the driver
    gets."""
    histories = histories or {party: RoundHistory() for party in parties}
    round_ = new_round(step, parties, threshold)
    silos, seen = keyed_round(round_, histories, SCALE, BOUND, signed=signed)
    sums = sums or {party: np.arange(5.0) * (party + 1) for party in parties}
    seen.inputs = [silos[party].masked(sums[party]) for party in parties if party not in dropped]
    request = unmask_request(round_, seen.inputs)
    seen.answers = [silos[party].reveal(request) for party in request.survivors]
    return silos, seen, sums


@settings(max_examples=15, deadline=None)
@given(parties=st.integers(2, 5), step=st.integers(0, 2**40), size=st.integers(1, 50), data=st.data())
def test_the_masks_cancel_in_the_total_and_each_input_looks_nothing_like_its_sum(parties, step, size, data):
    sums = {party: data.draw(arrays(np.float64, size, elements=st.floats(-100, 100))) for party in range(parties)}
    silos, seen, _ = play(tuple(range(parties)), parties // 2 + 1, step, sums)
    total = unmasked_total(seen.round, seen.relayed[0], seen.inputs, seen.answers, SCALE)
    assert np.abs(total - np.sum(list(sums.values()), axis=0)).max() <= parties / 2**31
    for message in seen.inputs:
        # The input decodes to values spread over the whole ring, not near the silo's sum (|x| ≤ 100).
        assert not np.allclose(decode(message.values, SCALE), sums[message.party], atol=1e3)


def test_masks_differ_by_stream_and_seed_and_are_uniform_on_the_ring():
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


def test_a_dropped_silos_masks_and_the_survivors_self_masks_come_out_of_the_survivors_total():
    silos, seen, sums = play((0, 1, 2, 3), threshold=3, dropped=(2,))
    total = unmasked_total(seen.round, seen.relayed[0], seen.inputs, seen.answers, SCALE)
    assert np.allclose(total, sums[0] + sums[1] + sums[3], atol=1e-8)
    assert seen.answers[0].request.dropped == (2,) and set(seen.answers[0].masking_shares) == {2}
    assert set(seen.answers[0].self_shares) == {0, 1, 3}
    with pytest.raises(ValueError, match="fewer than the threshold 3"):
        unmasked_total(seen.round, seen.relayed[0], seen.inputs, seen.answers[:2], SCALE)
    # Without the answers the survivors' ring sum is noise on the ring.
    assert not np.allclose(decode(ring_sum([message.values for message in seen.inputs]), SCALE),
                           sums[0] + sums[1] + sums[3], atol=1e3)


@pytest.mark.parametrize("parties, threshold", [(3, 1), (4, 2), (5, 2), (2, 1), (3, 4)])
def test_a_threshold_that_is_not_a_majority_is_refused_with_the_range(parties, threshold):
    with pytest.raises(ValueError, match=rf"must lie in {parties // 2 + 1}..{parties} for {parties} parties"):
        check_round(range(parties), threshold)


def test_a_silo_answers_one_request_per_round_and_never_names_a_silo_both_ways():
    histories = {party: RoundHistory() for party in range(4)}
    round_ = new_round(3, range(4), 3)
    silos, seen = keyed_round(round_, histories, SCALE, BOUND, signed=False)
    inputs = [silos[party].masked(np.ones(3)) for party in range(4)]
    honest = unmask_request(round_, inputs)
    both = type(honest)(honest.binding, (0, 1, 2, 3), (2,))
    with pytest.raises(ValueError, match=r"parties \[2\] are named both survivor and dropped"):
        silos[0].reveal(both)
    with pytest.raises(ValueError, match="fewer than the threshold 3"):
        silos[0].reveal(type(honest)(honest.binding, (0, 1), (2, 3)))
    with pytest.raises(ValueError, match="bound to another round"):
        silos[0].reveal(type(honest)(new_round(3, range(4), 3).binding(), honest.survivors, honest.dropped))
    with pytest.raises(ValueError, match="reveals only as a survivor"):
        silos[3].reveal(type(honest)(honest.binding, (0, 1, 2), (3,)))
    silos[0].reveal(honest)
    with pytest.raises(ValueError, match="already answered this round's request"):
        silos[0].reveal(type(honest)(honest.binding, (0, 1, 3), (2,)))
    with pytest.raises(RuntimeError, match="takes no more inputs"):
        silos[0].masked(np.ones(3))


def test_a_silo_sends_one_input_per_step_and_refuses_a_replayed_or_earlier_round():
    histories = {party: RoundHistory() for party in range(3)}
    round_ = new_round(5, range(3), 2)
    silos, _ = keyed_round(round_, histories, SCALE, BOUND, signed=False)
    silos[0].masked(np.ones(3))
    with pytest.raises(ValueError, match="already sent its input for step 5"):
        silos[0].masked(np.ones(3))
    with pytest.raises(ValueError, match="step 5 is not after step 5"):
        SiloParty(0, new_round(5, range(3), 2), SCALE, BOUND, histories[0])
    with pytest.raises(ValueError, match="context was keyed before"):
        SiloParty(1, round_, SCALE, BOUND, histories[1])
    SiloParty(0, new_round(6, range(3), 2), SCALE, BOUND, histories[0])


def test_a_tampered_box_or_keys_swapped_on_the_way_to_their_maker_are_refused():
    histories = {party: RoundHistory() for party in range(3)}
    round_ = new_round(0, range(3), 2)
    silos = {party: SiloParty(party, round_, SCALE, BOUND, histories[party]) for party in range(3)}
    advertised = {party: silo.advertise() for party, silo in silos.items()}
    boxes = {party: silo.share_keys(advertised) for party, silo in silos.items()}
    altered = boxes[1][0][:-1] + bytes([boxes[1][0][-1] ^ 1])
    with pytest.raises(ValueError, match="from party 1 does not open"):
        silos[0].receive_shares({1: altered, 2: boxes[2][0]})
    other = SiloParty(0, new_round(0, range(3), 2), SCALE, BOUND, RoundHistory())
    with pytest.raises(ValueError, match="not the ones it made"):
        other.share_keys(advertised)


def test_the_silos_noise_goes_in_before_the_masks_and_comes_out_in_the_total():
    histories = {party: RoundHistory() for party in range(3)}
    round_ = new_round(7, range(3), 2)
    silos, seen = keyed_round(round_, histories, 2.0**10, 100.0, signed=False)
    noise = {party: np.array([-3, 0, 5, 2**40], dtype=np.int64) * (party + 1) for party in range(3)}
    seen.inputs = [silos[party].masked(np.full(4, float(party)), noise[party]) for party in range(3)]
    request = unmask_request(round_, seen.inputs)
    answers = [silos[party].reveal(request) for party in range(3)]
    total = unmasked_total(round_, seen.relayed[0], seen.inputs, answers, 2.0**10)
    assert np.array_equal(total, 3.0 + np.sum(list(noise.values()), axis=0) / 2.0**10)


def test_a_silo_party_and_a_share_keep_their_secrets_out_of_reprs_and_pickles():
    silos, _, _ = play()
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(silos[1])
    assert "hidden" in repr(silos[1]) and "y=<hidden>" in repr(split_secret(bytes(32), 2, 2)[0])


def test_the_ring_bound_counts_the_noise():
    scale, value_bound = 2.0**20, 2.0**40
    check_no_wrap(scale, value_bound, 3)
    with pytest.raises(ValueError, match="noise up to .* wraps the ring"):
        check_no_wrap(scale, value_bound, 3, noise_tail_bound(2.0**122, 10**6))
    # The subgaussian tail: √(2v·ln(2d / 2^-40)), far beyond the noise's std.
    assert noise_tail_bound(4.0, 10**6) == pytest.approx(np.sqrt(8 * np.log(2 * 10**6 * 2.0**40)))


SHARDS = [{"dataset": "mnist", "part": part, "parts": 3, "resources": {f"silo-{part}": 1}} for part in range(3)]
FOUR = [{"dataset": "mnist", "part": part, "parts": 4, "resources": {f"silo-{part}": 1}} for part in range(4)]
KEY = "ab" * 32


@pytest.mark.parametrize("values, message", [
    (dict(secure_aggregation=True), "runs only in silo mode with two or more shards"),
    (dict(secure_aggregation=True, shards=SHARDS[:1]), r"two or more shards \(got 1\)"),
    (dict(secure_aggregation=True, shards=[{**SHARDS[0], "workers": 2}, *SHARDS[1:]]),
     r"shards \[0\] have more: give each shard workers = 1"),
    (dict(secure_aggregation=True, shards=SHARDS, mask_share_threshold=4),
     r"must be a majority of the 3 silos, in 2..3 \(got 4\)"),
    (dict(secure_aggregation=True, shards=FOUR, mask_share_threshold=2),
     r"must be a majority of the 4 silos, in 3..4 \(got 2\).*set it to 3 or more"),
    (dict(shards=SHARDS, mask_share_threshold=2), "applies only with secure_aggregation = true"),
    (dict(shards=SHARDS, noise_placement="silos"), "set secure_aggregation = true"),
    (dict(secure_aggregation=True, shards=SHARDS, noise_placement="silos", microbatch_size=4),
     "cannot be combined with microbatch_size"),
    (dict(secure_aggregation=True, shards=[{**SHARDS[0], "identity": KEY, "identity_key_file": "/k"}, *SHARDS[1:]]),
     r"shards \[1, 2\] have no `identity` while the others have one"),
    (dict(secure_aggregation=True, shards=[{**shard, "identity": KEY} for shard in SHARDS]),
     r"shards \[0, 1, 2\] give only one of `identity` and `identity_key_file`"),
    (dict(secure_aggregation=True, shards=[{**shard, "identity": "nope", "identity_key_file": "/k"}
                                           for shard in SHARDS]),
     r"shard 0: a silo identity is its Ed25519 public key as 64 hex digits"),
    (dict(shards=[{**shard, "identity": KEY, "identity_key_file": "/k"} for shard in SHARDS]),
     "sign secure aggregation's round keys; set secure_aggregation = true or remove them"),
])
def test_secure_aggregation_outside_silo_mode_or_with_a_bad_threshold_or_identity_is_refused_with_the_reason(
        values, message):
    from orchestrator.config import build_config
    from orchestrator.errors import UsageError
    with pytest.raises(UsageError, match=message):
        build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, **values})


def test_the_threshold_defaults_to_a_majority_of_the_silos_and_identities_may_be_files(tmp_path):
    from orchestrator.config import build_config
    config = build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, "shards": FOUR,
                           "secure_aggregation": True})
    assert config.mask_share_threshold == 3 and config.noise_placement == "driver"
    keys, registry = identities(range(3))
    files = []
    for party, public in enumerate(registry):
        (tmp_path / f"{party}.pub").write_text(public.hex() + "\n")
        files.append(str(tmp_path / f"{party}.pub"))
    config = build_config({"model": "gdp_cnn", "noise_multiplier": 1.0, "steps": 2, "secure_aggregation": True,
                           "shards": [{**shard, "identity": path, "identity_key_file": "/on/the/silo"}
                                      for shard, path in zip(SHARDS, files)]})
    assert [parse_identity(shard.identity) for shard in config.shards] == registry


def test_an_identity_key_file_is_made_private_and_the_registry_is_checked_against_it_and_the_nodes_pin(
        tmp_path, capsys, monkeypatch):
    from workers.secure_aggregation import (
        REGISTRY_PIN_VARIABLE,
        check_registry,
        load_identity_key,
        public_identity,
        registry_digest,
    )
    from workers.secure_aggregation.identity import main
    path = tmp_path / "silo-a.key"
    assert main([str(path)]) == 0
    key = load_identity_key(str(path))
    assert bytes.fromhex(capsys.readouterr().out.strip()) == public_identity(key)
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        main([str(path)])
    _, others = identities(range(2))
    registry = [public_identity(key), *others]
    check_registry(registry, 0, key)
    with pytest.raises(ValueError, match="identity of silo 1 is not the one whose private key this node holds"):
        check_registry(registry, 1, key)
    monkeypatch.setenv(REGISTRY_PIN_VARIABLE, registry_digest(registry))
    check_registry(registry, 0, key)
    with pytest.raises(ValueError, match="not the one this node pins"):
        check_registry([public_identity(key), *reversed(others)], 0, key)
