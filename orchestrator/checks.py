"""Range checks shared by command-line flags and config keys.

Each check names the flag or key it looked at, states the valid range and
raises UsageError, so the command line can exit with status 2 and one line.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable

from orchestrator.errors import UsageError


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{name} must be a number (got {value!r})") from None
    value = float(value)
    if not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number (got {value!r})")
    return value


def positive_number(name: str, value: Any) -> float:
    """A finite number > 0."""
    number = _number(name, value)
    if number <= 0.0:
        raise UsageError(f"{name} must be > 0 (got {number:g})")
    return number


def non_negative_number(name: str, value: Any) -> float:
    """A finite number >= 0."""
    number = _number(name, value)
    if number < 0.0:
        raise UsageError(f"{name} must be >= 0 (got {number:g})")
    return number


def open_unit_interval(name: str, value: Any) -> float:
    """A number strictly between 0 and 1 (a delta)."""
    number = _number(name, value)
    if not 0.0 < number < 1.0:
        raise UsageError(f"{name} must be in (0, 1) (got {number:g})")
    return number


def half_open_unit_interval(name: str, value: Any) -> float:
    """A number in (0, 1] (a sampling rate)."""
    number = _number(name, value)
    if not 0.0 < number <= 1.0:
        raise UsageError(f"{name} must be in (0, 1] (got {number:g})")
    return number


def integer_at_least(name: str, value: Any, least: int) -> int:
    """An integer >= `least` (floats with an integer value are accepted)."""
    number = _number(name, value)
    if number != int(number):
        raise UsageError(f"{name} must be a whole number (got {number:g})")
    if number < least:
        raise UsageError(f"{name} must be an integer >= {least} (got {int(number)})")
    return int(number)


def integer_in_range(name: str, value: Any, least: int, most: int) -> int:
    """An integer in [`least`, `most`]."""
    number = integer_at_least(name, value, least)
    if number > most:
        raise UsageError(f"{name} must be an integer in [{least}, {most}] (got {number})")
    return number


def one_of(name: str, value: Any, choices: Iterable[str]) -> str:
    """A string from `choices`."""
    choices = list(choices)
    if value not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)} (got {value!r})")
    return value


def unknown_names(unknown: Iterable[str], valid: Iterable[str]) -> str:
    """Unknown names, sorted, each followed by the valid name closest to it, if one is close: ``stepz (did you mean
    `steps`?)``. A misspelling gets its fix; the whole list of valid names is left to the help and the reference."""
    valid = sorted(valid)
    shown = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, valid, n=1)
        shown.append(f"{name} (did you mean `{close[0]}`?)" if close else name)
    return ", ".join(shown)


def batch_within_dataset(batch_name: str, batch_size: int, dataset_size: int) -> float:
    """The sampling rate batch_size / dataset_size, refusing a batch larger than the dataset."""
    if batch_size > dataset_size:
        raise UsageError(
            f"{batch_name} ({batch_size}) must not exceed the dataset size ({dataset_size}); "
            "the sampling rate batch/dataset must be in (0, 1]"
        )
    return batch_size / dataset_size
