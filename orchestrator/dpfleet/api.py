"""The Python API: the same paths as the command line, as functions that return values instead of printing them.

`train` runs the job exactly as `dpfleet train` does, through the ledger
(reservation, per-block charges, release); `epsilon` and `noise_multiplier`
are `dpfleet eps` and `dpfleet noise`; `Ledger` opens a ledger as the
command line does; `load` rebuilds a model from `dpfleet export`'s file (a
pretrained model's as its transformers model).
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from accounting.accountants import DEFAULT_ACCOUNTANT, get_accountant
from accounting.calibration import noise_multiplier_for
from accounting.events import SampledGaussian, steps_for_epochs

EXPORT_NAME = "model.safetensors"
# A pretrained model's export is a Hugging Face folder (orchestrator/pretrained_export.py).
EXPORT_FOLDER = "model"


@dataclass(frozen=True)
class Result:
    """What a training job released: its test metrics, its (ε, δ), where it wrote its files and its exported model."""

    metrics: dict[str, float]
    epsilon: float
    delta: float
    run_dir: Path
    export_path: Path | None
    summary: dict[str, Any] = field(repr=False)


def train(config_or_path: str | Path | Mapping[str, Any], *, ledger: str | None = None, token: str | None = None,
          dataset_name: str | None = None, export: bool = True, overwrite: bool = False, verbose: bool = False,
          **overrides: Any) -> Result:
    """Train as `dpfleet train --config FILE` does: dry run, reserve, charge block by block, release, report.

    ``config_or_path`` is a TOML file or a dict of config keys;
    ``overrides`` replace keys (``steps=50``, ``run_dir="runs/a"``).
    ``ledger`` and ``token`` are the command line's --ledger and --token
    (default: the config's ledger, DPFLEET_LEDGER, else the embedded one).
    With ``export``, the model is also written to ``run_dir/model.safetensors``
    with its card (a pretrained model's to the folder ``run_dir/model``). A
    ``run_dir`` that holds a finished run is refused unless ``overwrite``
    (`--overwrite`); Ray's start-up lines show with ``verbose``
    (`--verbose`). Raises UsageError (a ValueError) for a bad
    config or data, BudgetRefusedError when the ledger refuses the job.
    """
    from orchestrator.cli import build_parser, quiet_ray_start, run_job
    from orchestrator.config import build_config, load_config
    from orchestrator.export import export_run

    if isinstance(config_or_path, Mapping):
        config = build_config({**config_or_path, **overrides})
    else:
        config = load_config(str(config_or_path), overrides, overrides_from="an argument of dpfleet.train")
    args = build_parser(("train",)).parse_args(["train", "--config", "-", "--no-progress"])
    args.config, args.ledger, args.token, args.dataset_name = config, ledger, token, dataset_name
    args.overwrite = overwrite
    quiet_ray_start(verbose)
    with redirect_stdout(io.StringIO()):  # the run's log: the summary is the return value
        trainer, summary, _ = run_job(args)
    run_dir = Path(trainer.config.run_dir)
    export_name = EXPORT_FOLDER if isinstance(trainer.config.model, dict) else EXPORT_NAME
    export_path = export_run(run_dir, run_dir / export_name).loadable if export else None
    metrics = {key.removeprefix("test_"): value for key, value in summary.items() if key.startswith("test_")}
    return Result(metrics, summary["epsilon"], summary["delta"], run_dir, export_path, summary)


def epsilon(noise_multiplier: float, dataset_size: int, batch_size: int, *, steps: int | None = None,
            epochs: float | None = None, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """ε of a DP-SGD run at ``delta``, as `dpfleet eps` computes it (Poisson sampling at q = batch / dataset)."""
    event = SampledGaussian(batch_size / dataset_size, noise_multiplier,
                            _steps(dataset_size, batch_size, steps, epochs))
    return get_accountant(accountant).epsilon(event, delta)


def noise_multiplier(target_epsilon: float, dataset_size: int, batch_size: int, *, steps: int | None = None,
                     epochs: float | None = None, delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """The smallest noise multiplier whose run meets ``target_epsilon`` at ``delta``, as `dpfleet noise` finds it."""
    return noise_multiplier_for(target_epsilon, delta, batch_size / dataset_size,
                                _steps(dataset_size, batch_size, steps, epochs), accountant)


def _steps(dataset_size: int, batch_size: int, steps: int | None, epochs: float | None) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps and epochs")
    return steps if steps is not None else steps_for_epochs(epochs, dataset_size, batch_size)


def Ledger(address: str | None = None, token: str | None = None):  # noqa: N802 - read as a class by its users
    """The privacy ledger at ``address`` with ``token`` (or DPFLEET_LEDGER, DPFLEET_TOKEN), else the embedded one.

    A context manager with the ledger's operations (``get_budget``,
    ``create_dataset``, ``list_jobs``, ...), as `dpfleet ledger` uses them.
    """
    from orchestrator.ledger_session import open_ledger

    return open_ledger(address, token)


def load(run_or_export: str | Path):
    """The model a finished run released, in eval mode, for inference: from the file or folder `dpfleet export`
    (or ``train(..., export=True)``) wrote, or from the run's directory.

    An export's card (beside the file) names the model's spec; a model from
    your own module needs that module on the import path. A pretrained
    model comes back as its ``transformers`` model (a ``peft`` model with
    its adapter, unless the export merged it), which takes ``input_ids``
    and an ``attention_mask`` as transformers models do. `dpfleet predict`
    loads models the same way.
    """
    from orchestrator.export import load_released

    return load_released(run_or_export).user_model
