"""`dpfleet config`: what the training config's declaration gives besides checking a file, e.g. its JSON Schema."""

from __future__ import annotations

import argparse
import json

from orchestrator.config import json_schema


def add_config_arguments(config: argparse.ArgumentParser) -> None:
    """The `config` commands and their arguments."""
    commands = config.add_subparsers(dest="config_command", required=True, parser_class=type(config))
    schema = commands.add_parser(
        "schema",
        help="print the JSON Schema of a training config, for editors",
        description="Print the JSON Schema of a `dpfleet train --config` file: every key with its type, range, "
                    "default and meaning. An editor that checks TOML against a JSON Schema (e.g. Even Better "
                    "TOML, with a `#:schema PATH` first line) then completes keys and marks bad values.",
    )
    schema.set_defaults(handler=f"{__name__}:run_schema")


def run_schema(args: argparse.Namespace) -> int:
    """Print the schema as indented JSON."""
    print(json.dumps(json_schema(), indent=2, ensure_ascii=False))
    return 0
