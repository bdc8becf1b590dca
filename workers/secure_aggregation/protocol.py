"""Secure aggregation of silo sums as pure state machines (Bonawitz et al. 2017, with Bell et al. 2020's keys).

One round per step, four messages, each bound to the round (`Round.binding`:
its fresh context, step, parties and threshold):

1. advertise: each silo makes two X25519 key pairs, a masking key and a
   sealing key, and sends both public keys, signed with its long-term
   Ed25519 identity when the silos have registered identities.
2. share keys: each silo checks every signature, then splits its masking
   private key and the seed of its self-mask into Shamir shares (threshold
   t) and seals each peer's two shares with AES-GCM under their pair's
   sealing key. The sealing private key is never shared, so no key rebuilt
   later opens a box the driver relayed.
3. masked input: each silo sends its fixed-point sum (plus its noise share)
   plus its self-mask plus its pairwise masks, once per step.
4. unmask: the driver names the silos whose inputs arrived (survivors) and
   the others (dropped), once per round; each survivor reveals its shares of
   the dropped silos' masking keys and of the survivors' self-mask seeds.
   A silo answers one request per round and never reveals both kinds for
   one silo; from t shares the driver rebuilds what it needs: the dropped
   silos' pairwise masks and the survivors' self-masks.

A silo's input is thus under its self-mask until its self-mask seed is
revealed, which happens only when it is named a survivor, and then its
masking key stays secret: the driver learns the survivors' total and nothing
of any one survivor. With t > P/2 two requests that name one silo both ways
cannot both gather t honest answers (docs/silos.md has the collusion bounds).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from workers.secure_aggregation.fixed_point import RING_DTYPE, decode, encode, ring_sum
from workers.secure_aggregation.identity import verify
from workers.secure_aggregation.masks import MASKING, SEALING, SEED_BYTES, apply_masks, expand_mask, mask_sign, pair_key
from workers.secure_aggregation.shamir import Share, combine_shares, split_secret

CONTEXT_BYTES = 16
_NONCE_BYTES = 12
_SHARE_BYTES = len(Share(1, 0).to_bytes())
_ROUND_LABEL = b"dpfleet secure aggregation round v2"


def check_round(parties: Sequence[int], threshold: int) -> None:
    """Raise ValueError unless `parties` are two or more distinct silos and P/2 < threshold ≤ P."""
    count = len(parties)
    if len(set(parties)) != count or count < 2:
        raise ValueError(f"a round needs two or more distinct parties (got {list(parties)})")
    if not count < 2 * threshold <= 2 * count:
        raise ValueError(f"the share threshold must lie in {count // 2 + 1}..{count} for {count} parties, a "
                         f"majority (got {threshold}); a minority threshold lets the driver rebuild both a silo's "
                         "masking key and its self-mask from two disjoint sets of answers")


def deviating_coalition(parties: int, threshold: int) -> int:
    """The most silos a driver that deviates from the protocol may collude with and still learn no silo's sum.

    Naming a silo a survivor to some silos and dropped to others gets it t
    shares of both of its secrets once its colluders c and the honest silos
    other than the victim split into two groups of t − c: c ≥ 2t − P + 1.
    Naming every honest silo but the victim dropped leaves the victim and
    its colluders as the survivors, whose total less the colluders' sums is
    the victim's: c ≥ t − 1. So min(2t − P, t − 2), and never below 0.
    """
    return max(0, min(2 * threshold - parties, threshold - 2))


@dataclass(frozen=True)
class Round:
    """A round's public description: a fresh random `context`, the `step` it serves, its `parties`, `threshold`."""

    context: bytes
    step: int
    parties: tuple[int, ...]
    threshold: int

    def __post_init__(self) -> None:
        check_round(self.parties, self.threshold)
        if len(self.context) != CONTEXT_BYTES or not 0 <= self.step < 2**63:
            raise ValueError(f"a round has a {CONTEXT_BYTES}-byte context and a step in 0..2^63 − 1 "
                             f"(got {len(self.context)} bytes, step {self.step})")
        object.__setattr__(self, "parties", tuple(sorted(self.parties)))

    def binding(self) -> bytes:
        """The bytes every message of the round is bound to (signatures, HKDF salts, AES-GCM data)."""
        return (_ROUND_LABEL + self.context + self.step.to_bytes(8, "big") + self.threshold.to_bytes(2, "big")
                + b"".join(party.to_bytes(4, "big") for party in self.parties))


