"""The attacker of docs/silos.md: from everything a driver relayed (and what colluding silos hold), find a silo's sum.

A `View` is what the attacker holds after one or more rounds: per round, the
keys each silo was relayed, the sealed boxes, the masked inputs, the answers
to unmasking requests; the private keys it made itself (substituted keys);
what colluding silos hold (their parties, which the test reads). `attack`
tries everything those give, again and again until nothing new comes:

- open every relayed box with every private key it knows or rebuilt, under
  every pair-key derivation (the sealing and the masking purpose);
- rebuild every masking key and self-mask seed of which it holds t shares;
- strip from each input every mask it can compute, and take the released
  totals, their differences over rounds of one step, and the totals less the
  colluders' own sums;

and returns every candidate vector. `recovered` names the honest silos whose
sum one of them equals (to the fixed-point error). A test of a protection
runs the attack with the protection and asserts nothing is recovered, and
runs it where the protection is missing and asserts the sum is recovered,
so the attacker is known to be able to find one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from workers.secure_aggregation import (
    AdvertisedKeys,
    MaskedInput,
    Revealed,
    Round,
    SiloParty,
    combine,
    decode,
    expand_mask,
    pair_key,
    unmasked_total,
)
from workers.secure_aggregation.masks import MASKING, SEALING, mask_sign
from workers.secure_aggregation.protocol import _SHARE_BYTES, _public_bytes

NONCE = 12


@dataclass
class RoundView:
    """What crossed the driver in one round."""

    round: Round
    # Each silo's view of the round's keys, as the driver relayed them to it.
    relayed: dict[int, dict[int, AdvertisedKeys]]
    # sender → receiver → sealed box.
    boxes: dict[int, dict[int, bytes]] = field(default_factory=dict)
    inputs: list[MaskedInput] = field(default_factory=list)
    answers: list[Revealed] = field(default_factory=list)
    # What colluding silos hand over: their party objects (keys, seeds, held shares).
    colluders: dict[int, SiloParty] = field(default_factory=dict)


@dataclass
class View:
    """All the rounds the attacker saw, and the X25519 private keys it made itself."""

    rounds: list[RoundView] = field(default_factory=list)
    own_keys: list[X25519PrivateKey] = field(default_factory=list)


def _advertised_by(view: RoundView, party: int) -> AdvertisedKeys:
    """The keys `party` itself advertised (what it sent in its own view)."""
    return view.relayed[party][party]


def attack(view: View, scale: float) -> list[np.ndarray]:
    """Every float vector the attacker can compute that might be one silo's sum (see the module docstring)."""
    candidates = []
    totals: dict[int, list[tuple[np.ndarray, set[int]]]] = {}
    for seen in view.rounds:
        candidates += _attack_round(seen, view.own_keys, scale, totals)
    for step_totals in totals.values():
        for (first, first_parties), (second, second_parties) in itertools.combinations(step_totals, 2):
            if first_parties != second_parties:
                candidates += [first - second, second - first]
    return candidates


def _attack_round(seen: RoundView, own_keys: list[X25519PrivateKey], scale: float,
                  totals: dict[int, list]) -> list[np.ndarray]:
    round_, binding, threshold = seen.round, seen.round.binding(), seen.round.threshold
    known: dict[bytes, X25519PrivateKey] = {_public_bytes(key): key for key in own_keys}
    for party in seen.colluders.values():
        for key in (party._masking_key, party._sealing_key):
            known[_public_bytes(key)] = key
    masking_shares: dict[int, dict[bytes, None]] = {party: {} for party in round_.parties}
    self_shares: dict[int, dict[bytes, None]] = {party: {} for party in round_.parties}
    self_seeds: dict[int, bytes] = {number: party._self_seed for number, party in seen.colluders.items()}
    for party in seen.colluders.values():
        for owner, (masking, self_share) in party._held.items():
            masking_shares[owner][masking] = None
            self_shares[owner][self_share] = None
    for answer in seen.answers:
        for owner, share in answer.masking_shares.items():
            masking_shares[owner][share] = None
        for owner, share in answer.self_shares.items():
            self_shares[owner][share] = None
    opened: set[tuple[int, int]] = set()
    while True:
        progress = False
        for sender, boxes in seen.boxes.items():
            for receiver, box in boxes.items():
                if (sender, receiver) in opened:
                    continue
                plain = _open(box, sender, receiver, seen, known, binding)
                if plain is not None:
                    opened.add((sender, receiver))
                    masking_shares[sender][plain[:_SHARE_BYTES]] = None
                    self_shares[sender][plain[_SHARE_BYTES:]] = None
                    progress = True
        for party in round_.parties:
            public = _advertised_by(seen, party).masking_key
            if public not in known and len(masking_shares[party]) >= threshold:
                for subset in itertools.combinations(masking_shares[party], threshold):
                    try:
                        key = X25519PrivateKey.from_private_bytes(combine(list(subset), threshold))
                    except ValueError:
                        continue
                    if _public_bytes(key) == public:
                        known[public] = key
                        progress = True
                        break
            if party not in self_seeds and len(self_shares[party]) >= threshold:
                try:
                    self_seeds[party] = combine(list(self_shares[party])[:threshold], threshold)
                    progress = True
                except ValueError:
                    pass
        if not progress:
            break
    candidates = []
    for message in seen.inputs:
        candidates.append(decode(_strip(message, seen, known, self_seeds), scale))
    advertised = {party: _advertised_by(seen, party) for party in round_.parties}
    for request in {answer.request for answer in seen.answers}:
        inputs = [message for message in seen.inputs if message.party in request.survivors]
        try:
            total = unmasked_total(round_, advertised, inputs, seen.answers, scale)
        except (ValueError, KeyError):
            continue
        candidates.append(total)
        totals.setdefault(round_.step, []).append((total, set(request.survivors)))
    return candidates


