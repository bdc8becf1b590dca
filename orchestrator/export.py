"""What a run releases, in files anyone may read: the model's tensors (safetensors) and its model card (JSON), or,
for a pretrained Hugging Face model, a folder that transformers loads (orchestrator/pretrained_export.py).

A checkpoint is the run's working state, for the run's operator only: it
holds the optimizer, the sampler, the events so far and the ledger
reservation beside the model. An export holds the released model and
nothing else: its trained parameters (their moving average when
``ema_decay`` is set, since that is what the run evaluated and released)
and its buffers as the run's model holds them. The card beside it says what
guarantee the weights carry and how to rebuild the model. Loading an export
takes torch and safetensors, not dpfleet; loading a pretrained model's
folder takes transformers (and peft, for an adapter).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from accounting.accountants import get_accountant, labelled_epsilon
from accounting.events import Composition, group_events
import orchestrator.release as release_boundary
from orchestrator import __version__
from orchestrator.checkpoint import latest_checkpoint
from orchestrator.config import TrainConfig, build_config, rows_per_person, sampling_rate, total_steps
from orchestrator.errors import UsageError
from orchestrator.pretrained_export import (
    CARD_NAME,
    check_out_folder,
    export_folder_spec,
    export_layout,
    is_export_folder,
    publish_folder,
    staged_folder,
    write_model_folder,
)
from workers.data import file_sha256, write_atomically
from workers.models import MODEL_NAMES, build_model, load_flat_parameters
from workers.pretrained import load_adapter
from workers.sources import DataError, read_first, spec_name, split_schema
from workers.names import task_of

WEIGHTS_SUFFIX = ".safetensors"
CARD_SUFFIX = ".model-card.json"
CARD_FORMAT = "dpfleet model card 1"
"""The card's ``format``: its name and version, changed whenever a field changes meaning."""

# The summary's figures that say what guarantee the released weights carry; the last three only for some runs.
PRIVACY_FIGURES = (
    "epsilon", "epsilon_label", "epsilon_rigorous", "delta", "accountant", "steps", "noise_multiplier",
    "sampling_rate", "clip_norm", "final_clip_norm", "events", "row_epsilon", "rows_per_person", "user_epsilon",
)
SEEDED_WARNING = ("seeded run: a fixed seed makes its sampling and noise reproducible by anyone who knows it; "
                  "for tests only, not private")


@dataclass(frozen=True)
class RunRelease:
    """What an export reads from a run directory.

    ``state`` is the newest intact checkpoint's; ``summary`` is summary.json
    when the run finished (that checkpoint is then the final model), else None.
    """

    run_dir: Path
    config: TrainConfig
    state: dict[str, Any]
    summary: dict[str, Any] | None

    @property
    def finished(self) -> bool:
        """Whether the run trained every planned step (its summary is written after the final checkpoint)."""
        return self.summary is not None


def card_path(weights_path: str | Path) -> Path:
    """Where an export's model card goes: beside the weights, ``NAME.safetensors`` -> ``NAME.model-card.json``."""
    weights_path = Path(weights_path)
    return weights_path.with_name(weights_path.name.removesuffix(WEIGHTS_SUFFIX) + CARD_SUFFIX)


def read_run(run_dir: str | Path, last_checkpoint: bool = False) -> RunRelease:
    """The config, newest intact checkpoint and summary of the run in ``run_dir``.

    An unfinished run (no summary, or a summary of fewer steps than the
    newest checkpoint, or of more steps than it because the final checkpoint
    is torn) is refused with a UsageError unless ``last_checkpoint``.
    """
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise UsageError(f"{str(run_dir)!r} holds no config.json; export takes the run_dir of a `dpfleet train` run")
    found = latest_checkpoint(run_dir)
    if found is None:
        raise UsageError(f"{str(run_dir)!r} holds no intact checkpoint, so it has no model to export")
    _, state = found
    values = json.loads(config_path.read_text())
    values["run_dir"] = str(run_dir)
    # As a resume does: the checkpoint fixes sigma, so nothing recalibrates it from target_epsilon.
    values["noise_multiplier"], values["target_epsilon"] = state["noise_multiplier"], None
    config = build_config(values)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if summary is not None and summary["steps"] != state["step"]:
        summary = None
    if summary is None and not last_checkpoint:
        raise UsageError(
            f"the run in {str(run_dir)!r} is unfinished: its newest intact checkpoint is at step {state['step']} and "
            "no summary.json covers it. Finish it with `dpfleet train --resume RUN_DIR`, or export that checkpoint "
            "with --last-checkpoint (the model card then marks the run partial, with the epsilon of its steps so far)"
        )
    return RunRelease(run_dir, config, state, summary)