def new_round(step: int, parties: Sequence[int], threshold: int) -> Round:
    """A new round for `step` among `parties`, with a fresh context: no two rounds derive the same keys."""
    return Round(secrets.token_bytes(CONTEXT_BYTES), step, tuple(parties), threshold)


@dataclass(frozen=True)
class AdvertisedKeys:
    """A silo's two public keys for one round, and its identity's signature of them (b"" without identities)."""

    party: int
    masking_key: bytes
    sealing_key: bytes
    signature: bytes = b""

    def signed_message(self, round_: Round) -> bytes:
        """What the signature covers: the round's binding, the silo's number and both keys."""
        return round_.binding() + b"keys" + self.party.to_bytes(4, "big") + self.masking_key + self.sealing_key


@dataclass(frozen=True)
class MaskedInput:
    """A silo's masked sum for its round's step, and the round and silo it is bound to (signed with identities)."""

    binding: bytes
    party: int
    values: np.ndarray
    signature: bytes = b""

    def signed_message(self) -> bytes:
        """What the signature covers: the round's binding, the silo's number and a BLAKE2b digest of the values."""
        return self.binding + b"input" + self.party.to_bytes(4, "big") + hashlib.blake2b(self.values).digest()

    @property
    def size(self) -> int:
        """How many ring values the input carries (the step's transport figures count them)."""
        return self.values.size

    @property
    def nbytes(self) -> int:
        """The bytes of the ring values (the step's transport figures count them)."""
        return self.values.nbytes


@dataclass(frozen=True)
class UnmaskRequest:
    """The driver's one request of a round: which silos' inputs arrived (`survivors`) and which did not."""

    binding: bytes
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class Revealed:
    """A survivor's answer: its shares of the dropped silos' masking keys and of the survivors' self-mask seeds."""

    party: int
    request: UnmaskRequest
    masking_shares: Mapping[int, bytes]
    self_shares: Mapping[int, bytes]


