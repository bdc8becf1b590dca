"""Secure aggregation on a real Ray cluster on loopback: three silo nodes, one silo each, the driver on the head.

Everything the driver relays is recorded and handed to the attacker of
tests/secagg_attacker.py (an honest-but-curious driver that keeps it all):
it recovers no silo's sum, though a silo's actor is killed after its keys
were agreed and its masking key is rebuilt from the others' shares. The
silos sign their round keys with registered identities, and the key attacks
are played against the real actors: a substituted or replayed key, a
request for both kinds of shares. Nodes are real Ray nodes (never a mocked
Ray).
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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from secagg_attacker import RoundView, View, attack, recovered

from accounting.accountants import SKELLAM_LABEL
from accounting.skellam import SILO_NOISE_ROUNDING_RATIO
from workers.secure_aggregation import (
    AdvertisedKeys,
    UnmaskRequest,
    decode,
    new_round,
    public_identity,
    ring_sum,
)

SILOS = ("silo-a", "silo-b", "silo-c")
SAMPLING_RATE = 0.002


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs and one 1-CPU node per silo."""
    cluster, added = start_loopback_cluster([dict(num_cpus=1, resources={silo: 1}) for silo in SILOS])
    yield cluster, dict(zip(SILOS, added))
    stop_loopback_cluster(cluster)


def silo_config(tmp_path, name, identities=False, **overrides):
    values = dict(
        model="gdp_cnn", steps=4, batch_size=120, test_subset=100, noise_multiplier=1.0, clip_norm=1.0,
        learning_rate=0.5, seed=5, run_dir=str(tmp_path / name), max_physical_batch=64, dataset_name=name,
        on_shard_loss="skip", secure_aggregation=True,
        shards=[{"dataset": "mnist", "part": part, "parts": 3, "resources": {silo: 1}}
                for part, silo in enumerate(SILOS)],
    )
    values.update(overrides)
    return build_config(with_identities(tmp_path, values) if identities else values)


def looks_uniform_on_the_ring(offsets, scale):
    """Whether decoded `offsets` from a silo's sum spread over the whole ring, as a uniform mask makes them.

    Uniform on ±2^63 / scale has mean absolute value 2^62 / scale (± 0.3% over thousands of values); offsets
    that a silo's sum leaked through would be near 0.
    """
    return abs(np.abs(offsets).mean() / (2.0**62 / scale) - 1) < 0.05


def with_identities(tmp_path, values):
    """`values`' shards, each with a new Ed25519 identity: the public key in the config, the private key in a file
    standing for its node's."""
    shards = []
    for index, shard in enumerate(values["shards"]):
        key = Ed25519PrivateKey.generate()
        path = tmp_path / f"silo-{index}.key"
        path.write_bytes(key.private_bytes_raw())
        shards.append({**shard, "identity": public_identity(key).hex(), "identity_key_file": str(path)})
    return {**values, "shards": shards}


def kill_silo_c_after_keying(fleet):
    """Kill silo-c's actor right after the next keying round: its keys and shares are out, its masked sum never."""
    key = fleet.secure.key

    def key_then_kill(actors, step):
        key(actors, step)
        fleet.secure.key = key
        ray.kill(fleet.actors[(2, 0)])
    fleet.secure.key = key_then_kill


def record_rounds(secure, rounds):
    """Keep, as an attacker's `RoundView` per round, everything `secure` relays and receives."""
    total, answers = secure.total, secure.answers

    def recording_total(inputs, step):
        rounds.append(RoundView(secure.round, {party: dict(secure.advertised) for party in secure.advertised},
                                {sender: dict(boxes) for sender, boxes in secure.boxes.items()}, list(inputs)))
        return total(inputs, step)

    def recording_answers(request):
        rounds[-1].answers = answers(request)
        return rounds[-1].answers
    secure.total, secure.answers = recording_total, recording_answers


def fleet_steps(config, weights, steps, before_step=lambda fleet, step: None, after=lambda fleet: None):
    """Each step's gathered parts from a fresh ShardFleet of `config`, and the fleet's log and secure shell;
    `after(fleet)` runs on the live fleet before it is closed."""
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
        after(fleet)
        return sums, log, fleet.secure
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def model_weights():
    """gdp_cnn's initial weights: one draw, shared by every fleet of the module so that their sums compare."""
    return flat_parameters(build_model("gdp_cnn")).numpy()