def _open(box: bytes, sender: int, receiver: int, seen: RoundView, known: dict[bytes, X25519PrivateKey],
          binding: bytes) -> bytes | None:
    """The box's plaintext when some known private key and some relayed public key derive its key."""
    publics = set()
    for keys in (seen.relayed[sender].get(receiver), seen.relayed[receiver].get(sender),
                 _advertised_by(seen, sender), _advertised_by(seen, receiver)):
        if keys is not None:
            publics |= {keys.masking_key, keys.sealing_key}
    data = binding + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")
    for private_key in list(known.values()):
        for public in publics:
            for purpose in (SEALING, MASKING):
                try:
                    key = pair_key(private_key, public, sender, receiver, binding, purpose)
                except ValueError:
                    continue
                try:
                    return AESGCM(key).decrypt(box[:NONCE], box[NONCE:], data)
                except InvalidTag:
                    continue
    return None


def _strip(message: MaskedInput, seen: RoundView, known: dict[bytes, X25519PrivateKey],
           self_seeds: dict[int, bytes]) -> np.ndarray:
    """The input less its self-mask (when the seed is known) and less every pair mask the attacker can derive."""
    values = message.values.copy()
    party, round_ = message.party, seen.round
    if party in self_seeds:
        values -= expand_mask(self_seeds[party], round_.step, values.size)
    own_public = _advertised_by(seen, party).masking_key
    for peer, keys in seen.relayed[party].items():
        if peer == party:
            continue
        if own_public in known:
            seed = pair_key(known[own_public], keys.masking_key, party, peer, round_.binding(), MASKING)
        elif keys.masking_key in known:
            seed = pair_key(known[keys.masking_key], own_public, peer, party, round_.binding(), MASKING)
        else:
            continue
        mask = expand_mask(seed, round_.step, values.size)
        if mask_sign(party, peer) > 0:
            values -= mask
        else:
            values += mask
    return values


def recovered(candidates: list[np.ndarray], sums: dict[int, np.ndarray], honest: set[int], scale: float,
              colluders_sums: dict[int, np.ndarray] | None = None) -> list[int]:
    """The honest silos whose sum one candidate equals to the fixed-point error; with `colluders_sums`, each
    candidate less any subset of those sums is tried as well (colluders know their own)."""
    shifts = [np.zeros(1)]
    for size in range(1, len(colluders_sums or {}) + 1):
        shifts += [sum(subset) for subset in itertools.combinations((colluders_sums or {}).values(), size)]
    tolerance = (len(sums) + 1) / scale
    found = []
    for party in sorted(honest):
        if any(candidate.shape == sums[party].shape and np.abs(candidate - shift - sums[party]).max() <= tolerance
               for candidate in candidates for shift in shifts):
            found.append(party)
    return found


def identities(parties) -> tuple[dict[int, object], list[bytes]]:
    """A fresh Ed25519 identity per party and the registry of their public keys."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from workers.secure_aggregation import public_identity
    keys = {party: Ed25519PrivateKey.generate() for party in parties}
    return keys, [public_identity(keys[party]) for party in sorted(parties)]


def keyed_round(round_: Round, histories: dict, scale: float, value_bound: float, signed: bool = True,
                relay=None, deliver=None) -> tuple[dict[int, SiloParty], RoundView]:
    """The silos of `round_` after advertising and sharing their keys, with the driver's relay played here.

    `relay(receiver, advertised)` is what the driver relays to each silo (by
    default the keys as advertised), and `deliver(sender, receiver, box)`
    the box it hands on; with `signed`, the silos have registered identities.
    """
    keys, registry = identities(round_.parties) if signed else ({}, None)
    silos = {party: SiloParty(party, round_, scale, value_bound, histories[party], keys.get(party), registry)
             for party in round_.parties}
    advertised = {party: silo.advertise() for party, silo in silos.items()}
    relayed = {party: dict(advertised) if relay is None else relay(party, advertised) for party in silos}
    seen = RoundView(round_, relayed)
    seen.boxes = {party: silo.share_keys(relayed[party]) for party, silo in silos.items()}
    for receiver, silo in silos.items():
        silo.receive_shares({sender: boxes[receiver] if deliver is None else deliver(sender, receiver, boxes[receiver])
                             for sender, boxes in seen.boxes.items() if sender != receiver})
    return silos, seen
