"""The state `verify` keeps at the last entry it verified, so the next one replays only the entries after it.

`VerifiedState.to_bytes` carries an HMAC under the history key over the
state, so the database's administrator, who can write the row, cannot
forge a state that hides a change: a state whose HMAC does not match is a
finding, and the replays start from the first entry. The state names the
entry it was taken at and that entry's hash (its anchor): a history
rewritten there, even with the key, is a finding too.

The state also carries the schema version the ledger had when it was
written (since SEALED_SINCE_VERSION): a new ledger and every migration
write one, without a replay (sealed, not verified), so a file whose
version number was lowered by hand, or whose state was deleted, is told
from one an older dpfleet wrote.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
from dataclasses import dataclass
from typing import Sequence

from accounting.ledger.verification.findings import Finding
from accounting.ledger.verification.rows import StoredEntry


# Written before the pickled state, under the HMAC: a state of another format (another dpfleet's replays) is not
# read, and the replays start from the first entry.
_FORMAT = b"dpfleet.verified_state.3\n"
_TAG_BYTES = 32

# The schema version from which every ledger keeps a state (store/schema.py writes it at creation and migration).
SEALED_SINCE_VERSION = 12


@dataclass
class VerifiedState:
    """The replays' state after the first `entries` history entries, the last of them `last_entry_id` with hash
    `head_hash` (0 and "" for none), of a ledger at `schema_version`, as a verify that found nothing left it.
    `replay` is the `history.HistoryReplay` at that entry (not imported here: `history` imports this module),
    or None for a state sealed by a creation or migration, which no verify replayed yet."""

    entries: int
    last_entry_id: int
    head_hash: str
    schema_version: int
    replay: object | None

    def to_bytes(self, key: bytes) -> bytes:
        """The state as stored: an HMAC-SHA-256 under the history `key`, then the state."""
        body = _FORMAT + pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
        return hmac.digest(key, body, hashlib.sha256) + body


def verified_state_findings(
    key: bytes, data: bytes, entries: Sequence[StoredEntry]
) -> tuple[VerifiedState | None, list[Finding]]:
    """The state kept in `data` when its HMAC under `key` matches and the history still holds its anchor, and
    what is wrong with it otherwise.

    The state is unpickled only once its HMAC matched: only a holder of the
    history key could have written it. A state of another format is
    skipped without a finding.
    """
    tag, body = data[:_TAG_BYTES], data[_TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.digest(key, body, hashlib.sha256)):
        return None, [Finding(None, None, "its HMAC does not match the history key: it was edited, or written with "
                                          "another key; the replays started from the first entry",
                              row="verified state")]
    if not body.startswith(_FORMAT):
        return None, []
    state = pickle.loads(body[len(_FORMAT):])
    if state.entries == 0:
        return state, []
    if len(entries) < state.entries:
        return None, [Finding(None, None, f"the history has {len(entries)} entries; the last verify checked "
                                          f"{state.entries}: entries were cut from its tail", row="verified state")]
    anchor = entries[state.entries - 1]
    if (anchor.entry_id, anchor.entry_hash) != (state.last_entry_id, state.head_hash):
        return None, [Finding(anchor.entry_id, None, "its hash is not the one the last verify checked there: the "
                                                     "history was rewritten")]
    return state, []


def sealed_version(key: bytes, data: bytes) -> int | None:
    """The schema version a state kept in `data` records, when its HMAC under `key` matches; None for a state
    of an older format (which records none). Raises ValueError for a state whose HMAC does not match."""
    tag, body = data[:_TAG_BYTES], data[_TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.digest(key, body, hashlib.sha256)):
        raise ValueError("its HMAC does not match the history key")
    if not body.startswith(_FORMAT):
        return None
    return pickle.loads(body[len(_FORMAT):]).schema_version
