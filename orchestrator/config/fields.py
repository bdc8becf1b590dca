"""How a config key is declared: its default, range and documentation in one ``key(...)`` call.

A key's TOML type, valid range and choices are read back from its
declaration (its annotation and its pydantic constraints) by the
references, the error messages and the JSON Schema; ``kind`` and ``valid``
are written out only where the declaration cannot say it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import annotated_types
from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

_DOCUMENTATION = "x-dpfleet"
_KINDS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def key(default: Any, meaning: str, *, kind: str | None = None, valid: str | None = None,
        shown_default: str | None = None, schema: dict | None = None, **constraints: Any) -> Any:
    """A config key: its default, its range (pydantic's ``ge``, ``gt``, ``lt``, ...) and its documentation.

    ``meaning`` says what the key does (Markdown). ``kind`` (its TOML type)
    and ``valid`` (its range or choices, Markdown) are needed only where the
    annotation and constraints do not say them; ``shown_default`` is the
    default as a person reads it, where the default value alone does not say
    it; ``schema`` is the key's JSON Schema where its value is a table that
    a parser, not the annotation, checks.
    """
    documentation = {name: value for name, value in
                     (("kind", kind), ("valid", valid), ("default", shown_default)) if value is not None}
    extra = {**(schema or {}), _DOCUMENTATION: documentation}
    return Field(default, description=meaning, json_schema_extra=extra, **constraints)


def documentation(field: FieldInfo) -> dict[str, str]:
    """The documentation ``key`` gave a field beyond its meaning: any of kind, valid and default."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return dict(extra.get(_DOCUMENTATION, {}))


def value_type(field: FieldInfo) -> Any:
    """The field's annotation without ``| None``."""
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(others) == 1:
            return others[0]
    return annotation


def choices(field: FieldInfo) -> tuple[str, ...] | None:
    """A ``Literal`` key's choices, in declaration order; None for any other key."""
    annotation = value_type(field)
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def kind(field: FieldInfo) -> str:
    """The key's TOML type as the references name it: integer, number, string, boolean, or as declared."""
    declared = documentation(field).get("kind")
    if declared:
        return declared
    annotation = value_type(field)
    return "string" if choices(field) else _KINDS[annotation]


def bounds(field: FieldInfo) -> dict[str, float]:
    """The field's numeric constraints by name (``ge``, ``gt``, ``le``, ``lt``)."""
    found = {}
    for constraint in field.metadata:
        for name in ("ge", "gt", "le", "lt"):
            if isinstance(constraint, getattr(annotated_types, name.capitalize())):
                found[name] = getattr(constraint, name)
    return found


def _interval(limits: dict[str, float]) -> str | None:
    """Bounds on both sides as an interval: ``in (0, 1)``, ``in [0, 1)``; None unless both sides are bounded."""
    low = [(name, limits[name]) for name in ("gt", "ge") if name in limits]
    high = [(name, limits[name]) for name in ("lt", "le") if name in limits]
    if not (low and high):
        return None
    (low_name, low_value), (high_name, high_value) = low[0], high[0]
    return (f"in {'(' if low_name == 'gt' else '['}{low_value:g}, {high_value:g}"
            f"{')' if high_name == 'lt' else ']'}")


def range_text(field: FieldInfo) -> str:
    """The valid range as the errors word it: ``an integer >= 1``, ``> 0``, ``>= 0``, ``in (0, 1)``."""
    limits = bounds(field)
    interval = _interval(limits)
    if interval:
        return interval
    words = [f"{symbol} {limits[name]:g}" for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
             if name in limits]
    text = " and ".join(words)
    return f"an integer {text}" if value_type(field) is int else text


def valid_text(field: FieldInfo) -> str:
    """The valid range or choices as the references show them (Markdown): declared, else read from the field."""
    declared = documentation(field).get("valid")
    if declared:
        return declared
    options = choices(field)
    if options:
        quoted = [f'`"{option}"`' for option in options]
        return " or ".join(quoted) if len(quoted) == 2 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    if value_type(field) is bool:
        return "`true` or `false`"
    limits = bounds(field)
    interval = _interval(limits)
    if interval:
        return interval
    symbols = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
    return ", ".join(f"{symbol} {limits[name]:g}" for name, symbol in symbols if name in limits)


def _shown_default(value: Any) -> str:
    """A sub-table key's default as the references show it (Markdown)."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _table_valid_text(field: FieldInfo) -> str:
    """A sub-table key's range or choices (Markdown); a table of names has its values' range."""
    valid = valid_text(field)
    items = typing.get_args(value_type(field))
    if not valid and typing.get_origin(value_type(field)) in (dict, Mapping) and len(items) == 2:
        item = FieldInfo.from_annotation(items[1])
        valid = f"a table of name = {_KINDS.get(item.annotation, 'value')} ({valid_text(item)})"
    return valid


def table_text(table: type) -> str:
    """A sub-table's keys as the references show them (Markdown), read from its declaration.

    Each key with its range or choices and its default, e.g.
    ``{ kind, decay, ... }`` with ``decay`` (> 0; default 1).
    """
    fields = table.__pydantic_fields__
    described = []
    for name, field in fields.items():
        shown, value = documentation(field).get("default"), field.get_default(call_default_factory=True)
        default = (f"default {shown}" if shown else "" if value in (None, PydanticUndefined, {}, ())
                   else f"default {_shown_default(value)}")
        details = "; ".join(part for part in (_table_valid_text(field), default) if part)
        described.append(f"`{name}`" + (f" ({details})" if details else ""))
    return f"`{{ {', '.join(fields)} }}` with " + ", ".join(described)
