"""The secure aggregation of silo sums as pure state machines: a silo's party and the driver's unmasking.

A keying round (one per step: a round's key, once rebuilt after a loss,
unmasks that silo's masks for every step of the round):
each silo makes an ephemeral X25519 key pair and hands its public key to the
driver, which relays every public key to every silo. Each silo then splits
its private key into Shamir shares (threshold t) and seals share j for silo
j with their pair's sealing key (AES-GCM), and the driver relays the sealed
shares. Each step, each silo sends only its fixed-point clipped sum plus its
pairwise masks. The driver adds what arrived; when silos dropped out, each
survivor reveals its shares of the dropped silos' private keys, and from t of
them the driver rebuilds those keys and takes the dropped pairs' masks out.
A silo that revealed shares sends nothing more under these keys.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from workers.secure_aggregation.fixed_point import RING_DTYPE, decode, encode, ring_sum
from workers.secure_aggregation.masks import apply_masks, expand_mask, mask_sign, pair_secrets
from workers.secure_aggregation.shamir import Share, combine_shares, split_secret

CONTEXT_BYTES = 16
_NONCE_BYTES = 12


def new_context() -> bytes:
    """A keying round's public context: fresh random bytes, so that no two rounds derive the same pair secrets."""
    return secrets.token_bytes(CONTEXT_BYTES)