def released_model(release: RunRelease) -> nn.Module:
    """The model the run released, in eval mode: the averaged weights when ``ema_decay`` is set, else the trained ones.

    Buffers are the checkpointed model's, as the run's model holds them.
    """
    model = rebuilt_model(release.config.model_spec, release.state.get("module_folder"))
    model.load_state_dict(release.state["model"])
    if release.config.ema_decay is not None:
        load_flat_parameters(model, release.state["ema_weights"])
    return model.eval()


def rebuilt_model(spec: str | dict, module_folder: str | None) -> nn.Module:
    """A fresh model of ``spec`` for a run's weights; UsageError (exit status 2) when its module does not import,
    naming the folders Python looked in and ``module_folder``, the one the run imported it from (None where the
    run recorded none), or when it does not build."""
    try:
        return build_model(spec, module_folder)
    except ValueError as error:
        raise UsageError(str(error)) from None


def released_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as safetensors stores it: every entry its own contiguous CPU copy.

    Tied parameters appear once per name, each name with its own copy:
    safetensors refuses shared storage, and ``load_state_dict`` fills both.
    """
    return {name: tensor.detach().to("cpu").clone().contiguous() for name, tensor in model.state_dict().items()}


def model_description(config: TrainConfig, model: nn.Module, module_folder: str | None) -> dict[str, Any]:
    """How to rebuild and feed the model: its spec (and a pretrained model's ``adapter`` table) and the folder its
    module was imported from as the run trained (``module_folder``, None for a built-in), one example's input shape
    and dtype, its output and classes.

    The input shape is read from the first test example, whose values are
    never used; the output shape comes from a forward pass on zeros of that shape.
    ``input_columns`` names a table's feature columns (an npz file's features
    array) in order, from the files' metadata; None for other datasets.
    """
    try:
        example = read_first(config.dataset, "test", 1, config.data_root)[0][0]
    except (DataError, OSError, ValueError) as error:
        raise UsageError(f"cannot read a test example of {spec_name(config.dataset)!r} for the model's input shape "
                         f"({error}); export where the run's test data can be read") from None
    with torch.no_grad():
        output = model(torch.zeros_like(example).unsqueeze(0))
    task = task_of(config.loss)
    classes = None
    if task == "multiclass":
        declared = config.dataset.get("num_classes") if isinstance(config.dataset, dict) else None
        classes = declared or int(output.shape[-1])
    elif task == "binary":
        classes = 2
    schema = split_schema(config.dataset, "test") if isinstance(config.dataset, dict) else None
    adapter = {"adapter": config.adapter} if isinstance(config.model, dict) else {}
    return {
        "spec": config.model,
        **adapter,
        "builtin": config.model in MODEL_NAMES,
        "module_folder": module_folder,
        "input_columns": None if schema is None else list(schema.columns),
        "input_shape": list(example.shape),
        "input_dtype": str(example.dtype).removeprefix("torch."),
        "output_shape": list(output.shape[1:]),
        "task": task,
        "loss": config.loss,
        "classes": classes,
    }


def privacy_so_far(release: RunRelease) -> dict[str, Any]:
    """The PRIVACY_FIGURES of an unfinished run's checkpoint, at its privacy unit: the epsilon of the steps it ran.

    Under privacy_unit = "user" the row-level epsilon is left out: it needs
    the run's plan, and the per-user epsilon is the guarantee.
    """
    config, state = release.config, release.state
    accountant = get_accountant(config.accountant)
    events = Composition.from_dict(state["events"])
    epsilon, epsilon_label = labelled_epsilon(accountant, events, config.delta)
    figures = {
        "epsilon": epsilon,
        "epsilon_label": epsilon_label,
        "epsilon_rigorous": accountant.rigorous,
        "delta": config.delta,
        "accountant": config.accountant,
        "steps": events.steps,
        "noise_multiplier": state["noise_multiplier"],
        "sampling_rate": sampling_rate(config, state["binding"]["dataset"]["units"]),
        "clip_norm": config.clip_norm,
        "final_clip_norm": state["clip_norm"],
        "events": state["events"],
    }
    person_rows = rows_per_person(config)
    if person_rows is not None:
        figures["rows_per_person"] = person_rows
        figures["user_epsilon"] = labelled_epsilon(accountant, group_events(events, person_rows), config.delta)[0]
    return figures


def model_card(release: RunRelease, model: nn.Module, weights_name: str, weights_sha256: str,
               layout: str | None = None) -> dict[str, Any]:
    """The model card of an export: the guarantee its weights carry, how to rebuild the model, what was measured.

    ``layout`` is a pretrained model's export folder's (a key of
    ``pretrained_export.LAYOUTS``), None for a safetensors file.
    """
    config, state = release.config, release.state
    if release.finished:
        summary = release.summary
        privacy = {key: summary[key] for key in PRIVACY_FIGURES if key in summary}
        metrics = {key: value for key, value in summary.items() if key.startswith("test_")}
        planned_steps = summary["steps"]
    else:
        privacy = privacy_so_far(release)
        metrics = {key: value for key, value in state["metrics"][-1].items() if key.startswith("test_")}
        metrics["evaluated_at_step"] = state["metrics"][-1]["step"]
        planned_steps = total_steps(config, state["binding"]["dataset"]["units"])
    seeded = config.seed is not None
    warnings = [SEEDED_WARNING] if seeded else []
    if not release.finished:
        warnings.append(f"partial run: the weights after step {privacy['steps']} of {planned_steps}, and epsilon "
                        "covers those steps only")
    return {
        "format": CARD_FORMAT,
        "dpfleet_version": __version__,
        "weights": {
            "file": weights_name,
            "sha256": weights_sha256,
            "parameters": "moving average of the trained weights" if config.ema_decay is not None else "trained",
            "ema_decay": config.ema_decay,
            **({} if layout is None else {"layout": layout}),
        },
        "model": model_description(config, model, state.get("module_folder")),
        "dataset": config.dataset_name or spec_name(config.dataset),
        "privacy": {
            "privacy_unit": config.privacy_unit,
            **privacy,
            "planned_steps": planned_steps,
            "finished": release.finished,
            "seeded": seeded,
        },
        "test_metrics": metrics,
        "warnings": warnings,
    }


@dataclass(frozen=True)
class Export:
    """The files an export wrote and the card it wrote; ``folder`` is a pretrained model's export folder, which
    holds both (None for a safetensors file and its card)."""

    weights_path: Path
    card_path: Path
    card: dict[str, Any]
    folder: Path | None = None

    @property
    def loadable(self) -> Path:
        """What `dpfleet.load` and `dpfleet predict` take: the folder, else the weights file."""
        return self.folder or self.weights_path


def card_bytes(card: dict[str, Any]) -> bytes:
    """A model card as its file holds it (JSON), once its keys are declared at the release boundary."""
    return (json.dumps(release_boundary.record("model card", card), indent=2, sort_keys=True) + "\n").encode()


def trains_pretrained(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` fine-tuned a pretrained model (its config's model is a table); False when the
    directory holds no config.json."""
    path = Path(run_dir) / "config.json"
    return path.is_file() and isinstance(json.loads(path.read_text()).get("model"), dict)


