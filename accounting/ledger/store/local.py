"""Where the embedded ledger lives on this machine, where the history key comes from, the Ed25519 key files
that sign and check heads, and who its local user is."""

from __future__ import annotations

import contextlib
import getpass
import os
import secrets
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from accounting.ledger.errors import FailedPrecondition, InvalidArgument


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
# How long the operator's command (a secrets manager's client) may take to print the key.
HISTORY_KEY_COMMAND_SECONDS = 30.0


@dataclass(frozen=True)
class HistoryKeySource:
    """Where the history key comes from: a `file`, an environment variable (`env`) or a `command` whose standard
    output is the key (a secrets manager's client). Each holds the key as 64 hex digits; `where` is the file's
    path, the variable's name or the command line. Prints as where the key comes from, never as the key."""

    kind: str
    where: str

    def __str__(self) -> str:
        if self.kind == "env":
            return f"${self.where}"
        if self.kind == "command":
            return f"the output of {self.where!r}"
        return self.where


def history_key_source(
    file: str | os.PathLike | None = None, env: str | None = None, command: str | None = None
) -> HistoryKeySource | None:
    """The one source of the history key the operator named (None: none, the default file).

    InvalidArgument when more than one is named, or one is empty.
    """
    named = [(kind, where) for kind, where in (("file", file), ("env", env), ("command", command)) if where is not None]
    if len(named) > 1:
        raise InvalidArgument(
            "give the history key from one place: --history-key FILE, --history-key-env VAR or "
            f"--history-key-command 'CMD' (got {', '.join(kind for kind, _ in named)})"
        )
    if not named:
        return None
    kind, where = named[0]
    if not str(where).strip():
        raise InvalidArgument(f"the history key's {kind} is empty; name the {kind} that holds the key")
    return HistoryKeySource(kind, str(where))


def load_history_key(source: HistoryKeySource | str | os.PathLike | None = None) -> bytes:
    """The key the history is chained with, from `source`: a HistoryKeySource, or a file's path (default
    `default_history_key_path()`).

    A missing file is created with a new random 256-bit key, mode 0600;
    several processes creating it at once agree on one key. A file that
    others than its owner and group may read, or others than its owner may
    write, is refused: the key is what lets `verify` tell a rewritten
    history. (Its group may read it: Kubernetes gives a mounted Secret's
    files to the pod's fsGroup.) An environment variable or a command is
    only read, never written; a command runs without a shell (its line split
    as shlex does), and its standard output is the key.
    """
    if not isinstance(source, HistoryKeySource):
        source = HistoryKeySource("file", str(source if source is not None else default_history_key_path()))
    if source.kind == "env":
        text = os.environ.get(source.where)
        if text is None:
            raise FailedPrecondition(
                f"the history key's environment variable {source.where} is not set; set it to the key's 64 hex "
                "digits (the content of a ledger-history.key file)"
            )
    elif source.kind == "command":
        text = _history_key_command_output(source.where)
    else:
        text = _history_key_file_text(Path(source.where))
    return _history_key_from_text(text, source)


def _history_key_file_text(path: Path) -> str:
    """The text of the key file at `path`, created with a new key if missing; refused when others may read it."""
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
    _check_owner_only(path, "the history key")
    return path.read_text()


def _check_owner_only(path: Path, what: str) -> None:
    """Refuse a key file that others than its owner and group may read, or others than its owner may write."""
    mode = path.stat().st_mode
    if mode & 0o027:
        raise FailedPrecondition(
            f"{what} {path} may be read or written by others (mode {mode & 0o777:o}); "
            f"make it the owner's only: chmod 600 {path}"
        )


def _history_key_command_output(command: str) -> str:
    """What `command` (split as shlex does, run without a shell) prints; FailedPrecondition when it fails."""
    try:
        argv = shlex.split(command)
    except ValueError as error:
        raise FailedPrecondition(f"--history-key-command {command!r} cannot be split into words: {error}") from None
    if not argv:
        raise FailedPrecondition("--history-key-command is empty; give the command that prints the history key")
    try:
        run = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HISTORY_KEY_COMMAND_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = (
            f"it did not finish in {HISTORY_KEY_COMMAND_SECONDS:g} s" if isinstance(error, subprocess.TimeoutExpired)
            else f"it cannot run: {error.strerror or error}"
        )
        raise FailedPrecondition(f"the history key's command {command!r} gave no key: {reason}") from None
    if run.returncode != 0:
        # Its standard error only: its standard output may hold key material.
        said = run.stderr.strip()[-500:]
        raise FailedPrecondition(
            f"the history key's command {command!r} exited with status {run.returncode}"
            + (f"; it said: {said}" if said else "")
        )
    return run.stdout


