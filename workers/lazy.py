"""Modules loaded on first use, so that reading a data set's size or metadata does not load torch.

The driver plans a job (and `dpfleet ledger fits` answers) from the sizes,
columns and block selections that ``workers.sources`` reads from metadata;
only reading examples as tensors needs torch. ``workers`` imports neither
``accounting`` nor ``orchestrator``, so it holds its own stand-in, the same
as ``accounting.lazy.LazyModule``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule(ModuleType):
    """A stand-in for the module of the same name that imports it when one of its attributes is read.

    It is never put in ``sys.modules``: the module itself is imported the
    ordinary way, once, and every read goes to it.
    """

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attribute)