def export_run(run_dir: str | Path, out: str | Path, last_checkpoint: bool = False, merged: bool = False) -> Export:
    """Write the released model of the run in ``run_dir`` to ``out`` (safetensors) and its card beside it.

    ``out`` must end in ``.safetensors``; the card goes to ``card_path(out)``.
    Both files are written atomically and replace any files of those names.
    A pretrained model's run is written as a folder instead
    (``export_pretrained``), its adapter merged into the model with ``merged``.
    """
    if trains_pretrained(run_dir):
        return export_pretrained(run_dir, Path(out), last_checkpoint, merged)
    if merged:
        raise UsageError("--merged merges a LoRA adapter into its pretrained model; the run in "
                         f"{str(run_dir)!r} trained no pretrained model: leave --merged out")
    out = Path(out)
    if out.suffix != WEIGHTS_SUFFIX or out.name == WEIGHTS_SUFFIX:
        raise UsageError(f"--out must name a file ending in {WEIGHTS_SUFFIX}, e.g. model.safetensors "
                         f"(got {str(out)!r})")
    release = read_run(run_dir, last_checkpoint)
    model = released_model(release)
    # The safetensors header: the tensors' names, dtypes and shapes, and this one conventional entry.
    payload = safetensors_bytes(released_tensors(model), metadata={"format": "pt"})
    card = model_card(release, model, out.name, hashlib.sha256(payload).hexdigest())
    write_atomically(out, payload)
    write_atomically(card_path(out), card_bytes(card))
    return Export(out, card_path(out), card)