@pytest.fixture(scope="module")
def observed(cluster, model_weights, tmp_path_factory):
    """The plain and the secure fleet's sums of two steps; in the secure one (identities registered), silo-c's
    actor dies in step 2, and the key attacks are played on the live actors afterwards.

    Returns the plain per-silo sums (float64) by step, the secure totals by
    step, the attacker's rounds, the secure shell, the log and what each key
    attack raised.
    """
    root = tmp_path_factory.mktemp("secure")
    weights_array = model_weights
    size = weights_array.size
    weights = ray.put(weights_array)
    plain, _, _ = fleet_steps(silo_config(root, "plain", secure_aggregation=False), weights, 2)
    plain = [[part[:size].astype(np.float64) for part in parts] for parts in plain]
    rounds, refusals = [], {}

    def before_step(fleet, step):
        if step == 0:
            record_rounds(fleet.secure, rounds)
        if step == 1:
            kill_silo_c_after_keying(fleet)

    def key_attacks(fleet):
        refusals.update(play_key_attacks(fleet, rounds))

    secure_sums, log, secure = fleet_steps(silo_config(root, "secure", identities=True), weights, 2, before_step,
                                           key_attacks)
    return plain, [parts[0] for parts in secure_sums], rounds, secure, log, refusals


def refusal(call) -> str:
    """The message of the error a real actor raised for `call`, or "" when it raised none."""
    try:
        ray.get(call)
    except ray.exceptions.RayTaskError as error:
        return str(error)
    return ""


def play_key_attacks(fleet, rounds) -> dict[str, str]:
    """A driver that deviates, against the live silos-a and -b (silo-c's replacement is not placed): each attack's
    refusal, by name."""
    secure, actors = fleet.secure, [fleet.actors[(0, 0)], fleet.actors[(1, 0)]]
    round_ = new_round(5, (0, 1), 2)
    advertised = dict(zip((0, 1), ray.get([actor.secure_start.remote(round_, secure.scale, secure.clip_bound,
                                                                     secure.registry) for actor in actors])))
    made = Ed25519PrivateKey.generate()
    substituted = AdvertisedKeys(1, public_identity(made), public_identity(made), made.sign(b"keys"))
    refusals = {
        "substituted key": refusal(actors[0].secure_share_keys.remote({**advertised, 1: substituted})),
        "replayed key": refusal(actors[0].secure_share_keys.remote({**advertised, 1: rounds[0].relayed[1][1]})),
        "replayed round": refusal(actors[0].secure_start.remote(rounds[0].round, secure.scale, secure.clip_bound,
                                                                secure.registry)),
    }
    ray.get([actor.secure_share_keys.remote(advertised) for actor in actors])
    refusals["replayed box"] = refusal(actors[0].secure_receive_shares.remote({1: rounds[0].boxes[1][0]}))
    refusals["both kinds"] = refusal(actors[0].secure_reveal.remote(UnmaskRequest(round_.binding(), (0, 1), (1,))))
    return refusals


def test_on_the_cluster_the_driver_that_keeps_all_it_relays_recovers_no_silos_sum(observed):
    plain, _, rounds, secure, _, _ = observed
    assert len(rounds) == 2 and len(rounds[1].inputs) == 2 and len(rounds[1].answers) == 2
    candidates = attack(View(rounds), secure.scale)
    assert candidates, "the attacker computed nothing: the test would not see a recovery"
    for step, sums in enumerate(plain):
        assert recovered(candidates, dict(enumerate(sums)), {0, 1, 2}, secure.scale) == []
    # The attacker's candidates do include the released totals: the comparison can see a match.
    assert recovered(candidates, {0: plain[1][0] + plain[1][1]}, {0}, secure.scale) == [0]


def test_on_the_cluster_the_silos_refuse_substituted_or_replayed_keys_boxes_rounds_and_a_request_for_both(observed):
    _, _, _, _, _, refusals = observed
    assert "not signed by their registered identity" in refusals["substituted key"]
    assert "not signed by their registered identity" in refusals["replayed key"]
    assert "context was keyed before" in refusals["replayed round"]
    assert "does not open" in refusals["replayed box"]
    assert "named both survivor and dropped" in refusals["both kinds"]


NOISE_MULTIPLIER = 0.5


@pytest.fixture(scope="module")
def noised(cluster, observed, model_weights, tmp_path_factory):
    """The secure fleet's totals of the same two steps with the noise in the silos' shares, silo-c lost in step 2,
    no identities registered; the inputs of step 1 as they reached the driver, the secure shell and the log."""
    root = tmp_path_factory.mktemp("noised")
    weights_array = model_weights
    weights = ray.put(weights_array)
    config = silo_config(root, "noised", noise_placement="silos", noise_multiplier=NOISE_MULTIPLIER)
    rounds, log = [], []
    fleet = ShardFleet(config, log.append)
    try:
        fleet.start()
        fleet.set_sampling_rate(SAMPLING_RATE, 2)
        fleet.secure.place_noise_in_silos(weights_array.size, NOISE_MULTIPLIER, SILO_NOISE_ROUNDING_RATIO)
        record_rounds(fleet.secure, rounds)
        totals = []
        for step in range(2):
            if step == 1:
                kill_silo_c_after_keying(fleet)
            gathered, _ = fleet.clipped_sums(weights, step, config.clip_norm, NOISE_MULTIPLIER)
            totals.append(np.asarray(gathered.parts[0]))
        return totals, rounds, fleet.secure, log
    finally:
        fleet.close()


