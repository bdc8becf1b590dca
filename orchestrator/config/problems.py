"""Every bad key of a config at once, each in the words of the command line's other errors, with where it was given."""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from orchestrator.checks import unknown_names
from orchestrator.config.fields import choices, range_text, value_type
from orchestrator.config.model import KEYS, KeyProblems, TrainConfig
from orchestrator.errors import UsageError


def _shown(value: Any, integer: bool) -> str:
    """A refused number as the errors quote it: ``0``, ``-1``, ``2.5``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return repr(value)
    if integer and number == int(number):
        return str(int(number))
    return f"{number:g}"


def _field_message(name: str, field: FieldInfo, error: dict) -> str:
    """One refused key's error: what was wrong, the valid range, and the value given."""
    kind, value = error["type"], error["input"]
    integer = value_type(field) is int
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{name} must be {range_text(field)} (got {_shown(value, integer)})"
    if kind == "literal_error":
        return f"{name} must be one of {', '.join(choices(field))} (got {value!r})"
    if kind in ("bool_type", "bool_parsing"):
        return f"{name} must be true or false (got {value!r})"
    if kind == "finite_number":
        return f"{name} must be a finite number (got {value!r})"
    if kind in ("int_parsing", "int_from_float", "int_type"):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if math.isfinite(number) and not isinstance(value, bool):
            return f"{name} must be a whole number (got {number:g})"
    if kind in ("int_parsing", "int_from_float", "int_type", "float_parsing", "float_type"):
        return f"{name} must be a number (got {value!r})"
    if kind in ("dataclass_type", "dataclass_exact_type", "dict_type", "model_type"):
        return f"{name} must be a table (got {value!r})"
    return f"{name}: {error['msg']} (got {value!r})"


def _located(location: tuple) -> tuple[str, FieldInfo]:
    """Where in the config a problem lies: its key path (``adaptive_clipping.target_quantile``,
    ``shards[0].resources.silo-a``), and the field declared there (an item's, for a list's or a table's item)."""
    field, path = TrainConfig.model_fields[location[0]], str(location[0])
    for part in location[1:]:
        annotation = value_type(field)
        fields = getattr(annotation, "__pydantic_fields__", None)
        items, origin = typing.get_args(annotation), typing.get_origin(annotation)
        if isinstance(part, str) and fields and part in fields:
            field, path = fields[part], f"{path}.{part}"
        elif isinstance(part, int) and origin in (tuple, list) and items:
            field, path = FieldInfo.from_annotation(items[0]), f"{path}[{part}]"
        elif isinstance(part, str) and origin in (dict, Mapping) and len(items) == 2:
            field, path = FieldInfo.from_annotation(items[1]), f"{path}.{part}"
        else:
            break
    return path, field


def _unknown_in_tables(unknown: dict[tuple, list[str]]) -> list[tuple[str, UsageError]]:
    """One error per sub-table given keys it does not declare: the keys it takes, and the unknown ones."""
    found = []
    for location, names in unknown.items():
        path, field = _located(location)
        takes = list(value_type(field).__pydantic_fields__)
        found.append((str(location[0]), UsageError(f"{path} takes {', '.join(takes)}; unknown: "
                                                   f"{unknown_names(names, takes)}")))
    return found


def problem_lines(error: ValidationError) -> list[tuple[str | None, UsageError]]:
    """(the key, or None for a rule between keys, and its UsageError) for every problem pydantic found.

    A problem inside a sub-table names its key path, ``optimizer.betas``; the key is the top-level one.
    """
    found, unknown, unknown_in_tables = [], [], {}
    for item in error.errors():
        location = item["loc"]
        if item["type"] == "extra_forbidden" and len(location) == 1:
            unknown.append(str(location[0]))
            continue
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a sub-table's word for it
            unknown_in_tables.setdefault(location[:-1], []).append(str(location[-1]))
            continue
        name = str(location[0]) if location else None
        cause = item.get("ctx", {}).get("error")
        if isinstance(cause, KeyProblems):
            found += [(None, problem) for problem in cause.problems]
        elif isinstance(cause, UsageError):
            found.append((name, cause))
        elif isinstance(cause, ValueError):
            found.append((name, UsageError(str(cause))))
        else:
            path, field = _located(location)
            found.append((name, UsageError(_field_message(path, field, item))))
    found += _unknown_in_tables(unknown_in_tables)
    if unknown:
        found.insert(0, (None, UsageError(
            f"unknown config key(s): {unknown_names(unknown, KEYS)}; docs/config-reference.md and `dpfleet train "
            "--help` list every key"
        )))
    return found


def config_error(error: ValidationError, source: str | None = None, overrides: Mapping[str, str] = {}) -> UsageError:
    """One UsageError naming every problem, each line ending with where its key was given: the file, or the flag.

    ``source`` names the file the keys came from (None: no prefix), and
    ``overrides`` maps each key given on the command line to its flag.
    """
    lines, quoted = [], []
    for name, problem in problem_lines(error):
        # The key leads each line, as in every other error; where it was given follows.
        where = f" (from {overrides[name]})" if name in overrides else f" (in {source})" if source else ""
        lines.append(f"{problem}{where}")
        quoted.append(f"{problem.with_values}{where}")
    if len(lines) == 1:
        return UsageError(lines[0], quoted[0])
    heading = f"{len(lines)} problems in the config:"
    return UsageError("\n  ".join([heading, *lines]), "\n  ".join([heading, *quoted]))