def _history_key_from_text(text: str, source: HistoryKeySource) -> bytes:
    """The key in `text`, 64 hex digits with blanks around them; FailedPrecondition naming `source` otherwise."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != _HISTORY_KEY_BYTES:
        raise FailedPrecondition(
            f"the history key {source} is not {2 * _HISTORY_KEY_BYTES} hex digits; restore it from its backup "
            "(see docs/ledger.md, 'The history key and the signed head')"
        )
    return key


def served_key_placement_problem(
    source: HistoryKeySource | str | os.PathLike | None,
    database: str | os.PathLike,
    on_postgresql: bool,
    allow_key_beside_database: bool = False,
) -> str | None:
    """Why a server must not start with the history key from `source` (None: the default file) for the ledger at
    `database`; None when it may.

    A key file in the SQLite file's folder, or the default file (named or
    not), is one that whoever writes the database as the server's user can
    read, and so re-chain a rewritten history: refused unless
    `allow_key_beside_database`. A ledger on PostgreSQL has no default key
    (each of its servers needs the same, and the database is elsewhere): an
    unnamed key is refused whatever the flag.
    """
    alternatives = (
        "give the key from a file another user owns, readable through its group (--history-key FILE), from an "
        "environment variable (--history-key-env VAR) or from a secrets manager (--history-key-command 'CMD'); "
        "see docs/ledger.md, 'Where the history key lives'"
    )
    if source is None and on_postgresql:
        return (
            "a ledger on PostgreSQL needs its history key named, the same for every server of the database: "
            f"{alternatives}"
        )
    if allow_key_beside_database:
        return None
    if not isinstance(source, HistoryKeySource):
        source = HistoryKeySource("file", str(source if source is not None else default_history_key_path()))
    if source.kind != "file":
        return None
    key_file = Path(source.where).resolve()
    if key_file == default_history_key_path().resolve():
        placement = (f"the history key is the default {source.where}, beside the embedded ledger, a file of the "
                     "server's own user")
    elif not on_postgresql and key_file.parent == Path(database).resolve().parent:
        placement = f"the history key {source.where} is in the database's folder {key_file.parent}"
    else:
        return None
    return (
        f"{placement}, so whoever can write the database as that user can read the key and re-chain a rewritten "
        f"history; {alternatives}; or accept this with --allow-key-beside-database"
    )


def new_signing_key(path: str | os.PathLike) -> Path:
    """Write a new Ed25519 key to sign heads with: the private key at `path` (PEM, mode 0600, never over an
    existing file) and its public key at `path`.pub (PEM), which is returned, for tenants to check heads with."""
    path = Path(path)
    public_path = path.with_name(path.name + ".pub")
    private_key = Ed25519PrivateKey.generate()
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for written, content, mode in ((public_path, public_pem, 0o644), (path, private_pem, 0o600)):
        try:
            descriptor = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            if written == path:  # the public key just written belongs to no private key
                public_path.unlink()
            raise FailedPrecondition(
                f"{written} exists; a signing key is never written over: name a new file"
            ) from None
        with os.fdopen(descriptor, "wb") as file:
            file.write(content)
    return public_path


def load_signing_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The Ed25519 private key that signs heads, from the PEM file `new_signing_key` wrote (its owner's only)."""
    path = Path(path)
    _check_owner_only(path, "the signing key")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except ValueError:
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise FailedPrecondition(f"the signing key {path} is not an Ed25519 private key in PEM; make one with "
                                 "dpfleet ledger signing-key new FILE")
    return key


def load_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    """The Ed25519 public key that checks heads, from the PEM file (FILE.pub) `new_signing_key` wrote."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except ValueError:
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise FailedPrecondition(f"the public key {path} is not an Ed25519 public key in PEM (the FILE.pub that "
                                 "dpfleet ledger signing-key new FILE wrote)")
    return key


def local_user() -> str:
    """The name of the user running this process, for the actor of what the embedded ledger records."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, as in some containers
        return "unknown"
