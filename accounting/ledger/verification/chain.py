"""The history's hash chain, keyed, and the signed head that shows a cut tail or a rewritten history."""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from accounting.ledger.errors import InvalidArgument
from accounting.ledger.verification.findings import Finding
from accounting.ledger.verification.rows import StoredEntry


# One encoder for every entry (json.dumps would build one per call), writing what json.dumps(ensure_ascii=True,
# separators=(",", ":")) writes.
_HASHED_FIELDS = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


def history_hash(
    previous_hash: str,
    entry_id: int,
    at: str,
    actor: str,
    action: str,
    tenant: str | None,
    dataset_id: int | None,
    details_json: str,
    key: bytes | None = None,
) -> str:
    """The hash a history entry carries: HMAC-SHA-256 (hex) under the history `key` over the previous entry's hash
    and every stored field.

    The first entry's previous hash is "". Editing, removing or reordering
    an entry changes every hash after it, and without the key nobody can
    compute the hashes of a rewritten history. `key` None gives the plain
    SHA-256 of files from before schema version 9, which only the migration
    that keys them reads.
    """
    payload = _HASHED_FIELDS.encode(
        [previous_hash, entry_id, at, actor, action, tenant, dataset_id, details_json]
    ).encode()
    if key is None:
        return hashlib.sha256(payload).hexdigest()
    return hmac.digest(key, payload, "sha256").hex()


ANCHOR_ACTION = "anchor_history"
# The entries that record what a migration or re-keying found wrong before it chained the history under the key.
_RECORDING_ACTIONS = (ANCHOR_ACTION, "migrate_schema", "rekey_history")


def chain_findings(
    entries: Iterable[StoredEntry], dataset_names: dict[int, str], key: bytes | None = None, recorded: bool = True
) -> list[Finding]:
    """Every entry whose previous hash or own hash does not match the chain under the history `key`, oldest first.

    An edited entry shows as a wrong hash at that entry; a removed one as a
    wrong previous hash at the entry after it. What the migration that keyed
    an older file found wrong in its unkeyed chain (recorded in its
    `anchor_history` entry), and what an admin accepted when migrating or
    re-keying a history that failed its checks (dpfleet ledger rekey
    --accept-findings), is reported again at that entry, unless not
    `recorded` (a migration checks the chain as it is). `verify`
    re-hashes the whole history each time, so this loop builds nothing per
    entry that it does not need.
    """
    findings = []
    previous = ""
    encode = _HASHED_FIELDS.encode
    digest = hmac.digest
    for entry_id, at, actor, action, tenant, dataset_id, details_json, previous_hash, entry_hash in entries:
        if action in _RECORDING_ACTIONS and recorded:
            details = json.loads(details_json)
            findings += [
                Finding(entry_id, None, f"before the history was keyed, its unkeyed chain had: {problem}")
                for problem in details.get("unkeyed_chain_findings") or ()
            ] + [
                Finding(entry_id, None, f"an admin accepted, when it was migrated or re-keyed as it was: {problem}")
                for problem in details.get("accepted_findings") or ()
            ]
        payload = encode([previous_hash, entry_id, at, actor, action, tenant, dataset_id, details_json]).encode()
        expected = hashlib.sha256(payload).hexdigest() if key is None else digest(key, payload, "sha256").hex()
        if previous_hash != previous or entry_hash != expected:
            dataset = dataset_names.get(dataset_id) if dataset_id is not None else None
            if previous_hash != previous:
                findings.append(
                    Finding(entry_id, dataset, "its previous hash is not the hash of the entry before it")
                )
            if entry_hash != expected:
                findings.append(Finding(entry_id, dataset, "its fields do not match its hash (the row was edited)"))
        previous = entry_hash
    return findings


HEAD_SCHEMA = "dpfleet.ledger_head"
# How a head is signed: an HMAC-SHA-256 under the history key, or an Ed25519 signature whose public key anyone may
# hold. A head file without a scheme is from before Ed25519 heads: an HMAC.
HMAC_HEAD, ED25519_HEAD = "hmac-sha256", "ed25519"


