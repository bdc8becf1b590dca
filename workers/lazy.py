"""Modules loaded on first use, so that reading a data set's size or metadata does not load torch.

The driver plans a job (and `dpfleet ledger fits` answers) from the sizes,
columns and block selections that ``workers.sources`` reads from metadata;
only reading examples as tensors needs torch. ``workers`` imports neither
``accounting`` nor ``orchestrator``, so it holds its own stand-in, the same
as ``accounting.lazy.LazyModule``, and its own ``public_face`` for its
packages' public names (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable, Sequence


class LazyModule(ModuleType):
    """A stand-in for the module of the same name that imports it when one of its attributes is read.

    It is never put in ``sys.modules``: the module itself is imported the
    ordinary way, once, and every read goes to it.
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