def _public_bytes(private_key: X25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _sealing_data(binding: bytes, sender: int, receiver: int) -> bytes:
    """What a sealed box is bound to: the round and the direction of the pair."""
    return binding + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")


class RoundHistory:
    """What one silo remembers across rounds, so that no round's message is used twice: the contexts it keyed
    and the last step it sent an input for."""

    def __init__(self) -> None:
        self.contexts: set[bytes] = set()
        self.last_masked_step = -1

    def begin(self, round_: Round) -> None:
        """Refuse a round whose context this silo has keyed before, or whose step it has already sent."""
        if round_.context in self.contexts:
            raise ValueError("this round's context was keyed before: a replayed round is refused")
        if round_.step <= self.last_masked_step:
            raise ValueError(f"step {round_.step} is not after step {self.last_masked_step}, whose input this silo "
                             "already sent: an old step's round is refused")
        self.contexts.add(round_.context)

    def masking(self, step: int) -> None:
        """Refuse a second input for a step (or an earlier one): two maskings of one sum would differ by masks."""
        if step <= self.last_masked_step:
            raise ValueError(f"this silo already sent its input for step {self.last_masked_step}; step {step} is "
                             "not after it")
        self.last_masked_step = step


class SiloParty:
    """One silo's side of a round: its two key pairs, its self-mask seed, its pairs' keys and the shares it holds.

    `party` is the silo's number in `round_`; `value_bound` bounds each
    coordinate of its float sum and `scale` is the fixed-point scale.
    `identity` (its Ed25519 private key) and `registry` (every silo's public
    identity, by number) come together or not at all: without them the
    silo trusts the driver to relay the keys as they were made. `history`
    is what the silo remembers across rounds. Every secret stays in this
    object: it has no readable ``repr`` and refuses to be pickled.
    """

    def __init__(self, party: int, round_: Round, scale: float, value_bound: float, history: RoundHistory,
                 identity: Ed25519PrivateKey | None = None, registry: Sequence[bytes] | None = None):
        if party not in round_.parties:
            raise ValueError(f"party {party} is not one of the round's parties {list(round_.parties)}")
        if (identity is None) != (registry is None):
            raise ValueError("a silo's identity and the registry of identities come together or not at all")
        history.begin(round_)
        self.party, self.round, self.scale, self.value_bound = party, round_, scale, value_bound
        self.history, self._identity, self.registry = history, identity, registry
        self._masking_key = X25519PrivateKey.generate()
        self._sealing_key = X25519PrivateKey.generate()
        self._self_seed = secrets.token_bytes(SEED_BYTES)
        self._mask_seeds: dict[int, bytes] = {}
        self._sealing_keys: dict[int, bytes] = {}
        # party → (share of its masking key, share of its self-mask seed); this party's own shares included.
        self._held: dict[int, tuple[bytes, bytes]] = {}
        self.sent_input = False
        self.answered: UnmaskRequest | None = None

    def advertise(self) -> AdvertisedKeys:
        """The round's two public keys, signed with this silo's identity when it has one."""
        keys = AdvertisedKeys(self.party, _public_bytes(self._masking_key), _public_bytes(self._sealing_key))
        if self._identity is None:
            return keys
        return AdvertisedKeys(keys.party, keys.masking_key, keys.sealing_key,
                              self._identity.sign(keys.signed_message(self.round)))

    def share_keys(self, advertised: Mapping[int, AdvertisedKeys]) -> dict[int, bytes]:
        """Check every silo's advertised keys, derive the pair keys, and return each peer's sealed box of this
        silo's two shares for it.

        Refused before anything is derived: a set that does not name every
        party once, this silo's keys not as it made them, or (with
        identities) a signature that the registry does not confirm for this
        round.
        """
        if sorted(advertised) != list(self.round.parties) or any(
                keys.party != party for party, keys in advertised.items()):
            raise ValueError("the relayed keys must name every party of the round once")
        own = advertised[self.party]
        if (own.masking_key, own.sealing_key) != (_public_bytes(self._masking_key),
                                                  _public_bytes(self._sealing_key)):
            raise ValueError(f"the relayed keys of party {self.party} are not the ones it made: the relay swapped them")
        if self.registry is not None:
            forged = [party for party, keys in advertised.items()
                      if not verify(self.registry[party], keys.signature, keys.signed_message(self.round))]
            if forged:
                raise ValueError(f"the keys relayed for parties {forged} are not signed by their registered identity "
                                 "for this round: substituted or replayed keys are refused")
        binding = self.round.binding()
        for peer, keys in advertised.items():
            if peer != self.party:
                self._mask_seeds[peer] = pair_key(self._masking_key, keys.masking_key, self.party, peer, binding,
                                                  MASKING)
                self._sealing_keys[peer] = pair_key(self._sealing_key, keys.sealing_key, self.party, peer, binding,
                                                    SEALING)
        count, threshold = len(self.round.parties), self.round.threshold
        masking_shares = split_secret(self._masking_key.private_bytes_raw(), count, threshold)
        self_shares = split_secret(self._self_seed, count, threshold)
        sealed = {}
        for peer, masking_share, self_share in zip(self.round.parties, masking_shares, self_shares):
            plain = masking_share.to_bytes(), self_share.to_bytes()
            if peer == self.party:
                self._held[peer] = plain
                continue
            nonce = secrets.token_bytes(_NONCE_BYTES)
            sealed[peer] = nonce + AESGCM(self._sealing_keys[peer]).encrypt(
                nonce, b"".join(plain), _sealing_data(binding, self.party, peer))
        return sealed

    def receive_shares(self, sealed: Mapping[int, bytes]) -> None:
        """Open and keep the two shares each peer sealed for this silo; a box that does not open is refused."""
        peers = [peer for peer in self.round.parties if peer != self.party]
        if sorted(sealed) != peers or len(self._sealing_keys) != len(peers):
            raise ValueError(f"party {self.party} needs, after sharing its keys, one sealed box from each peer "
                             f"(got from {sorted(sealed)})")
        opened = {}
        for sender, box in sealed.items():
            try:
                plain = AESGCM(self._sealing_keys[sender]).decrypt(
                    box[:_NONCE_BYTES], box[_NONCE_BYTES:], _sealing_data(self.round.binding(), sender, self.party))
            except InvalidTag:
                raise ValueError(f"the box from party {sender} does not open under the pair's sealing key: it was "
                                 "altered or sealed in another round") from None
            opened[sender] = plain[:_SHARE_BYTES], plain[_SHARE_BYTES:]
        self._held.update(opened)

    def masked(self, values: np.ndarray, noise: np.ndarray | None = None) -> MaskedInput:
        """This silo's input for the round's step: `values` (its float sum) in fixed point, plus `noise` (its
        integer noise share, ring units) when given, plus its self-mask and its pairwise masks.

        Sent once per step: a second input, or one after the round's
        request, is refused.
        """
        if len(self._held) != len(self.round.parties):
            raise RuntimeError("the round's shares have not all been received: finish the keying first")
        if self.answered is not None:
            raise RuntimeError("this round's unmasking has begun: it takes no more inputs")
        self.history.masking(self.round.step)
        encoded = encode(values, self.scale, self.value_bound)
        if noise is not None:
            # Two's complement: adding the int64 noise as uint64 is the ring's addition.
            encoded += np.asarray(noise, dtype=np.int64).view(RING_DTYPE)
        masked = apply_masks(encoded, self.party, self._mask_seeds, self._self_seed, self.round.step)
        self.sent_input = True
        message = MaskedInput(self.round.binding(), self.party, masked)
        if self._identity is None:
            return message
        return MaskedInput(message.binding, self.party, masked, self._identity.sign(message.signed_message()))

    def reveal(self, request: UnmaskRequest) -> Revealed:
        """Answer the round's one unmasking request: shares of the dropped silos' masking keys and of the
        survivors' self-mask seeds.

        Refused: a request of another round, a second request in this round
        (it could name a silo the other way), a silo named both survivor
        and dropped, a split that does not cover the parties, fewer than t
        survivors, or this silo not among the survivors.
        """
        if request.binding != self.round.binding():
            raise ValueError("the unmasking request is bound to another round: refused")
        if self.answered is not None:
            raise ValueError(f"party {self.party} already answered this round's request (survivors "
                             f"{list(self.answered.survivors)}): one answer per round, so no silo is both unmasked "
                             "and rebuilt")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped:
            raise ValueError(f"parties {sorted(survivors & dropped)} are named both survivor and dropped: revealing "
                             "both their self-mask and their masking key would expose their input; refused")
        if survivors | dropped != set(self.round.parties) or len(survivors) != len(request.survivors) \
                or len(dropped) != len(request.dropped):
            raise ValueError(f"the request must split the round's parties {list(self.round.parties)} into "
                             "survivors and dropped, each once")
        if len(survivors) < self.round.threshold:
            raise ValueError(f"{len(survivors)} survivors are fewer than the threshold {self.round.threshold}: the "
                             "step is aborted, nothing is revealed")
        if self.party not in survivors or not self.sent_input:
            raise ValueError(f"party {self.party} reveals only as a survivor that sent its input")
        self.answered = request
        return Revealed(self.party, request, {party: self._held[party][0] for party in sorted(dropped)},
                        {party: self._held[party][1] for party in sorted(survivors)})

    def __repr__(self) -> str:
        return f"SiloParty(party={self.party}, parties={list(self.round.parties)}, <keys hidden>)"

    def __reduce__(self):
        raise TypeError("a SiloParty holds a silo's private keys: it lives in memory only, never pickled or sent")


def combine(shares: Sequence[bytes], threshold: int) -> bytes:
    """The 32-byte secret behind `threshold` or more revealed shares (`Share.to_bytes`)."""
    if len(shares) < threshold:
        raise ValueError(f"rebuilding a secret needs {threshold} shares (got {len(shares)})")
    return combine_shares([Share.from_bytes(share) for share in shares])


def recover_masking_key(shares: Sequence[bytes], public_key: bytes, threshold: int) -> X25519PrivateKey:
    """The masking private key behind `public_key`, from `threshold` or more of its revealed shares; a result
    whose public key is not `public_key` (too few or altered shares) is refused."""
    try:
        private_key = X25519PrivateKey.from_private_bytes(combine(shares, threshold))
    except ValueError:
        private_key = None
    if private_key is None or _public_bytes(private_key) != public_key:
        raise ValueError("the revealed shares do not rebuild the dropped party's masking key: a share was altered")
    return private_key


def dropped_masks(private_key: X25519PrivateKey, dropped: int, survivors: Mapping[int, bytes], binding: bytes,
                  step: int, size: int) -> np.ndarray:
    """The masks that the `survivors` (party → masking public key) added for their pairs with `dropped`."""
    total = np.zeros(size, dtype=RING_DTYPE)
    for survivor, public_key in survivors.items():
        mask = expand_mask(pair_key(private_key, public_key, dropped, survivor, binding, MASKING), step, size)
        if mask_sign(survivor, dropped) > 0:
            total += mask
        else:
            total -= mask
    return total


def check_inputs(round_: Round, inputs: Sequence[MaskedInput], registry: Sequence[bytes] | None) -> None:
    """Refuse inputs of another round, two from one silo, or (with identities) one its silo did not sign."""
    parties = [message.party for message in inputs]
    if len(set(parties)) != len(parties) or not set(parties) <= set(round_.parties):
        raise ValueError(f"the inputs must come from distinct parties of the round (got {parties})")
    binding = round_.binding()
    stale = [message.party for message in inputs if message.binding != binding]
    if stale:
        raise ValueError(f"the inputs of parties {stale} are bound to another round: refused")
    if registry is not None:
        forged = [message.party for message in inputs
                  if not verify(registry[message.party], message.signature, message.signed_message())]
        if forged:
            raise ValueError(f"the inputs of parties {forged} are not signed by their registered identity: refused")


def unmask_request(round_: Round, inputs: Sequence[MaskedInput]) -> UnmaskRequest:
    """The round's request: the silos whose inputs arrived are the survivors, the others dropped."""
    arrived = {message.party for message in inputs}
    return UnmaskRequest(round_.binding(), tuple(sorted(arrived)),
                         tuple(party for party in round_.parties if party not in arrived))


def unmasked_total(round_: Round, advertised: Mapping[int, AdvertisedKeys], inputs: Sequence[MaskedInput],
                   answers: Sequence[Revealed], scale: float, registry: Sequence[bytes] | None = None) -> np.ndarray:
    """The float64 total of the survivors' inputs: their ring sum less their self-masks and less the masks of
    their pairs with the dropped silos, each rebuilt from the `answers` to the round's request."""
    check_inputs(round_, inputs, registry)
    request = unmask_request(round_, inputs)
    answers = [answer for answer in answers if answer.request == request and answer.party in request.survivors]
    if len({answer.party for answer in answers}) < round_.threshold:
        raise ValueError(f"{len(answers)} survivors answered the request, fewer than the threshold "
                         f"{round_.threshold}: the step is aborted")
    total = ring_sum([message.values for message in inputs])
    for survivor in request.survivors:
        seed = combine([answer.self_shares[survivor] for answer in answers], round_.threshold)
        total -= expand_mask(seed, round_.step, total.size)
    survivors = {party: advertised[party].masking_key for party in request.survivors}
    for party in request.dropped:
        private_key = recover_masking_key([answer.masking_shares[party] for answer in answers],
                                          advertised[party].masking_key, round_.threshold)
        total -= dropped_masks(private_key, party, survivors, round_.binding(), round_.step, total.size)
    return decode(total, scale)