def export_pretrained(run_dir: str | Path, out: Path, last_checkpoint: bool = False, merged: bool = False) -> Export:
    """Write the released pretrained model of the run in ``run_dir`` as a Hugging Face folder ``out``: the adapter
    in peft's layout (merged into the model with ``merged``) or the whole model, its tokenizer, and its card.

    ``out`` is new, empty or an earlier export, which it replaces whole.
    """
    check_out_folder(out)
    release = read_run(run_dir, last_checkpoint)
    layout = export_layout(release.config.model_spec, merged)
    model = released_model(release)
    with staged_folder(out) as staged:
        weights = write_model_folder(model, release.config.model, layout, staged)
        card = model_card(release, model, weights.name, file_sha256(weights), layout)
        write_atomically(staged / CARD_NAME, card_bytes(card))
        publish_folder(staged, out)
    return Export(out / weights.name, out / CARD_NAME, card, out)


@dataclass(frozen=True)
class ReleasedModel:
    """A released model, rebuilt in eval mode, and its card's ``model`` entry (how to feed it, what it outputs).

    A pretrained model's ``model`` is a ``TokenModel`` (token ids padded
    with -1); ``tokenizer_folder`` is the folder whose tokenizer gives its
    ids (the export folder, or the run's model folder), None for other models.
    """

    model: nn.Module
    description: dict[str, Any]
    tokenizer_folder: str | None = None

    @property
    def pretrained(self) -> bool:
        """Whether this is a pretrained Hugging Face model (its spec is a ``{ hf, task }`` table)."""
        return isinstance(self.description["spec"], dict)

    @property
    def user_model(self) -> nn.Module:
        """What `dpfleet.load` returns: a pretrained model's transformers model (its peft model, with an adapter),
        else the model itself; in eval mode."""
        return self.model.hf if self.pretrained else self.model


def load_released(run_or_export: str | Path) -> ReleasedModel:
    """The model a finished run released: from its run directory, or from the file or folder `dpfleet export`
    wrote.

    An export is rebuilt from its card (beside the file, or in the folder)
    and its weights; a model from your own module needs that module on the
    import path (else UsageError, naming the folders Python looked in and
    the folder the run imported it from, which checkpoints and cards
    record). A pretrained model's folder with an adapter is loaded onto its
    pretrained model's folder, which the card names.
    """
    path = Path(run_or_export)
    if path.is_dir() and is_export_folder(path):
        card = json.loads((path / CARD_NAME).read_text())
        model = rebuilt_model(export_folder_spec(path, card), None)
        if card["weights"]["layout"] == "adapter":
            load_adapter(model, str(path))
        return ReleasedModel(model.eval(), card["model"], str(path))
    if path.is_dir():
        release = read_run(path)
        model = released_model(release)
        description = model_description(release.config, model, release.state.get("module_folder"))
        pretrained = release.config.model if isinstance(release.config.model, dict) else None
        return ReleasedModel(model, description, pretrained and pretrained["hf"])
    if path.suffix != WEIGHTS_SUFFIX or not path.is_file():
        raise UsageError(f"{str(path)!r} is neither a run directory nor an exported NAME{WEIGHTS_SUFFIX} file or "
                         "folder; give the run_dir of a `dpfleet train` run or what `dpfleet export` wrote")
    if not card_path(path).is_file():
        raise UsageError(f"{str(path)!r} has no model card beside it ({card_path(path).name}), which says how to "
                         "rebuild the model; export the run again with `dpfleet export RUN_DIR --out FILE`")
    from safetensors.torch import load_file

    description = json.loads(card_path(path).read_text())["model"]
    model = rebuilt_model(description["spec"], description.get("module_folder"))
    model.load_state_dict(load_file(str(path)))
    return ReleasedModel(model.eval(), description)
