"""`dpfleet predict`: a released model's predictions on a file of examples, as CSV."""

from __future__ import annotations

import argparse

from orchestrator.predict import write_predictions


def add_predict_arguments(predict: argparse.ArgumentParser) -> None:
    """Add `predict`'s description and arguments to its parser."""
    predict.description = (
        "Load the model a finished run released (from its run directory, or from the file or folder `dpfleet "
        "export` wrote, as dpfleet.load does), run it on every row of FILE, and write one CSV row per input row: the "
        "row's id (where FILE is a table with an id column), the prediction (the class with the largest output, 1 where a binary model's logit is above 0, or a "
        "regression's value) and the model's raw outputs output_0, output_1, ..."
    )
    predict.epilog = (
        "FILE is Parquet, CSV, npy or npz with the feature columns the model trained on; a label column may be "
        "there and is ignored. For a pretrained sequence classifier (model = { hf, task = "
        "\"sequence-classification\" }), FILE is Parquet with the token ids' list column (padded with -1 to one "
        "length), a .txt file of one text a line (blank lines skipped), or a .jsonl or .csv file with a text "
        "column (and an id column, passed through); the model folder's tokenizer turns text into token ids. "
        "Predictions read only the released model and FILE."
    )
    predict.add_argument("model", metavar="RUN_OR_EXPORT",
                         help="the run_dir of a finished `dpfleet train` run, or NAME.safetensors or the folder "
                              "from `dpfleet export`")
    predict.add_argument("--data", required=True, metavar="FILE", help="the examples to predict on")
    predict.add_argument("--out", required=True, metavar="FILE", help="where to write the predictions (.csv)")
    predict.add_argument("--text-column", default="text", metavar="NAME",
                         help="the column of a .jsonl or .csv file that holds the text (default: text)")
    predict.set_defaults(handler=f"{__name__}:run_predict_command")


def run_predict_command(args: argparse.Namespace) -> int:
    """Write the predictions and say how many rows went where."""
    rows = write_predictions(args.model, args.data, args.out, args.text_column)
    print(f"wrote {rows} predictions to {args.out}")
    return 0