@dataclass(frozen=True)
class SignedHead:
    """The history's head as `dpfleet ledger head` prints it: how many entries, the last one's hash, when (UTC).

    `signature` is, by `scheme`, an HMAC-SHA-256 under the history key (whoever
    checks it holds the key, which is also who can make one), or an Ed25519
    signature by the key whose raw public key `public_key` (hex) names, which a
    tenant checks with that public key alone. Either is over the same fields.
    """

    entries: int
    head_hash: str
    at: str
    signature: str
    scheme: str = HMAC_HEAD
    public_key: str = ""

    def to_dict(self) -> dict:
        """JSON-ready dict (the head file)."""
        signer = {"public_key": self.public_key} if self.scheme == ED25519_HEAD else {}
        return {"schema": HEAD_SCHEMA, "entries": self.entries, "head_hash": self.head_hash, "at": self.at,
                "scheme": self.scheme, **signer, "signature": self.signature}

    @classmethod
    def from_dict(cls, data: object) -> "SignedHead":
        """Inverse of `to_dict`; InvalidArgument for anything else."""
        if not isinstance(data, dict) or data.get("schema") != HEAD_SCHEMA:
            raise InvalidArgument(f"a head file is the JSON object dpfleet ledger head prints (schema {HEAD_SCHEMA})")
        entries, head_hash, at, signature = (data.get(name) for name in ("entries", "head_hash", "at", "signature"))
        scheme, public_key = data.get("scheme", HMAC_HEAD), data.get("public_key", "")
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0 or not all(
            isinstance(value, str) for value in (head_hash, at, signature, public_key)
        ):
            raise InvalidArgument("a head file needs entries (an integer >= 0), and head_hash, at and signature "
                                  "(strings); use the file dpfleet ledger head printed, unedited")
        if scheme not in (HMAC_HEAD, ED25519_HEAD) or (scheme == ED25519_HEAD) != bool(public_key):
            raise InvalidArgument(f"a head file's scheme is {HMAC_HEAD} or {ED25519_HEAD} (got {scheme!r}), and "
                                  "only an Ed25519 head names its public_key; use the file dpfleet ledger head "
                                  "printed, unedited")
        return cls(entries, head_hash, at, signature, scheme, public_key)


def _head_payload(entries: int, head_hash: str, at: str) -> bytes:
    # A 4-item list never reads as the 8-item list an entry's hash is taken over.
    return json.dumps([HEAD_SCHEMA, entries, head_hash, at], ensure_ascii=True, separators=(",", ":")).encode()


def _raw_public_key(public_key: Ed25519PublicKey) -> str:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def sign_head(key: bytes | Ed25519PrivateKey, entries: int, head_hash: str, at: str) -> SignedHead:
    """The head of a history of `entries` entries whose last hash is `head_hash`, signed at `at` with `key`: the
    history key (an HMAC) or an Ed25519 private key (a signature its public key checks)."""
    payload = _head_payload(entries, head_hash, at)
    if isinstance(key, Ed25519PrivateKey):
        return SignedHead(entries, head_hash, at, key.sign(payload).hex(), ED25519_HEAD,
                          _raw_public_key(key.public_key()))
    return SignedHead(entries, head_hash, at, hmac.new(key, payload, hashlib.sha256).hexdigest())


def head_signature_findings(
    head: SignedHead, history_key: bytes | None, public_key: Ed25519PublicKey | None = None
) -> list[Finding]:
    """Whether `head` was signed as it is: with `public_key`, by an Ed25519 signature (no history key needed);
    without one, by an HMAC under `history_key`. A head signed otherwise than the check expects is a finding, so
    that whoever holds the history key cannot pass a head of their own making to one who checks with the public
    key. InvalidArgument for an Ed25519 head and no public key to check it with."""
    payload = _head_payload(head.entries, head.head_hash, head.at)
    if public_key is not None:
        if head.scheme != ED25519_HEAD:
            problem = f"it is signed with {head.scheme}, not Ed25519: the public key cannot check it"
        elif head.public_key != _raw_public_key(public_key):
            problem = "it names another signing key than the public key it is checked with"
        else:
            try:
                public_key.verify(bytes.fromhex(head.signature), payload)
                return []
            except (InvalidSignature, ValueError):
                problem = "its signature does not match the public key: it was edited, or signed with another key"
        return [Finding(None, None, problem, row="head file")]
    if head.scheme == ED25519_HEAD:
        raise InvalidArgument("the head is signed with Ed25519: check it with its signer's public key "
                              "(dpfleet ledger verify --head FILE --public-key PUB)")
    if history_key is None or not hmac.compare_digest(
        head.signature, hmac.new(history_key, payload, hashlib.sha256).hexdigest()
    ):
        return [Finding(None, None, "its signature does not match the history key: it was edited, or signed with "
                                    "another key", row="head file")]
    return []


def head_findings(
    key: bytes, head: SignedHead, entries: list[StoredEntry], public_key: Ed25519PublicKey | None = None
) -> list[Finding]:
    """What shows that `entries` do not extend a head recorded earlier: a signature that does not hold (under the
    history `key`, or `public_key` for an Ed25519 head), a cut tail, or a rewritten history."""
    signature = head_signature_findings(head, key, public_key)
    if signature:
        return signature
    if len(entries) < head.entries:
        return [Finding(None, None, f"the history has {len(entries)} entries; at {head.at} it had {head.entries}: "
                                    "entries were cut from its tail", row="signed head")]
    if head.entries and entries[head.entries - 1].entry_hash != head.head_hash:
        return [Finding(entries[head.entries - 1].entry_id, None,
                        f"its hash is not the head hash signed at {head.at}: the history was rewritten")]
    return []
