"""The config's documentation, read from its declaration: the key table of the references, and a JSON Schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.config.fields import documentation, kind, valid_text
from orchestrator.config.model import TrainConfig
from orchestrator.config.sections import SECTIONS


@dataclass(frozen=True)
class KeyDocumentation:
    """One config key as the references show it: its TOML type, default, valid range and meaning (Markdown).

    ``literal`` is the default as a TOML value, or None where the default is
    not one (no value, or a value the key computes).
    """

    name: str
    group: str
    kind: str
    default: str
    valid: str
    meaning: str
    literal: str | None


def toml_literal(value: Any) -> str:
    """A scalar or list as it is written in TOML (``"mnist"``, ``true``, ``1e-05``, ``[]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(item) for item in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    raise TypeError(f"no TOML literal for {value!r}; give the key a shown_default")


def documented_keys() -> tuple[KeyDocumentation, ...]:
    """Every config key with its documentation, section by section (``GROUPS`` order), then in declaration order."""
    keys = []
    for section in SECTIONS:
        for name, field in section.model_fields.items():
            shown = documentation(field).get("default")
            literal = None if shown else toml_literal(field.default)
            keys.append(KeyDocumentation(name, section.title, kind(field), shown or f"`{literal}`",
                                         valid_text(field), field.description, literal))
    return tuple(keys)


def json_schema() -> dict:
    """The JSON Schema of a training config file, for editors (a TOML file is checked as its JSON table).

    Each key carries its meaning, and its default where the default is a
    value; a key's documentation for the references stays out of it.
    """
    schema = TrainConfig.model_json_schema(mode="validation")
    defaults = {key.name: key.literal for key in documented_keys()}
    for table in schema.get("$defs", {}).values():  # the sub-tables' keys keep their defaults
        for properties in table.get("properties", {}).values():
            properties.pop("x-dpfleet", None)
    for name, properties in schema["properties"].items():
        properties.pop("x-dpfleet", None)
        properties.pop("default", None)
        if defaults[name] is not None:
            properties["default"] = json.loads(defaults[name])
    schema.update({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "dpfleet training config",
                   "description": "A `dpfleet train --config` file (TOML); docs/config-reference.md explains it."})
    return schema
