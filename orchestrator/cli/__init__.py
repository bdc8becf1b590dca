"""The `dpfleet` command: one parser, one module per command group.

``COMMANDS`` names each command, its help line, and the function in its
module that adds its arguments. A command's module is imported only when that
command runs (or when the whole parser is built, for the reference), and its
handler, a ``module:function`` name, only when the command runs: `dpfleet
--help`, `--version`, `eps`, `noise`, `init`, `config`, `data --help` and the ledger
commands never load torch, torchvision or Ray. Adding a command is one entry.
`python -m orchestrator.cli` is the same as the `dpfleet` console script.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import select
import sys
from dataclasses import dataclass
from typing import Any, Collection, Sequence, TextIO

from accounting.lazy import public_face
from orchestrator import __version__
from orchestrator.cli.display import plain_when_asked, quiet_ray_start, quiet_third_party
from orchestrator.errors import BudgetRefusedError, LedgerTimeoutError, ShardTimeoutError, UsageError

# `main` is the `dpfleet` console script (pyproject.toml); `build_parser` and `run_job` serve the Python API.
__getattr__, __dir__, __all__ = public_face(__name__, {"display": ["format_table", "quiet_ray_start"],
                                                        "train": ["run_job"]},
                                            defined_here=["build_parser", "main"])


@dataclass(frozen=True)
class Command:
    """One `dpfleet` command: its help line, and the ``module:function`` that adds its arguments to its parser."""

    help: str
    adds_arguments: str


COMMANDS = {
    "eps": Command("epsilon of a DP-SGD run", "orchestrator.cli.privacy:add_eps_arguments"),
    "noise": Command("noise multiplier for a target epsilon", "orchestrator.cli.privacy:add_noise_arguments"),
    "train": Command("train a model with DP-SGD on Ray workers", "orchestrator.cli.train:add_train_arguments"),
    "tune": Command("search hyperparameters: every trial an ordinary job, every trial charged",
                    "orchestrator.cli.tune:add_tune_arguments"),
    "init": Command("write a commented starter config", "orchestrator.cli.init:add_init_arguments"),
    "config": Command("the training config's JSON Schema, for editors", "orchestrator.cli.config:add_config_arguments"),
    "ledger": Command("the global privacy ledger: budgets, jobs, history, server",
                      "orchestrator.cli.ledger_parser:add_ledger_arguments"),
    "audit": Command("measure a lower bound on epsilon from one training run with canaries",
                     "orchestrator.cli.audit:add_audit_arguments"),
    "submit": Command("run `dpfleet train` as a job on a running Ray cluster",
                      "orchestrator.cli.submit:add_submit_arguments"),
    "data": Command("write datasets into the file formats training reads, and check a config's data by its rules",
                    "orchestrator.cli.data_parser:add_data_arguments"),
    "export": Command("write a finished run's model as safetensors (a pretrained model's as a Hugging Face "
                      "folder), with a model card, to share",
                      "orchestrator.cli.export:add_export_arguments"),
    "predict": Command("write a released model's predictions on a file of examples",
                       "orchestrator.cli.predict:add_predict_arguments"),
    "generate": Command("sample text from a released causal language model (a pretrained model's run)",
                        "orchestrator.cli.generate:add_generate_arguments"),
}


def load(name: str) -> Any:
    """The object that ``module:attribute`` names, importing its module now (the one place commands are loaded)."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse's hook
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser(commands: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The `dpfleet` parser, with the arguments of ``commands`` (by default every command's).

    The other commands are there by name and help line only, which is all
    `dpfleet --help` and a mistyped command's error show.
    """
    parser = _Parser(
        prog="dpfleet",
        description="Differentially private training across a Ray cluster, with a global privacy ledger.",
    )
    parser.add_argument("--version", action="version", version=f"dpfleet {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for name, entry in COMMANDS.items():
        command_parser = subparsers.add_parser(name, help=entry.help)
        if name in commands:
            load(entry.adds_arguments)(command_parser)
            # After a command's own flags too (`dpfleet train --debug`); unset there, the top level's value stands.
            command_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
            command_parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                                        help=VERBOSE_HELP)
    return parser


# Terminal colour codes, which Ray puts in the text of a remote error.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a traceback: the exception's class and its message.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")
# What a shell reports for a command that SIGPIPE ended: 128 + the signal's number.
SIGPIPE_EXIT_STATUS = 141
DEBUG_HELP = "on an unexpected error, show the whole traceback instead of one paragraph"
VERBOSE_HELP = "also show Ray's own lines as it starts (a local instance started, token authentication)"


def command_words(argv: Sequence[str]) -> tuple[str, ...]:
    """The command ``argv`` runs, as a 1-tuple, or () before one is named (the top level has no option values)."""
    return tuple(word for word in argv if not word.startswith("-"))[:1]


def main(argv: list[str] | None = None) -> int:
    """Run one `dpfleet` command and return its exit status.

    The current directory goes first on the import path, as with
    ``python -m``: ``package.module:function`` specs (models, datasets,
    losses) name modules relative to where the command runs. Output carries
    no colour under NO_COLOR or when stderr is not a terminal.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    quiet_third_party(os.environ)
    plain_when_asked(os.environ, sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command_words(argv)).parse_args(argv)
    quiet_ray_start(args.verbose)
    try:
        return load(args.handler)(args)
    except (UsageError, BudgetRefusedError, LedgerTimeoutError, ShardTimeoutError) as error:
        print(f"dpfleet {args.command}: error: {error}", file=sys.stderr)
        return error.exit_status
    except KeyboardInterrupt:
        print(f"dpfleet {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one paragraph, not a traceback, unless --debug asks for it
        if isinstance(error, BrokenPipeError) and reader_left(sys.stdout):
            # Whoever read the output stopped (`| head`): nothing more goes there, and the command ends as a Unix
            # tool that SIGPIPE stops does.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return SIGPIPE_EXIT_STATUS
        if args.debug:
            raise
        print(f"dpfleet {args.command}: error: {one_paragraph(error)}", file=sys.stderr)
        return 1


def reader_left(stream: TextIO) -> bool:
    """Whether `stream` is a pipe whose reader has closed its end (poll reports an error on the write end)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor, or no poll on this platform
        return False


def one_paragraph(error: BaseException) -> str:
    """An unexpected error as one paragraph: its innermost cause (a Ray task's error is what the task raised),
    its message's first line, and how to see the traceback. A ledger's refusal or silence says what to check."""
    while getattr(error, "cause", None) is not None and error.cause is not error:  # Ray's RayTaskError
        error = error.cause
    lines = [line for line in _ANSI_ESCAPE.sub("", str(error)).strip().splitlines() if line.strip()]
    message = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(lines) > 1 and _EXCEPTION_LINE.match(lines[-1].strip()):
        # A remote failure carried as text (an actor that died in its creation task): its last line says what.
        message = f"{message.split(',')[0]}: {lines[-1].strip()}"
    if type(error).__module__.startswith("accounting.ledger"):
        return (f"the ledger answered {message}; check the ledger's address and token (--ledger and --token, or "
                "DPFLEET_LEDGER and DPFLEET_TOKEN)")
    return f"{message} (run again with --debug for the traceback)"
