"""Servers that tests start on loopback themselves: the ledger as a real `dpfleet ledger serve` process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
DPFLEET = [sys.executable, "-m", "orchestrator.cli"]


def start_serve_process(db_path: Path, token_file: Path, port: int = 0) -> tuple[subprocess.Popen, str]:
    """Start `dpfleet ledger serve` on 127.0.0.1:port (0: any free port); return it and its HOST:PORT."""
    process = subprocess.Popen(
        [*DPFLEET, "ledger", "serve", "--db", str(db_path), "--port", str(port)]
        + ["--admin-token-file", str(token_file)],
        cwd=REPOSITORY,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    match = re.fullmatch(r"listening on (127\.0\.0\.1:\d+)\n", line)
    if match is None:
        process.kill()
        pytest.fail(f"ledger serve printed {line!r}; stderr: {process.stderr.read()}")
    return process, match.group(1)
