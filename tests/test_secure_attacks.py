"""Attacks on secure aggregation's pure protocol: the honest-but-curious driver, the malicious driver, colluding silos.

Each attack plays its adversary against real `SiloParty` objects, hands all
it holds to tests/secagg_attacker.py, and fails if any honest silo's sum is
among what the attacker can compute. Where a protection is taken away (no
registered identities, colluders beyond the bound, a silo that forgets what
it sent), the same attacker does recover a sum: it finds one when one is
there. The same attacks on a loopback Ray cluster are in
tests/test_secure_silos.py.
"""

import itertools

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from secagg_attacker import View, attack, keyed_round, recovered

from workers.secure_aggregation import (
    AdvertisedKeys,
    RoundHistory,
    UnmaskRequest,
    new_round,
    pair_key,
    unmask_request,
    unmasked_total,
)
from workers.secure_aggregation.masks import SEALING
from workers.secure_aggregation.protocol import _public_bytes

SCALE, BOUND = 2.0**30, 1e3


def sums_of(parties, seed=0):
    generator = np.random.default_rng(seed)
    return {party: generator.uniform(-50, 50, 6) for party in parties}


def histories_of(parties):
    return {party: RoundHistory() for party in parties}


def answer_all(silos, seen, request):
    """Every survivor's answer to `request`, kept in the attacker's view."""
    seen.answers += [silos[party].reveal(request) for party in request.survivors]


@pytest.mark.parametrize("parties, threshold, dropped", [(4, 3, (2,)), (5, 3, (1, 2)), (5, 4, (0,))])
def test_an_honest_but_curious_driver_that_rebuilds_dropped_silos_keys_learns_no_survivors_sum(parties, threshold,
                                                                                                dropped):
    sums = sums_of(range(parties))
    silos, seen = keyed_round(new_round(4, range(parties), threshold), histories_of(range(parties)), SCALE, BOUND)
    seen.inputs = [silos[party].masked(sums[party]) for party in range(parties) if party not in dropped]
    answer_all(silos, seen, unmask_request(seen.round, seen.inputs))
    # The attacker rebuilds each dropped silo's masking key and tries it on every relayed box.
    assert recovered(attack(View([seen]), SCALE), sums, set(range(parties)), SCALE) == []
    survivors_total = unmasked_total(seen.round, seen.relayed[0], seen.inputs, seen.answers, SCALE)
    assert np.allclose(survivors_total, sum(sums[party] for party in range(parties) if party not in dropped))


def test_a_rebuilt_masking_key_opens_no_box_sealed_to_its_silo():
    silos, seen = keyed_round(new_round(0, range(4), 3), histories_of(range(4)), SCALE, BOUND)
    masking_key = silos[3]._masking_key  # what the driver rebuilds once silo 3 drops
    binding = seen.round.binding()
    for sender in range(3):
        box = seen.boxes[sender][3]
        for public in (seen.relayed[3][sender].masking_key, seen.relayed[3][sender].sealing_key):
            key = pair_key(masking_key, public, 3, sender, binding, SEALING)
            with pytest.raises(Exception):
                AESGCM(key).decrypt(box[:12], box[12:], binding + sender.to_bytes(4, "big") + (3).to_bytes(4, "big"))


def split_requests(round_, victim):
    """Two requests of one round: `victim` named a survivor, and named dropped."""
    everyone = tuple(round_.parties)
    survived = UnmaskRequest(round_.binding(), everyone, ())
    dropped = UnmaskRequest(round_.binding(), tuple(party for party in everyone if party != victim), (victim,))
    return survived, dropped


@pytest.mark.parametrize("colluding, found", [((), []), ((4,), []), ((3, 4), [0])])
def test_a_malicious_driver_that_asks_for_both_kinds_of_shares_of_one_silo_gets_them_only_beyond_the_bound(
        colluding, found):
    """P = 5, t = 3: a driver that deviates is held off with up to 2t − P = 1 colluding silo; with 2 it wins."""
    parties, threshold, victim = range(5), 3, 0
    sums = sums_of(parties)
    honest_others = [party for party in parties if party != victim and party not in colluding]
    recoveries = set()
    for size in range(len(honest_others) + 1):
        for group in itertools.combinations(honest_others, size):
            silos, seen = keyed_round(new_round(1, parties, threshold), histories_of(parties), SCALE, BOUND)
            seen.colluders = {party: silos[party] for party in colluding}
            seen.inputs = [silos[party].masked(sums[party]) for party in parties]
            survived, dropped = split_requests(seen.round, victim)
            for party in honest_others:
                seen.answers.append(silos[party].reveal(survived if party in group else dropped))
                # Asking the same silo the other way is refused: one answer per round.
                with pytest.raises(ValueError, match="already answered"):
                    silos[party].reveal(dropped if party in group else survived)
            with pytest.raises(ValueError, match="named both survivor and dropped"):
                silos[victim].reveal(UnmaskRequest(seen.round.binding(), tuple(parties), (victim,)))
            candidates = attack(View([seen]), SCALE)
            recoveries |= set(recovered(candidates, sums, {victim}, SCALE,
                                        {party: sums[party] for party in colluding}))
    assert sorted(recoveries) == found


