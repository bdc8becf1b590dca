"""Modules loaded on first use, for light modules that name heavy ones only in the code that needs them.

``orchestrator.config`` declares and documents every config key, which
`dpfleet init` and the command line's help read, and checks a config against
the workers' modules (engines, clipping, data sources), which load torch.
Holding those as lazy modules keeps torch out until a config is checked.
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
