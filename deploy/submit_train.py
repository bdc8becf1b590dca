"""Run `dpfleet train` with a named config on the head node of a `ray up` cluster.

    ray submit deploy/cluster.yaml deploy/submit_train.py -- --config examples/mnist.toml [dpfleet train flags]

`ray submit` copies only this file to the head, so it imports nothing from
dpfleet: it runs `python -m orchestrator.cli train` inside the dpfleet checkout
that deploy/cluster.yaml's file_mounts keep on the head (~/dpfleet, or
--source), so a relative --config or run_dir means what it means at the
repository root, and it joins the running cluster (RAY_ADDRESS, default
"auto") instead of starting a Ray of its own. Flags it does not know go to
`dpfleet train` as they are (--workers, --steps, --ledger, --token, ...).
Its exit status is dpfleet train's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_SOURCE = "~/dpfleet"


def main(argv: list[str] | None = None) -> int:
    """Run dpfleet train from the checkout on this node against the cluster this node belongs to."""
    parser = argparse.ArgumentParser(
        prog="submit_train.py",
        description="Run `dpfleet train --config FILE` on a Ray cluster's head; other flags go to dpfleet train.",
    )
    parser.add_argument("--config", required=True,
                        help="TOML config; a relative path is taken from the dpfleet checkout (e.g. examples/mnist.toml)")
    parser.add_argument("--source", default=os.environ.get("DPFLEET_SOURCE", DEFAULT_SOURCE),
                        help=f"the dpfleet checkout on this node (default: $DPFLEET_SOURCE, else {DEFAULT_SOURCE})")
    args, train_flags = parser.parse_known_args(argv)
    source = Path(args.source).expanduser()
    if not (source / "orchestrator" / "cli" / "__main__.py").is_file():
        parser.error(
            f"--source {source} holds no dpfleet checkout (no orchestrator/cli/__main__.py); deploy/cluster.yaml's "
            f"file_mounts put one at {DEFAULT_SOURCE}"
        )
    env = dict(os.environ)
    env.setdefault("RAY_ADDRESS", "auto")
    command = [sys.executable, "-m", "orchestrator.cli", "train", "--config", args.config, *train_flags]
    return subprocess.call(command, cwd=source, env=env)


if __name__ == "__main__":
    sys.exit(main())
