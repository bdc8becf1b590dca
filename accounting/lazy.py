"""Modules loaded on first use, for light modules that name heavy ones only in the code that needs them.

The event records and the ledger use dp-accounting (and scipy) only to
compute an epsilon, and a ledger client, which only shows the figures a
server computed, never does; ``orchestrator.config`` declares and documents
every config key (`dpfleet init`, the help) without the workers' modules,
which load torch, and needs them only to check a config. Holding such
modules as ``LazyModule`` stand-ins lets the command line answer at once.
``public_face`` does the same for a package's public names (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable, Sequence


class LazyModule(ModuleType):
    """A stand-in for the module of the same name that imports it when one of its attributes is read.

    It is never put in ``sys.modules`` (code that walks the loaded modules, as
    ``inspect`` does, must not set off an import half-way through another):
    the module itself is imported the ordinary way, once, and every read goes
    to it, so what a test patches there is what the stand-in reads.
    """

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attribute)


def public_face(package: str, homes: dict[str, Sequence[str]], defined_here: Sequence[str] = ()) -> tuple[
        Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """A package's ``__getattr__``, ``__dir__`` and ``__all__``: its public names, each read from its module on use.

    ``homes`` maps each module of the package (its name inside the package)
    to the names that code outside the package may import from it;
    ``defined_here`` names what the ``__init__`` itself defines. Importing the
    package imports none of those modules (PEP 562, in the shape of SPEC 1's
    ``lazy_loader.attach``), so ``from package import name`` works, costs
    only ``name``'s module, and a package whose modules load torch stays
    cheap to import. Names are not cached: what a test patches in a module
    is what the package hands out.
    """
    home = {name: f"{package}.{module}" for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home[name]), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *home})

    return __getattr__, __dir__, sorted({*home, *defined_here})
