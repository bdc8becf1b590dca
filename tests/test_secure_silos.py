"""Secure aggregation on a real Ray cluster on loopback: three silo nodes, one silo each, the driver on the head.

What reaches the driver is recorded and played against: no masked part, nor
any sum of some of them, decodes to those silos' sums; only the total does.
A silo's actor is killed after its keys were agreed, and its masks are
rebuilt from the others' shares. Nodes are real Ray nodes (never a mocked Ray).
"""

import io
from itertools import combinations

import numpy as np
import pytest
import ray
from servers import start_loopback_cluster, stop_loopback_cluster

from orchestrator.config import build_config
from orchestrator.shard_fleet import ShardFleet
from orchestrator.trainer import Trainer
from workers.models import build_model, flat_parameters
from accounting.accountants import SKELLAM_LABEL
from accounting.skellam import SILO_NOISE_ROUNDING_RATIO
from workers.secure_aggregation import decode, dropped_masks, recover_private_key, ring_sum

SILOS = ("silo-a", "silo-b", "silo-c")
SAMPLING_RATE = 0.002


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs and one 1-CPU node per silo."""
    cluster, added = start_loopback_cluster([dict(num_cpus=1, resources={silo: 1}) for silo in SILOS])
    yield cluster, dict(zip(SILOS, added))
    stop_loopback_cluster(cluster)


def silo_config(tmp_path, name, **overrides):
    values = dict(
        model="gdp_cnn", steps=4, batch_size=120, test_subset=100, noise_multiplier=1.0, clip_norm=1.0,
        learning_rate=0.5, seed=5, run_dir=str(tmp_path / name), max_physical_batch=64, dataset_name=name,
        on_shard_loss="skip", secure_aggregation=True,
        shards=[{"dataset": "mnist", "part": part, "parts": 3, "resources": {silo: 1}}
                for part, silo in enumerate(SILOS)],
    )
    values.update(overrides)
    return build_config(values)


def looks_uniform_on_the_ring(offsets, scale):
    """Whether decoded `offsets` from a silo's sum spread over the whole ring, as a uniform mask makes them.

    Uniform on ±2^63 / scale has mean absolute value 2^62 / scale (± 0.3% over thousands of values); offsets
    that a silo's sum leaked through would be near 0.
    """
    return abs(np.abs(offsets).mean() / (2.0**62 / scale) - 1) < 0.05


def kill_silo_c_after_keying(fleet):
    """Kill silo-c's actor right after the next keying round: its keys and shares are out, its masked sum never."""
    key = fleet.secure.key

    def key_then_kill(actors):
        key(actors)
        fleet.secure.key = key
        ray.kill(fleet.actors[(2, 0)])
    fleet.secure.key = key_then_kill


def fleet_steps(config, weights, steps, before_step=lambda fleet, step: None):
    """Each step's gathered parts from a fresh ShardFleet of `config`, and the fleet's log and secure shell."""
    log = []
    fleet = ShardFleet(config, log.append)
    try:
        fleet.start()
        fleet.set_sampling_rate(SAMPLING_RATE, steps)
        sums = []
        for step in range(steps):
            before_step(fleet, step)
            gathered, _ = fleet.clipped_sums(weights, step, config.clip_norm)
            sums.append([np.asarray(part) for part in gathered.parts])
        return sums, log, fleet.secure
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def model_weights():
    """gdp_cnn's initial weights: one draw, shared by every fleet of the module so that their sums compare."""
    return flat_parameters(build_model("gdp_cnn")).numpy()


@pytest.fixture(scope="module")
def observed(cluster, model_weights, tmp_path_factory):
    """The plain and the secure fleet's sums of two steps; in the secure one, silo-c's actor dies in step 2.

    Returns the plain per-silo sums (float64) by step, the secure totals by
    step, the masked parts and revealed shares the driver received, the
    secure shell (its public keys and context) and the log.
    """
    root = tmp_path_factory.mktemp("secure")
    weights_array = model_weights
    size = weights_array.size
    weights = ray.put(weights_array)
    plain, _, _ = fleet_steps(silo_config(root, "plain", secure_aggregation=False), weights, 2)
    plain = [[part[:size].astype(np.float64) for part in parts] for parts in plain]

    received = {"masked": [], "revealed": [], "rounds": []}

    def record_what_reaches_the_driver(fleet, step):
        secure = fleet.secure
        if step == 0:
            total, revealed_shares = secure.total, secure.revealed_shares

            def recording_total(masked_parts, dropped, at_step, part_size):
                received["masked"].append([part.copy() for part in masked_parts])
                received["rounds"].append((secure.context, dict(secure.public_keys)))
                return total(masked_parts, dropped, at_step, part_size)

            def recording_revealed_shares(dropped, at_step):
                received["revealed"] = revealed_shares(dropped, at_step)
                return received["revealed"]
            secure.total, secure.revealed_shares = recording_total, recording_revealed_shares
        if step == 1:
            kill_silo_c_after_keying(fleet)

    secure_sums, log, secure = fleet_steps(silo_config(root, "secure"), weights, 2, record_what_reaches_the_driver)
    return plain, [parts[0] for parts in secure_sums], received, secure, log


