"""A config from a TOML file and command-line overrides, or from a dict of keys: read, then checked whole."""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

from pydantic import ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from orchestrator.config.derived import check_against_data
from orchestrator.config.model import TrainConfig
from orchestrator.config.problems import config_error
from orchestrator.errors import UsageError

# A length or noise given on the command line replaces the file's, whichever form it used.
_EITHER = (("epochs", "steps"), ("noise_multiplier", "target_epsilon"))


def build_config(values: Mapping[str, Any], source: str | None = None,
                 overrides: Mapping[str, str] = {}) -> TrainConfig:
    """Check raw key/value pairs into a TrainConfig; every bad key is named in one UsageError.

    The keys are checked first, all of them; then the rules between keys,
    all of them; then the data's metadata. ``source`` and ``overrides`` say
    where the keys came from, for the errors (see ``config_error``).
    """
    try:
        config = TrainConfig.model_validate(dict(values))
    except ValidationError as error:
        raise config_error(error, source, overrides) from None
    check_against_data(config)
    return config


def replaced(config: TrainConfig, **changes: Any) -> TrainConfig:
    """``config`` with some keys changed, checked again as a whole, as ``build_config`` checks a new one."""
    return build_config({**config.to_dict(), **changes})


def read_toml(path: str, what: str = "config") -> dict[str, Any]:
    """A TOML file's table; a missing or broken file is a UsageError naming it (``what``: which file it is)."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"{what} file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{what} file {path!r} is not valid TOML: {error}") from None


def load_config(path: str | None, overrides: Mapping[str, Any], overrides_from: str | None = None) -> TrainConfig:
    """Read a TOML file (if given), apply non-None overrides, check everything.

    An error about an override names where it came from: ``overrides_from``,
    or by default the key's flag (``--run-dir`` for ``run_dir``).
    """
    values = read_toml(path) if path is not None else {}
    if path is not None:
        put_on_import_path(os.path.dirname(os.path.abspath(path)))
    given = {}
    for key, value in overrides.items():
        if value is None:
            continue
        values[key] = value
        given[key] = overrides_from or f"--{key.replace('_', '-')}"
        for pair in _EITHER:
            if key in pair:
                values.pop(pair[1 - pair.index(key)], None)
    return build_config(values, path, given)


def put_on_import_path(folder: str) -> None:
    """Put ``folder`` (a config's) on the import path, so ``model = "module:function"`` finds a module beside it.

    Also on PYTHONPATH, which the workers of a Ray this process starts
    inherit; on a running cluster, `dpfleet submit` ships the working
    directory instead.
    """
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])
