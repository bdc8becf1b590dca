"""Where the embedded ledger and the history key live on this machine, and who its local user is."""

from __future__ import annotations

import contextlib
import getpass
import os
import secrets
from pathlib import Path

from accounting.ledger.errors import FailedPrecondition


def default_ledger_path() -> Path:
    """The embedded ledger file: $DPFLEET_HOME/ledger.db, else ~/.local/share/dpfleet/ledger.db."""
    home = os.environ.get("DPFLEET_HOME")
    base = Path(home) if home else Path.home() / ".local" / "share" / "dpfleet"
    return base / "ledger.db"


def default_history_key_path() -> Path:
    """The history key file: ledger-history.key beside the embedded ledger file, in $DPFLEET_HOME or
    ~/.local/share/dpfleet (for a ledger anywhere, a file or a database: the key is never in it)."""
    return default_ledger_path().parent / "ledger-history.key"


_HISTORY_KEY_BYTES = 32


def load_history_key(path: str | os.PathLike | None = None) -> bytes:
    """The key the history is chained with, from `path` (default `default_history_key_path()`).

    A missing file is created with a new random 256-bit key, mode 0600;
    several processes creating it at once agree on one key. A file that
    others than its owner and group may read, or others than its owner may
    write, is refused: the key is what lets `verify` tell a rewritten
    history. (Its group may read it: Kubernetes gives a mounted Secret's
    files to the pod's fsGroup.)
    """
    path = Path(path) if path is not None else default_history_key_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_hex(_HISTORY_KEY_BYTES) + "\n")
                file.flush()
                os.fsync(file.fileno())
            with contextlib.suppress(FileExistsError):  # another process made it first: use that one
                os.link(draft, path)
        finally:
            draft.unlink()
    mode = path.stat().st_mode
    if mode & 0o027:
        raise FailedPrecondition(
            f"the history key {path} may be read or written by others (mode {mode & 0o777:o}); "
            f"make it the owner's only: chmod 600 {path}"
        )
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != _HISTORY_KEY_BYTES:
        raise FailedPrecondition(
            f"the history key {path} is not {2 * _HISTORY_KEY_BYTES} hex digits; restore it from its backup "
            "(see docs/ledger.md, 'The history key and the signed head')"
        )
    return key


def local_user() -> str:
    """The name of the user running this process, for the actor of what the embedded ledger records."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, as in some containers
        return "unknown"
