"""`dpfleet init`: write a commented starter config that trains as it is."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from orchestrator.config import GROUPS, documented_keys, toml_literal
from orchestrator.errors import UsageError

DEFAULT_PATH = "dpfleet.toml"
# The main job (examples/mnist.toml): 3600 steps, PLD epsilon 0.853 at delta 1e-5.
STARTER = {
    "dataset": "mnist",
    "model": "gdp_cnn",
    "epochs": 15,
    "batch_size": 250,
    "noise_multiplier": 1.3,
    "clip_norm": 1.5,
    "delta": 1e-5,
    "accountant": "pld",
    "optimizer": "sgd",
    "learning_rate": 0.25,
    "workers": 2,
    "cpus_per_worker": 1,
    "max_physical_batch": 250,
    "run_dir": "runs/starter",
}


def add_init_arguments(init: argparse.ArgumentParser) -> None:
    """The arguments of `init`."""
    init.description = ("Write a starter training config: the main job (DP-SGD on MNIST, PLD epsilon 0.853 at "
                        "delta 1e-5), with every other key commented out at its default.")
    init.add_argument("path", nargs="?", default=DEFAULT_PATH, metavar="PATH",
                      help=f"where to write it (default {DEFAULT_PATH})")
    init.add_argument("--force", action="store_true", help="replace PATH if it exists")
    init.set_defaults(handler=f"{__name__}:run_init")


def starter_config(width: int = 100) -> str:
    """The starter config's TOML: every key by group, with its meaning; the unset ones commented out."""
    lines = [
        "# A dpfleet training config, written by `dpfleet init`: the main job, DP-SGD on MNIST.",
        "# 15 epochs at expected batch 250 over N = 60000 are 3600 steps at PLD epsilon 0.853 (delta 1e-5).",
        "# Train it with `dpfleet train --config THIS_FILE`; `dpfleet ledger status` then shows the budget left.",
        "# A commented-out key shows its default. docs/config-reference.md gives every key's type and range.",
    ]
    keys = documented_keys()
    for group in GROUPS:
        lines += ["", f"# --- {group} ---"]
        for item in keys:
            if item.group != group:
                continue
            text = f"{item.name}: {item.meaning} Default: {item.default}.".replace("`", "")
            lines += [""] + textwrap.wrap(text, width - 2, initial_indent="# ", subsequent_indent="# ",
                                          break_on_hyphens=False)
            if item.name in STARTER:
                lines.append(f"{item.name} = {toml_literal(STARTER[item.name])}")
            elif item.literal is not None:
                lines.append(f"# {item.name} = {item.literal}")
    return "\n".join(lines) + "\n"


def run_init(args: argparse.Namespace) -> int:
    """Write the starter config to PATH, refusing to replace a file without --force."""
    path = Path(args.path)
    if path.exists() and not args.force:
        raise UsageError(f"{path} exists; give another PATH, or --force to replace it")
    path.write_text(starter_config())
    print(f"wrote {path}; train it with: dpfleet train --config {path}")
    return 0