def test_each_silos_noise_share_carries_the_whole_target_variance(observed, noised):
    plain, _, _, _, _, _ = observed
    totals, _, secure, _ = noised
    target = (NOISE_MULTIPLIER * 1.0) ** 2
    # Step 1, all three silos: each added the whole target, so the total carries 3 times it; step 2, silo-c lost:
    # the two others' shares, twice the target.
    for total, sums, expected in ((totals[0], plain[0], 3 * target), (totals[1], plain[1][:2], 2 * target)):
        noise = total - np.sum(sums, axis=0)
        # gdp_cnn's 26k coordinates: the sample variance is within ±3% (its relative std is √(2/n) ≈ 0.9%), and the
        # mean within 5 standard errors of 0.
        assert noise.size > 20_000
        assert abs(noise.var() / expected - 1) < 0.03
        assert abs(noise.mean()) < 5 * np.sqrt(expected / noise.size)
    assert np.log2(secure.scale) == np.ceil(np.log2(np.sqrt(totals[0].size) / (SILO_NOISE_ROUNDING_RATIO * 1.0)))


def test_with_the_silos_noise_nothing_reaching_the_driver_is_an_un_noised_sum(observed, noised):
    plain, _, _, _, _, _ = observed
    _, rounds, secure, log = noised
    first = [message.values for message in rounds[0].inputs]
    # Every proper subset of step 1's inputs looks uniform on the ring; the full set, less the self-masks the
    # answers give, decodes to the total, which differs from the un-noised total by the noise (std √3·σ·C).
    for count in (1, 2, 3):
        for chosen in combinations(range(3), count):
            decoded = decode(ring_sum([first[index] for index in chosen]), secure.scale)
            assert looks_uniform_on_the_ring(decoded - np.sum([plain[0][index] for index in chosen], axis=0),
                                             secure.scale)
    assert recovered(attack(View(rounds), secure.scale), dict(enumerate(plain[0])), {0, 1, 2}, secure.scale) == []
    assert recovered(attack(View(rounds), secure.scale), {0: np.sum(plain[0], axis=0)}, {0}, secure.scale) == []
    assert any("no silo identities registered: the silos trust the driver to relay their round keys" in line
               for line in log)


def test_the_driver_side_total_is_the_plain_sum_within_the_fixed_point_error(observed):
    plain, totals, _, secure, _, _ = observed
    error = secure.decoding_error(3)
    assert np.abs(totals[0] - np.sum(plain[0], axis=0)).max() <= error
    assert np.abs(totals[0]).max() > 1e3 * error  # the sum is not trivially zero
    # Step 2 ran without silo-c: the two survivors' sums, silo-c's counted as zero.
    assert np.abs(totals[1] - (plain[1][0] + plain[1][1])).max() <= error


def test_the_lost_silo_is_named_and_the_start_says_what_the_threshold_tolerates(observed):
    _, _, _, _, log, _ = observed
    assert "step 2: unmasking the sum without shard 2 ({'silo-c': 1.0}), from the other silos' shares of its " \
           "masking key; its sum counts as zero for this step" in log
    assert any(line.startswith("secure aggregation: 3 silos, threshold 2: a step survives up to 1 dropouts; a driver "
                               "that follows the protocol learns only the total of each step's survivors while it "
                               "colludes with up to 1 silos, one that deviates from it while it colludes with up to 0;")
               for line in log)
    assert any(line.startswith("secure aggregation: round keys signed by the silos' registered identities")
               for line in log)


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
        # The silos' noise events, accounted by the Skellam RDP bound (one silo's share carries the target).
        assert {event["kind"] for event in summary["events"]["events"]} == {"sampled_skellam"}
        assert summary["epsilon_label"] == SKELLAM_LABEL
        # Against the driver's Gaussian noise at the same σ: a few percent more by RDP; PLD, which the Gaussian
        # has and the silos' noise here has not, is far tighter over 4 steps.
        assert summary["driver_noise_epsilon_rdp"] < summary["epsilon"] < 1.1 * summary["driver_noise_epsilon_rdp"]
        assert summary["driver_noise_epsilon"] < summary["driver_noise_epsilon_rdp"]
        assert "the driver adds none" in log