NOISE_MULTIPLIER = 0.5


@pytest.fixture(scope="module")
def noised(cluster, observed, model_weights, tmp_path_factory):
    """The secure fleet's totals of the same two steps with the noise in the silos' shares, silo-c lost in step 2;
    and the masked parts of step 1 as they reached the driver, and the secure shell."""
    root = tmp_path_factory.mktemp("noised")
    weights_array = model_weights
    weights = ray.put(weights_array)
    config = silo_config(root, "noised", noise_placement="silos", noise_multiplier=NOISE_MULTIPLIER)
    received = []
    log = []
    fleet = ShardFleet(config, log.append)
    try:
        fleet.start()
        fleet.set_sampling_rate(SAMPLING_RATE, 2)
        fleet.secure.place_noise_in_silos(weights_array.size, NOISE_MULTIPLIER, config.noise_share_tolerance,
                                          SILO_NOISE_ROUNDING_RATIO)
        total = fleet.secure.total

        def recording_total(masked_parts, dropped, at_step, part_size):
            received.append([part.copy() for part in masked_parts])
            return total(masked_parts, dropped, at_step, part_size)
        fleet.secure.total = recording_total
        totals = []
        for step in range(2):
            if step == 1:
                kill_silo_c_after_keying(fleet)
            gathered, _ = fleet.clipped_sums(weights, step, config.clip_norm, NOISE_MULTIPLIER)
            totals.append(np.asarray(gathered.parts[0]))
        return totals, received, fleet.secure, config
    finally:
        fleet.close()


def test_the_total_with_the_silos_noise_has_the_variance_that_the_remaining_silos_guarantee(observed, noised):
    plain, _, _, _, _ = observed
    totals, _, secure, config = noised
    assert config.noise_share_tolerance == 1  # 3 silos, threshold 2: one may drop out (or collude)
    target = (NOISE_MULTIPLIER * config.clip_norm) ** 2
    # Step 1, all three silos: each added 1/(3 - 1) of the target variance, so the total carries 3/2 of it.
    # Step 2, silo-c lost: its share is missing, and the two others' still carry the whole target.
    for total, sums, expected in ((totals[0], plain[0], 1.5 * target), (totals[1], plain[1][:2], target)):
        noise = total - np.sum(sums, axis=0)
        # gdp_cnn's 26k coordinates: the sample variance is within ±3% (its relative std is √(2/n) ≈ 0.9%), and the
        # mean within 5 standard errors of 0.
        assert noise.size > 20_000
        assert abs(noise.var() / expected - 1) < 0.03
        assert abs(noise.mean()) < 5 * np.sqrt(expected / noise.size)
    assert np.log2(secure.scale) == np.ceil(np.log2(np.sqrt(totals[0].size) / (SILO_NOISE_ROUNDING_RATIO
                                                                               * config.clip_norm)))


def test_with_the_silos_noise_nothing_reaching_the_driver_is_an_un_noised_sum(observed, noised):
    plain, _, _, _, _ = observed
    _, received, secure, _ = noised
    first = received[0]
    # Every proper subset of step 1's masked parts looks uniform on the ring; the full set decodes to the total,
    # which differs from the silos' un-noised total by the noise (std √1.5·σ·C), far beyond the rounding error.
    for count in (1, 2):
        for chosen in combinations(range(3), count):
            decoded = decode(ring_sum([first[index] for index in chosen]), secure.scale)
            assert looks_uniform_on_the_ring(decoded - np.sum([plain[0][index] for index in chosen], axis=0),
                                             secure.scale)
    offset = decode(ring_sum(first), secure.scale) - np.sum(plain[0], axis=0)
    assert np.abs(offset).max() < 100 * NOISE_MULTIPLIER
    assert offset.std() > 1e5 * secure.decoding_error(3)


def test_the_driver_side_total_is_the_plain_sum_within_the_fixed_point_error(observed):
    plain, totals, _, secure, _ = observed
    error = secure.decoding_error(3)
    assert np.abs(totals[0] - np.sum(plain[0], axis=0)).max() <= error
    assert np.abs(totals[0]).max() > 1e3 * error  # the sum is not trivially zero
    # Step 2 ran without silo-c: the two survivors' sums, silo-c's counted as zero.
    assert np.abs(totals[1] - (plain[1][0] + plain[1][1])).max() <= error


