"""Modules loaded on first use, for light modules that name heavy ones only in the code that needs them.

The event records and the ledger use dp-accounting (and scipy) only to
compute an epsilon, and a ledger client, which only shows the figures a
server computed, never does; ``orchestrator.config`` declares and documents
every config key (`dpfleet init`, the help) without the workers' modules,
which load torch, and needs them only to check a config. Holding such
modules as ``LazyModule`` stand-ins lets the command line answer at once.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule(ModuleType):
    """A stand-in for the module of the same name that imports it when one of its attributes is read.

    It is never put in ``sys.modules`` (code that walks the loaded modules, as
    ``inspect`` does, must not set off an import half-way through another):
    the module itself is imported the ordinary way, once, and every read goes
    to it, so what a test patches there is what the stand-in reads.
    """

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attribute)
