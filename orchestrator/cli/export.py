"""`dpfleet export`: a run's released model as safetensors (a pretrained model's as a Hugging Face folder), with a
model card, for anyone to load."""

from __future__ import annotations

import argparse

from orchestrator.cli.display import format_table, print_json
from orchestrator.export import export_run


def add_export_arguments(export: argparse.ArgumentParser) -> None:
    """Add `export`'s description and arguments to its parser."""
    export.description = (
        "Write the model a finished run released to PATH = NAME.safetensors (its trained parameters, the moving "
        "average with ema_decay, and its buffers; nothing else from the checkpoint) and its model card to "
        "NAME.model-card.json beside it. The card gives epsilon, delta, the accountant, "
        "the privacy unit, steps, sigma, C, the sampling rate, the dataset, the model's spec, input shape and "
        "classes, and the dpfleet version. torch and safetensors load the file without dpfleet. A run of a "
        "pretrained model (model = { hf, task }) is written as a Hugging Face folder PATH instead: a LoRA "
        "adapter in peft's layout (adapter_config.json, adapter_model.safetensors), with --merged the adapter "
        "merged into the model, after full fine-tuning the whole model (config.json, model.safetensors); the "
        "model folder's tokenizer beside, and the card as model-card.json. transformers and peft load it "
        "without dpfleet."
    )
    export.epilog = (
        "A checkpoint is the run's working state, for the run's operator only; the export is what to share. "
        "An unfinished run is refused unless --last-checkpoint is given. An export folder replaces only an "
        "earlier export folder."
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a `dpfleet train` run")
    export.add_argument("--out", required=True, metavar="PATH",
                        help="where to write the weights: NAME.safetensors, or a folder for a pretrained model")
    export.add_argument("--last-checkpoint", action="store_true",
                        help="export an unfinished run's newest checkpoint; the card marks the run partial, with "
                             "the epsilon of its steps so far")
    export.add_argument("--merged", action="store_true",
                        help="a pretrained model's LoRA adapter merged into it (peft's merge_and_unload), saved as "
                             "the whole model rather than the adapter")
    export.add_argument("--json", action="store_true", help="print the model card as JSON on the last line")
    export.set_defaults(handler=f"{__name__}:run_export_command")


def run_export_command(args: argparse.Namespace) -> int:
    """Export the run, then print where the files went and the card's privacy figures (or the card as JSON)."""
    written = export_run(args.run_dir, args.out, args.last_checkpoint, args.merged)
    card = written.card
    if args.json:
        print_json(card)
        return 0
    privacy = card["privacy"]
    unit = "per user" if privacy["privacy_unit"] == "user" else "per example"
    spec = card["model"]["spec"]
    rows = [
        *([] if written.folder is None else [["folder", str(written.folder)],
                                             ["layout", card["weights"]["layout"]]]),
        ["weights", str(written.weights_path)],
        ["model card", str(written.card_path)],
        ["model", spec if isinstance(spec, str) else f"{spec['hf']} ({spec['task']})"],
        [f"epsilon ({privacy['epsilon_label']}, {unit})", privacy["epsilon"]],
        ["delta", privacy["delta"]],
        ["steps", f"{privacy['steps']} of {privacy['planned_steps']}"],
        ["finished", privacy["finished"]],
        ["seeded", privacy["seeded"]],
    ]
    print(format_table(["export", "value"], rows))
    for warning in card["warnings"]:
        print(f"warning: {warning}")
    return 0