def test_the_lost_silo_is_named_and_its_masks_rebuilt_from_the_shares(observed):
    _, _, _, _, log = observed
    assert "step 2: unmasking the sum without shard 2 ({'silo-c': 1.0}), from the other silos' shares of its key; " \
           "its sum counts as zero for this step" in log
    assert any(line.startswith("secure aggregation: 3 silos, threshold 2, fixed point on Z_2^64 at scale 2^")
               for line in log)


def test_nothing_the_driver_receives_gives_one_silos_sum(observed):
    plain, _, received, secure, _ = observed
    first, second = received["masked"]
    # Step 1: every proper subset of the three masked parts decodes to noise, not to those silos' sum.
    for count in (1, 2):
        for chosen in combinations(range(3), count):
            decoded = decode(ring_sum([first[index] for index in chosen]), secure.scale)
            assert looks_uniform_on_the_ring(decoded - np.sum([plain[0][index] for index in chosen], axis=0),
                                             secure.scale)
    # Step 2: even with silo-c's key rebuilt (the driver holds it), one survivor's part alone stays masked by
    # the other survivor's pair mask.
    context, public_keys = received["rounds"][1]
    assert len(second) == 2 and all(len(key) == 32 for key in public_keys.values())
    private_key = recover_private_key([shares[2] for shares in received["revealed"]], public_keys[2], 2)
    for survivor, part in enumerate(second):
        # What the driver can take out of one part: the masks of its pair with the dropped silo, from its key.
        partial = part - dropped_masks(private_key, 2, {survivor: public_keys[survivor]}, context, 1, part.size)
        assert looks_uniform_on_the_ring(decode(partial, secure.scale) - plain[1][survivor], secure.scale)
    # Nor does silo-c's key rebuilt in step 2 unmask its step-1 part: each step has keys of its own.
    first_context, first_keys = received["rounds"][0]
    step_one_guess = first[2] + dropped_masks(private_key, 2, {0: first_keys[0], 1: first_keys[1]}, first_context,
                                              0, first[2].size)
    assert looks_uniform_on_the_ring(decode(step_one_guess, secure.scale) - plain[0][2], secure.scale)
    # Both parts together do unmask (the driver's total): the check above is not vacuous.
    both = ring_sum(second) - dropped_masks(private_key, 2, {0: public_keys[0], 1: public_keys[1]}, context, 1,
                                            second[0].size)
    assert np.abs(decode(both, secure.scale) - plain[1][0] - plain[1][1]).max() <= secure.decoding_error(3)


class KillSiloBefore(Trainer):
    """A trainer that kills silo-c's actor in step `kill_at` + 1, once that step's keys are agreed."""

    kill_at = 2

    def _step(self, workers):
        if self.step == self.kill_at and not getattr(self, "killed", False):
            self.killed = True
            kill_silo_c_after_keying(self.shards)
        super()._step(workers)


@pytest.mark.parametrize("noise_placement", ["driver", "silos"])
def test_a_run_that_loses_a_silo_mid_round_finishes_with_epsilon_as_planned(cluster, tmp_path, noise_placement):
    out = io.StringIO()
    trainer = KillSiloBefore(silo_config(tmp_path, "killed", on_shard_loss="wait", noise_placement=noise_placement),
                             show_progress=False, out=out)
    summary = trainer.run()
    log = out.getvalue()
    assert "step 3: unmasking the sum without shard 2 ({'silo-c': 1.0})" in log
    # Under "wait" the step is not recomputed: the replacement joins the next step's keying round.
    assert "step 4: shard 2 ({'silo-c': 1.0}) placed again" in log
    # Every planned step ran and was accounted: silo-c's sum counted as zero in step 3 (sampling is local).
    planned = trainer.plan.events_between(0, trainer.plan.steps)
    assert summary["events"] == planned.to_dict()
    assert summary["epsilon"] == trainer.report.epsilon(planned)
    assert [(outage["shard"], outage["first_step"], outage["last_step"]) for outage in summary["shard_outages"]] == \
        [(2, 3, 3)]
    assert summary["noise_placement"] == noise_placement
    if noise_placement == "silos":
        # The silos' Skellam events, accounted by their RDP bound (the tolerance covers the lost silo's share).
        assert {event["kind"] for event in summary["events"]["events"]} == {"sampled_skellam"}
        assert summary["epsilon_label"] == SKELLAM_LABEL
        # Against the driver's Gaussian noise at the same σ: a few percent more by RDP; PLD, which the Gaussian
        # has and Skellam noise here has not, is far tighter over 4 steps.
        assert summary["driver_noise_epsilon_rdp"] < summary["epsilon"] < 1.1 * summary["driver_noise_epsilon_rdp"]
        assert summary["driver_noise_epsilon"] < summary["driver_noise_epsilon_rdp"]
        assert "the driver adds none" in log