def man_in_the_middle(round_, histories, signed):
    """A driver that relays to each silo key pairs of its own in place of every other silo's, and re-seals the
    boxes it opens on their way; returns the silos, what the driver saw and the keys it made."""
    made: dict[tuple[int, int], tuple[X25519PrivateKey, X25519PrivateKey]] = {}

    def relay(receiver, advertised):
        relayed = {}
        for party, keys in advertised.items():
            if party == receiver:
                relayed[party] = keys
                continue
            made[(receiver, party)] = X25519PrivateKey.generate(), X25519PrivateKey.generate()
            masking, sealing = made[(receiver, party)]
            relayed[party] = AdvertisedKeys(party, _public_bytes(masking), _public_bytes(sealing), keys.signature)
        return relayed

    real: dict[int, AdvertisedKeys] = {}

    def deliver(sender, receiver, box):
        binding = round_.binding()
        data = binding + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")
        opened = AESGCM(pair_key(made[(sender, receiver)][1], real[sender].sealing_key, receiver, sender, binding,
                                 SEALING)).decrypt(box[:12], box[12:], data)
        key = pair_key(made[(receiver, sender)][1], real[receiver].sealing_key, sender, receiver, binding, SEALING)
        return box[:12] + AESGCM(key).encrypt(box[:12], opened, data)

    def relay_and_remember(receiver, advertised):
        real.update(advertised)
        return relay(receiver, advertised)

    silos, seen = keyed_round(round_, histories, SCALE, BOUND, signed=signed, relay=relay_and_remember,
                              deliver=deliver)
    return silos, seen, [key for pair in made.values() for key in pair]


def test_a_substituted_public_key_is_refused_with_identities_and_gives_every_sum_away_without():
    parties = range(3)
    sums = sums_of(parties)
    with pytest.raises(ValueError, match="not signed by their registered identity"):
        man_in_the_middle(new_round(2, parties, 2), histories_of(parties), signed=True)
    silos, seen, made = man_in_the_middle(new_round(2, parties, 2), histories_of(parties), signed=False)
    seen.inputs = [silos[party].masked(sums[party]) for party in parties]
    answer_all(silos, seen, unmask_request(seen.round, seen.inputs))
    assert recovered(attack(View([seen], made), SCALE), sums, set(parties), SCALE) == [0, 1, 2]


def test_an_old_rounds_keys_boxes_and_inputs_are_refused():
    parties = range(4)
    histories, sums = histories_of(parties), sums_of(parties)
    old_silos, old = keyed_round(new_round(0, parties, 3), histories, SCALE, BOUND)
    old.inputs = [old_silos[party].masked(sums[party]) for party in (0, 1, 2)]
    answer_all(old_silos, old, unmask_request(old.round, old.inputs))
    # In the next round the driver relays silo 3's old keys, whose masking key it rebuilt when 3 dropped.

    def replay(receiver, advertised):
        return {**advertised, 3: old.relayed[3][3]} if receiver != 3 else advertised
    with pytest.raises(ValueError, match=r"parties \[3\] are not signed by their registered identity for this round"):
        keyed_round(new_round(1, parties, 3), histories, SCALE, BOUND, relay=replay)
    silos, seen = keyed_round(new_round(2, parties, 3), histories, SCALE, BOUND)
    with pytest.raises(ValueError, match="from party 1 does not open"):
        silos[0].receive_shares({1: old.boxes[1][0], 2: seen.boxes[2][0], 3: seen.boxes[3][0]})
    seen.inputs = [silos[party].masked(sums[party]) for party in parties]
    request = unmask_request(seen.round, seen.inputs)
    answers = [silos[party].reveal(request) for party in parties]
    with pytest.raises(ValueError, match=r"inputs of parties \[0\] are bound to another round"):
        unmasked_total(seen.round, seen.relayed[0], [old.inputs[0], *seen.inputs[1:]], answers, SCALE)


