"""Plain-text tables, number formatting, and what the terminal is sent (colour, progress bars)."""

from __future__ import annotations

import json
import logging
from typing import IO, Any, MutableMapping, Sequence


def format_number(value: Any) -> str:
    """Numbers as a person reads them: floats to 4 significant digits, ints and text as they are."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned text table with a header rule."""
    cells = [[format_number(value) for value in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.ljust(width) for header, width in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells)
    return "\n".join(lines)


def print_json(payload: Any) -> None:
    """One JSON document on one line (the last line a script reads)."""
    print(json.dumps(payload, sort_keys=True), flush=True)


def is_terminal(stream: IO) -> bool:
    """Whether ``stream`` is an interactive terminal (progress bars redraw in place only there)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def show_progress(no_progress: bool, stream: IO) -> bool:
    """Progress bars unless ``--no-progress``, and only on a terminal: elsewhere each epoch is one log line."""
    return not no_progress and is_terminal(stream)


def plain_when_asked(environ: MutableMapping[str, str], stream: IO) -> None:
    """No colour under NO_COLOR (https://no-color.org) or when ``stream`` is not a terminal.

    dpfleet prints no colour of its own; Ray colours the prefixes of the
    worker log lines it forwards unless RAY_COLOR_PREFIX is 0.
    """
    if environ.get("NO_COLOR") or not is_terminal(stream):
        environ.setdefault("RAY_COLOR_PREFIX", "0")


# What Ray's loggers say on every start, by logger: a local instance started, and whether token authentication is
# on (the cluster operator's concern). Shown with --verbose only.
_RAY_START_LINES = {
    "ray._private.worker": "Started a local Ray instance",
    "ray._private.authentication.authentication_token_setup": "Token authentication is",
}


def quiet_third_party(environ: MutableMapping[str, str]) -> None:
    """Silence what the libraries under dpfleet print that is not the user's concern.

    gRPC's and absl's C++ logs below errors (set before grpc loads; a value
    the user set stands), absl's Python warnings, and the progress bars of
    transformers and the Hugging Face hub (saving an export's weights).
    """
    environ.setdefault("GRPC_VERBOSITY", "ERROR")
    environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    environ.setdefault("GLOG_minloglevel", "2")
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # dp_accounting's absl warnings about RDP orders it leaves out: the bound stays valid without them.
    logging.getLogger("absl").setLevel(logging.ERROR)


def quiet_ray_start(verbose: bool) -> None:
    """Hide Ray's start-up lines (``_RAY_START_LINES``) unless ``verbose`` (`--verbose`) asks for them."""
    for name in _RAY_START_LINES:
        logger = logging.getLogger(name)
        logger.removeFilter(_not_a_ray_start_line)
        if not verbose:
            logger.addFilter(_not_a_ray_start_line)


def _not_a_ray_start_line(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_RAY_START_LINES.get(record.name, "\0"))
