"""The `dpfleet` command: one parser, one module per command group.

`eps` and `noise` (privacy), `train`, `tune`, `init`, `ledger`, `audit`,
`submit`, `data` and `export` each register their parser from their own module; `main` runs one command.
`python -m orchestrator.cli` is the same as the `dpfleet` console script.
"""

from __future__ import annotations

import argparse
import os
import sys

from orchestrator import __version__
from orchestrator.cli.audit import add_audit_parser
from orchestrator.cli.data import add_data_parser
from orchestrator.cli.display import plain_when_asked
from orchestrator.cli.export import add_export_parser
from orchestrator.cli.init import add_init_parser
from orchestrator.cli.ledger import add_ledger_parser
from orchestrator.cli.privacy import add_privacy_parsers
from orchestrator.cli.submit import add_submit_parser
from orchestrator.cli.train import add_train_parser
from orchestrator.cli.tune import add_tune_parser
from orchestrator.errors import BudgetRefusedError, LedgerTimeoutError, ShardTimeoutError, UsageError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse's hook
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The full `dpfleet` parser."""
    parser = _Parser(
        prog="dpfleet",
        description="Differentially private training across a Ray cluster, with a global privacy ledger.",
    )
    parser.add_argument("--version", action="version", version=f"dpfleet {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    add_privacy_parsers(subparsers)
    add_train_parser(subparsers)
    add_tune_parser(subparsers)
    add_init_parser(subparsers)
    add_ledger_parser(subparsers)
    add_audit_parser(subparsers)
    add_submit_parser(subparsers)
    add_data_parser(subparsers)
    add_export_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one `dpfleet` command and return its exit status.

    The current directory goes first on the import path, as with
    ``python -m``: ``package.module:function`` specs (models, datasets,
    losses) name modules relative to where the command runs. Output carries
    no colour under NO_COLOR or when stderr is not a terminal.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    plain_when_asked(os.environ, sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (UsageError, BudgetRefusedError, LedgerTimeoutError, ShardTimeoutError) as error:
        print(f"dpfleet {args.command}: error: {error}", file=sys.stderr)
        return error.exit_status
    except KeyboardInterrupt:
        print(f"dpfleet {args.command}: interrupted", file=sys.stderr)
        return 130
