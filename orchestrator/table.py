"""How a config sub-table is declared: a frozen record whose fields say their type, default, range and meaning.

A sub-table (``adaptive_clipping = { target_quantile = 0.9 }``) is a
pydantic dataclass: it is built positionally or by name as a dataclass is,
and the config checks it, documents it and writes its JSON Schema from the
same field declarations (``pydantic.Field``: default, ``gt``/``ge``/...,
``description``). It refuses keys it does not declare, and non-finite numbers.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

_Record = TypeVar("_Record")


def table(cls: type[_Record], **config: Any) -> type[_Record]:
    """``cls`` as a frozen, checked config sub-table; ``config`` adds to its pydantic ``ConfigDict``."""
    return dataclass(frozen=True, config=ConfigDict(extra="forbid", allow_inf_nan=False, **config))(cls)