@pytest.mark.parametrize("forgets", [False, True])
def test_a_second_round_for_a_step_is_refused_where_its_total_would_give_away_the_withheld_silos_sum(forgets):
    """The driver withholds silo 0's input (it looks dropped), then keys the step again with every silo: the two
    totals differ by silo 0's sum. A silo that remembers the steps it sent refuses the second round."""
    parties = range(4)
    histories, sums = histories_of(parties), sums_of(parties)
    silos, first = keyed_round(new_round(9, parties, 3), histories, SCALE, BOUND)
    first.inputs = [silos[party].masked(sums[party]) for party in parties]
    answer_all(silos, first, unmask_request(first.round, first.inputs[1:]))
    view = View([first])
    if forgets:
        again, second = keyed_round(new_round(9, parties, 3), histories_of(parties), SCALE, BOUND)
        second.inputs = [again[party].masked(sums[party]) for party in parties]
        answer_all(again, second, unmask_request(second.round, second.inputs))
        view.rounds.append(second)
    else:
        with pytest.raises(ValueError, match="step 9 is not after step 9"):
            keyed_round(new_round(9, parties, 3), histories, SCALE, BOUND)
    assert recovered(attack(view, SCALE), sums, set(parties), SCALE) == ([0] if forgets else [])


def test_withholding_one_silos_input_so_it_looks_dropped_unmasks_only_the_others_total():
    parties = range(4)
    sums = sums_of(parties)
    silos, seen = keyed_round(new_round(3, parties, 3), histories_of(parties), SCALE, BOUND)
    seen.inputs = [silos[party].masked(sums[party]) for party in parties]
    # The driver holds silo 0's input but names it dropped: the others reveal its masking key, never its self-mask.
    answer_all(silos, seen, unmask_request(seen.round, seen.inputs[1:]))
    assert recovered(attack(View([seen]), SCALE), sums, set(parties), SCALE) == []


@pytest.mark.parametrize("dropped, found", [((), []), ((2,), []), ((1, 2), [0])])
def test_colluding_silos_with_an_honest_but_curious_driver_learn_only_the_honest_survivors_total(dropped, found):
    """P = 5, t = 3, silos 3 and 4 collude (t − 1). The protocol's output is the survivors' total: with a lone
    honest survivor that total, less the colluders' own sums, is its sum, which is why one honest silo's noise
    share carries the whole target (docs/silos.md)."""
    parties, colluding = range(5), (3, 4)
    sums = sums_of(parties)
    silos, seen = keyed_round(new_round(5, parties, 3), histories_of(parties), SCALE, BOUND)
    seen.colluders = {party: silos[party] for party in colluding}
    seen.inputs = [silos[party].masked(sums[party]) for party in parties if party not in dropped]
    answer_all(silos, seen, unmask_request(seen.round, seen.inputs))
    honest = set(parties) - set(colluding)
    assert recovered(attack(View([seen]), SCALE), sums, honest, SCALE,
                     {party: sums[party] for party in colluding}) == found


@pytest.mark.parametrize("colluding, found", [((4,), []), ((3, 4), [0])])
def test_a_driver_that_withholds_honest_inputs_to_leave_one_honest_survivor_needs_t_minus_one_colluders(
        colluding, found):
    """P = 5, t = 3: the driver names dropped every honest silo but silo 0 and as few others as the threshold
    allows; with t − 1 = 2 colluders among the survivors their total less the colluders' sums is silo 0's,
    which bounds what a deviating driver tolerates by t − 2 as well as 2t − P."""
    parties = range(5)
    sums = sums_of(parties)
    silos, seen = keyed_round(new_round(6, parties, 3), histories_of(parties), SCALE, BOUND)
    seen.colluders = {party: silos[party] for party in colluding}
    seen.inputs = [silos[party].masked(sums[party]) for party in parties]
    kept = [0, *colluding] + [party for party in (1, 2) if party not in colluding][:3 - 1 - len(colluding)]
    answer_all(silos, seen, unmask_request(seen.round, [message for message in seen.inputs
                                                         if message.party in kept]))
    honest = set(parties) - set(colluding)
    assert recovered(attack(View([seen]), SCALE), sums, honest, SCALE,
                     {party: sums[party] for party in colluding}) == found
