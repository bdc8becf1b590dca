"""A pretrained model's release as a Hugging Face folder, which transformers and peft load without dpfleet.

`dpfleet export` writes one for a run of ``model = { hf, task }``: with a
LoRA adapter, peft's layout (``adapter_config.json`` and
``adapter_model.safetensors``: the adapter's factors and a classifier's new
head; the frozen base stays in its own folder); with ``--merged``, the
adapter merged into the base and saved whole; after full fine-tuning, the
whole model. ``save_pretrained`` writes each, the model folder's tokenizer
is saved beside, and the model card (``model-card.json``) says what
guarantee the weights carry. An adapter is refused where peft's layout would
not give the released model back: where the model has weights that its
folder does not hold and the adapter does not carry (transformers draws them
at random as it loads), ``--merged`` saves them. Every file is declared at
the release boundary
(``"export folder"`` in orchestrator/release.py): a file a library starts
writing is refused, not shared unread. The folder is written privately
beside its place and put there whole, replacing only an earlier export.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn

import orchestrator.release as release_boundary
from orchestrator.errors import UsageError
from workers.pretrained import load_tokenizer, weights_not_in_folder

CARD_NAME = "model-card.json"
"""The model card's name in an export folder."""

LAYOUTS = {
    "adapter": "the LoRA adapter in peft's layout, to load onto the pretrained model's folder",
    "merged": "the adapter merged into the pretrained model, saved whole",
    "full": "the fully fine-tuned model, saved whole",
}
"""What an export folder holds, by its card's ``weights.layout``."""

# peft writes a template README.md beside every adapter, its fields blanks to fill in; model-card.json is the card.
_LEFT_OUT = ("README.md",)
# One weights file, whose SHA-256 the card gives, however large the model (save_pretrained shards above 50GB).
_ONE_SHARD = "100000GB"


def is_export_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder `dpfleet export` wrote for a pretrained model (it holds the model card)."""
    return (Path(path) / CARD_NAME).is_file()


def export_layout(spec: Mapping, merged: bool) -> str:
    """The layout of a pretrained model's export (a key of ``LAYOUTS``); ``merged`` asks to merge its adapter."""
    if spec.get("adapter") is None:
        if merged:
            raise UsageError("--merged merges a LoRA adapter into its pretrained model; this run fine-tuned every "
                             "parameter, so its export is the whole model already: leave --merged out")
        return "full"
    return "merged" if merged else "adapter"


def check_out_folder(out: Path) -> None:
    """Refuse an ``--out`` that is not a place for a pretrained model's export folder: a .safetensors name, a file,
    or a folder that holds anything but an earlier export (a run directory, the pretrained model's own folder)."""
    if out.suffix == ".safetensors":
        raise UsageError(f"a pretrained model's export is a Hugging Face folder that transformers loads: give --out "
                         f"a folder, e.g. {str(out.with_suffix(''))!r} (got {str(out)!r})")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; a pretrained model's export is a folder: give a new one")
    if out.is_dir() and any(out.iterdir()) and not is_export_folder(out):
        raise UsageError(f"--out {str(out)!r} holds files but no {CARD_NAME}, so it is not an earlier export, which "
                         "is the only folder an export replaces: give a new folder")


def write_model_folder(model: nn.Module, spec: Mapping, layout: str, folder: Path) -> Path:
    """Save ``model`` (the ``TokenModel`` of ``spec``) in ``layout`` and the tokenizer of its model folder into
    ``folder``; return the weights file. For ``"merged"`` the adapter is merged into ``model`` first, so that
    ``model.hf`` is then the saved model. A whole model's config takes the tokenizer's padding id, so that the
    model reads what the tokenizer pads with as padding (GPT-2's classifier finds each sequence's last token by
    it); the adapter layout keeps the base's config."""
    tokenizer = load_tokenizer(spec["hf"])
    if layout == "adapter":
        model.hf.save_pretrained(str(folder))
        check_adapter_carries_all(spec, folder / "adapter_model.safetensors")
    else:
        if layout == "merged":
            model.hf = model.hf.merge_and_unload()
        padding = tokenizer.pad_token_id
        if padding is not None and 0 <= padding < getattr(model.hf.config, "vocab_size", 0):
            model.hf.config.pad_token_id = padding
        model.hf.save_pretrained(str(folder), max_shard_size=_ONE_SHARD)
    tokenizer.save_pretrained(str(folder))
    for name in _LEFT_OUT:
        (folder / name).unlink(missing_ok=True)
    return folder / ("adapter_model.safetensors" if layout == "adapter" else "model.safetensors")


def check_adapter_carries_all(spec: Mapping, adapter_file: Path) -> None:
    """Refuse an adapter that does not give the released model back on its model folder: one that leaves out a
    weight the folder does not hold either, which transformers would draw again, at random, as it loads."""
    with safe_open(str(adapter_file), "pt") as saved:
        carried = {name.removeprefix("base_model.model.") for name in saved.keys()}
    left_out = sorted(weights_not_in_folder(spec) - carried)
    if left_out:
        raise UsageError(f"peft's layout would leave out {', '.join(left_out)}: the frozen weights that the model "
                         f"folder {spec['hf']!r} does not hold, which transformers drew at random as the run built "
                         "the model and would draw again, differently, for whoever loads the adapter; export with "
                         "--merged, which saves the whole model")


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A private folder beside ``out`` to write an export in, put in ``out``'s place by ``publish_folder``; removed
    if the block fails, so a failed export leaves ``out`` as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.writing-"))
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def publish_folder(staged: Path, out: Path) -> None:
    """Declare every file of ``staged`` at the release boundary (UndeclaredOutput for one nobody declared), then
    put it in ``out``'s place, replacing an earlier export there."""
    files = sorted(staged.iterdir())
    release_boundary.record("export folder", {path.name: None for path in files})
    # mkdtemp's folder and safetensors' files are the owner's only; an export is there to share.
    os.chmod(staged, 0o755)
    for path in files:
        os.chmod(path, 0o644)
    replaced = None
    if out.exists():
        replaced = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.replaced-"))
        os.replace(out, replaced / out.name)
    os.replace(staged, out)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def export_folder_spec(folder: Path, card: Mapping[str, Any]) -> dict:
    """The model spec (``workers.models.build_model``'s) to build an export folder's model from: the folder itself
    when it holds the whole model, else its pretrained model's folder, which must be on this machine, for
    ``workers.pretrained.load_adapter`` to add the adapter to."""
    spec = card["model"]["spec"]
    if card["weights"].get("layout") != "adapter":
        return {"hf": str(folder), "task": spec["task"], "adapter": None}
    if not os.path.isdir(spec["hf"]):
        raise UsageError(f"{str(folder)!r} holds a LoRA adapter of the pretrained model in {spec['hf']!r}, which is "
                         "not a folder on this machine: put that folder there, or export the run with --merged for "
                         "a folder that holds the whole model")
    return {**spec, "adapter": None}