def _public_bytes(private_key: X25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _sealing_data(context: bytes, sender: int, receiver: int) -> bytes:
    """What a sealed share is bound to: the round and the direction of the pair."""
    return context + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")


def check_round(parties: Sequence[int], threshold: int) -> None:
    """Raise ValueError unless `parties` are distinct and 2 ≤ threshold ≤ their number."""
    if len(set(parties)) != len(parties) or len(parties) < 2:
        raise ValueError(f"a keying round needs two or more distinct parties (got {list(parties)})")
    if not 2 <= threshold <= len(parties):
        raise ValueError(f"the share threshold must lie in 2..{len(parties)} for {len(parties)} parties "
                         f"(got {threshold})")


class SiloParty:
    """One silo's side of a keying round: its ephemeral private key, its pairs' secrets and the shares it holds.

    `party` is the silo's number among `parties`; `value_bound` bounds each
    coordinate of the silo's own float sum, and `scale` is the round's
    fixed-point scale. The private key and every secret stay in this object:
    it has no readable ``repr`` and refuses to be pickled.
    """

    def __init__(self, party: int, parties: Sequence[int], threshold: int, context: bytes, scale: float,
                 value_bound: float):
        check_round(parties, threshold)
        if party not in parties:
            raise ValueError(f"party {party} is not one of the round's parties {list(parties)}")
        self.party, self.parties, self.threshold = party, sorted(parties), threshold
        self.context, self.scale, self.value_bound = context, scale, value_bound
        self._private_key = X25519PrivateKey.generate()
        self._mask_seeds: dict[int, bytes] = {}
        self._sealing_keys: dict[int, bytes] = {}
        self._held_shares: dict[int, bytes] = {}
        self.revealed = False

    def public_key(self) -> bytes:
        """The silo's 32-byte X25519 public key, for the driver to relay."""
        return _public_bytes(self._private_key)

    def sealed_shares(self, public_keys: Mapping[int, bytes]) -> dict[int, bytes]:
        """Derive the pair secrets from every party's public key; return each peer's sealed share of this key.

        `public_keys` holds every party's key, this one's included (it must
        be the key this party made: a relay that swapped it is refused).
        """
        if sorted(public_keys) != self.parties or public_keys[self.party] != self.public_key():
            raise ValueError("the relayed public keys must name every party of the round once, this party's as "
                             "it made it")
        for peer in self.parties:
            if peer != self.party:
                self._mask_seeds[peer], self._sealing_keys[peer] = pair_secrets(
                    self._private_key, public_keys[peer], self.party, peer, self.context)
        own_key = self._private_key.private_bytes_raw()
        shares = split_secret(own_key, len(self.parties), self.threshold)
        sealed = {}
        for peer, share in zip(self.parties, shares):
            if peer != self.party:
                nonce = secrets.token_bytes(_NONCE_BYTES)
                sealed[peer] = nonce + AESGCM(self._sealing_keys[peer]).encrypt(
                    nonce, share.to_bytes(), _sealing_data(self.context, self.party, peer))
        return sealed

    def receive_shares(self, sealed: Mapping[int, bytes]) -> None:
        """Open and keep the shares each peer sealed for this party; one that fails to open is refused."""
        if sorted(sealed) != [peer for peer in self.parties if peer != self.party]:
            raise ValueError(f"party {self.party} needs one sealed share from each peer (got from {sorted(sealed)})")
        for sender, box in sealed.items():
            try:
                self._held_shares[sender] = AESGCM(self._sealing_keys[sender]).decrypt(
                    box[:_NONCE_BYTES], box[_NONCE_BYTES:], _sealing_data(self.context, sender, self.party))
            except InvalidTag:
                raise ValueError(f"the share from party {sender} does not open under the pair's key: it was altered "
                                 "or sealed for another round") from None

    def masked(self, values: np.ndarray, step: int, noise: np.ndarray | None = None) -> np.ndarray:
        """`values` (this silo's float sum) in fixed point, plus `noise` (this silo's integer noise share, ring
        units) when given, plus this party's pairwise masks for step `step`.

        The noise goes in before the masks: no one but this silo ever holds
        its rounded sum without it.
        """
        if self.revealed:
            raise RuntimeError("this party revealed shares in this round: its masks are no longer secret; "
                               "start a new keying round")
        if len(self._held_shares) != len(self.parties) - 1:
            raise RuntimeError("the round's shares have not all been received: finish the keying round first")
        encoded = encode(values, self.scale, self.value_bound)
        if noise is not None:
            # Two's complement: adding the int64 noise as uint64 is the ring's addition.
            encoded += np.asarray(noise, dtype=np.int64).view(RING_DTYPE)
        return apply_masks(encoded, self.party, self._mask_seeds, step)

    def reveal_shares(self, dropped: Sequence[int]) -> dict[int, bytes]:
        """This party's shares of the dropped parties' private keys, for the driver to rebuild their masks.

        A party never reveals a share of itself, and sends no masked sum
        under this round's keys afterwards.
        """
        if self.party in dropped or not set(dropped) <= set(self._held_shares):
            raise ValueError(f"party {self.party} reveals shares of its peers only (asked for {sorted(dropped)})")
        self.revealed = True
        return {party: self._held_shares[party] for party in dropped}

    def __repr__(self) -> str:
        return f"SiloParty(party={self.party}, parties={self.parties}, <keys hidden>)"

    def __reduce__(self):
        raise TypeError("a SiloParty holds a silo's private key: it lives in memory only, never pickled or sent")


def recover_private_key(shares: Sequence[bytes], public_key: bytes, threshold: int) -> X25519PrivateKey:
    """The private key behind `public_key`, rebuilt from `threshold` or more of its revealed shares.

    A result whose public key is not `public_key` (too few or tampered
    shares) is refused.
    """
    if len(shares) < threshold:
        raise ValueError(f"rebuilding a dropped party's key needs {threshold} shares (got {len(shares)})")
    try:
        private_key = X25519PrivateKey.from_private_bytes(combine_shares([Share.from_bytes(share)
                                                                          for share in shares]))
    except ValueError:
        private_key = None
    if private_key is None or _public_bytes(private_key) != public_key:
        raise ValueError("the revealed shares do not rebuild the dropped party's key: a share was altered")
    return private_key


def dropped_masks(private_key: X25519PrivateKey, dropped: int, survivors: Mapping[int, bytes], context: bytes,
                  step: int, size: int) -> np.ndarray:
    """The masks that the `survivors` (party → public key) added for their pairs with `dropped` at `step`.

    Subtracting them from the survivors' ring sum leaves it free of the
    dropped party's masks; the survivors' masks among themselves cancel.
    """
    total = np.zeros(size, dtype=RING_DTYPE)
    for survivor, public_key in survivors.items():
        seed, _ = pair_secrets(private_key, public_key, dropped, survivor, context)
        mask = expand_mask(seed, step, size)
        if mask_sign(survivor, dropped) > 0:
            total += mask
        else:
            total -= mask
    return total


def unmasked_total(masked_parts: Sequence[np.ndarray], dropped_shares: Mapping[int, Sequence[bytes]],
                   public_keys: Mapping[int, bytes], threshold: int, context: bytes, step: int,
                   scale: float) -> np.ndarray:
    """The float64 total of step `step`'s masked parts, with the dropped parties' masks taken out.

    `dropped_shares` maps each dropped party to the shares of its key that
    the survivors revealed; `public_keys` holds every party of the round, so
    the survivors are the parties not dropped. Without dropped parties the
    masks cancel in the ring sum.
    """
    total = ring_sum(masked_parts)
    survivors = {party: key for party, key in public_keys.items() if party not in dropped_shares}
    for party, shares in dropped_shares.items():
        private_key = recover_private_key(shares, public_keys[party], threshold)
        total -= dropped_masks(private_key, party, survivors, context, step, total.size)
    return decode(total, scale)
