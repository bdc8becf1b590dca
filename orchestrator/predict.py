"""`dpfleet predict`'s core: a released model's predictions on a file of examples, written as CSV.

Predictions are post-processing of the released model: they read the
model and the examples given, nothing of the run's private data. A
pretrained sequence classifier reads token ids (a Parquet table's list
column, padded with -1) or text (a .txt file, one example a line, or a
.jsonl or .csv file's text column, read as `dpfleet data tokenize` reads
them), which its model folder's tokenizer turns into token ids.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pyarrow as pa
import torch

from orchestrator.errors import UsageError
from orchestrator.export import ReleasedModel, load_released
from workers.data import write_atomically
from workers.pretrained import load_tokenizer
from workers.pretrained_spec import PAD_INPUT
from workers.sources import PARQUET_SUFFIXES, DataError, read_features, read_ids
from workers.text import read_text_table

# Rows per forward pass: bounds the memory a large file's predictions take.
PREDICT_BATCH_ROWS = 4096
# The column a table's rows carry through to their predictions, first, so they join on it rather than on row order.
ID_COLUMN = "id"
# The formats `predict` reads, by the file's suffix.
INPUT_FORMATS = {**{suffix: "parquet" for suffix in PARQUET_SUFFIXES}, ".csv": "csv", ".npy": "npy", ".npz": "npz"}
# What a pretrained sequence classifier reads, by the file's suffix: token ids, or text its tokenizer reads.
TOKEN_FORMATS = {**{suffix: "parquet" for suffix in PARQUET_SUFFIXES}, ".txt": "text", ".jsonl": "text",
                 ".csv": "text"}
# The column of token ids a Parquet file holds when the model's card names none.
TOKEN_COLUMN = "input_ids"


def input_spec(description: dict, data_file: str | Path) -> dict:
    """How to read ``data_file`` for the model its card's ``description`` describes: the format from the suffix,
    the feature columns the model trained on (where known) and one example's shape."""
    file_format = INPUT_FORMATS.get(Path(data_file).suffix.lower())
    if file_format is None:
        raise UsageError(f"--data must be a {', '.join(sorted(INPUT_FORMATS))} file (got {str(data_file)!r})")
    spec = {"format": file_format, "shape": description["input_shape"]}
    columns = description.get("input_columns")
    if columns and file_format in ("csv", "parquet"):
        spec["features"] = columns
    elif columns and file_format == "npz":
        spec["features"] = columns[0]
    return spec


def predict_outputs(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The model's outputs on ``inputs``, [rows, outputs], computed ``PREDICT_BATCH_ROWS`` rows at a time."""
    with torch.no_grad():
        outputs = [model(inputs[start:start + PREDICT_BATCH_ROWS]) for start in range(0, len(inputs),
                                                                                       PREDICT_BATCH_ROWS)]
    return torch.cat(outputs).reshape(len(inputs), -1).float()


def predicted_values(outputs: torch.Tensor, task: str) -> list:
    """Each row's prediction: the class with the largest output (multiclass), 1 where the logit is > 0 (binary),
    else the output itself (regression with one output)."""
    if task == "multiclass":
        return outputs.argmax(dim=1).tolist()
    if task == "binary":
        return (outputs[:, 0] > 0).long().tolist()
    return outputs[:, 0].tolist()


def predictions_csv(outputs: torch.Tensor, task: str, ids: list | None = None) -> bytes:
    """The CSV `predict` writes: a header, then per input row its ``prediction`` and the model's raw outputs,
    after the row's ``ids`` entry (an ``id`` column first) where the input had one."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    first = [] if ids is None else [ID_COLUMN]
    writer.writerow([*first, "prediction", *(f"output_{index}" for index in range(outputs.shape[1]))])
    for index, (prediction, row) in enumerate(zip(predicted_values(outputs, task), outputs.tolist())):
        writer.writerow([*([] if ids is None else [ids[index]]), prediction, *row])
    return text.getvalue().encode()


def feature_inputs(released: ReleasedModel, data_file: str | Path) -> tuple[torch.Tensor, list | None]:
    """The examples of ``data_file`` as the model takes them, and a table's ``id`` column (None without one)."""
    description = released.description
    spec = input_spec(description, data_file)
    try:
        inputs = read_features(spec, str(data_file))
        ids = read_ids(spec, str(data_file), ID_COLUMN)
    except DataError as error:
        raise UsageError(str(error)) from None
    shape = list(inputs.shape[1:])
    if shape != description["input_shape"]:
        raise UsageError(f"{data_file}: examples of shape {shape}, but the model takes {description['input_shape']}; "
                         "give the file the columns the model trained on")
    return inputs, ids


def text_rows(data_file: str | Path, text_column: str) -> tuple[list[str], list | None]:
    """The texts of a .txt file (one a line, blank lines skipped), or of a .jsonl or .csv file's ``text_column``, as
    `dpfleet data tokenize` reads them (``workers.text.read_text_table``); and the rows' ``id`` where the file has
    that column."""
    try:
        table = read_text_table(str(data_file), text_column=text_column)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if text_column not in table.column_names:
        raise UsageError(f"{data_file}: no text column {text_column!r} (columns: {', '.join(table.column_names)}); "
                         "name the one that holds the text with --text-column")
    if not pa.types.is_string(table.schema.field(text_column).type):
        raise UsageError(f"{data_file}: column {text_column!r} has type {table.schema.field(text_column).type}; "
                         "it must hold text: name the column that does with --text-column")
    texts = table.column(text_column).to_pylist()
    if None in texts:
        raise UsageError(f"{data_file}: column {text_column!r} has rows without text (null); fill or drop them")
    return texts, table.column(ID_COLUMN).to_pylist() if ID_COLUMN in table.column_names else None


def tokenized(texts: list[str], tokenizer, max_length: int | None) -> torch.Tensor:
    """Token ids [len(texts), longest] of ``texts`` as the tokenizer gives them (cut to ``max_length`` where the
    model has one), padded with PAD_INPUT."""
    encoded = tokenizer(texts, padding=True, truncation=max_length is not None, max_length=max_length,
                        return_tensors="pt")
    return torch.where(encoded["attention_mask"].bool(), encoded["input_ids"], PAD_INPUT)


def max_positions(model: torch.nn.Module) -> int | None:
    """The most tokens a transformers model takes (its position embeddings), None where its config sets none."""
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def token_inputs(released: ReleasedModel, data_file: str | Path, text_column: str) -> tuple[torch.Tensor, list | None]:
    """A pretrained sequence classifier's inputs from ``data_file``: token ids padded with PAD_INPUT, read from a
    Parquet list column (lists of any length, cut and padded to the length the run trained on) or made from text
    by the model folder's tokenizer; and the rows' ids where given."""
    task = released.description["spec"]["task"]
    if task != "sequence-classification":
        fix = "dpfleet generate samples text from it" if task == "causal-lm" else "load it with dpfleet.load"
        raise UsageError(f"dpfleet predict classifies sequences, and this model's task is {task!r}: {fix}")
    file_format = TOKEN_FORMATS.get(Path(data_file).suffix.lower())
    if file_format is None:
        raise UsageError(f"--data must be a {', '.join(sorted(TOKEN_FORMATS))} file for a pretrained model: token "
                         f"ids in a Parquet list column, or text (got {str(data_file)!r})")
    if file_format == "parquet":
        columns = released.description.get("input_columns") or [TOKEN_COLUMN]
        # Lists of any length are cut and padded to the length the run trained on, as its dataset's max_length did.
        trained_shape = released.description.get("input_shape") or []
        spec = {"format": "parquet", "features": columns,
                **({"max_length": trained_shape[0]} if len(trained_shape) == 1 else {})}
        try:
            inputs, ids = read_features(spec, str(data_file)), read_ids(spec, str(data_file), ID_COLUMN)
        except DataError as error:
            raise UsageError(str(error)) from None
        if inputs.is_floating_point() or inputs.dim() != 2:
            raise UsageError(f"{data_file}: column {columns[0]!r} must hold token ids, lists of integers padded with "
                             f"{PAD_INPUT} to one length")
    else:
        texts, ids = text_rows(data_file, text_column)
        if not texts:
            raise UsageError(f"{data_file}: no rows to predict on")
        model = released.model.hf
        inputs = tokenized(texts, load_tokenizer(released.tokenizer_folder), max_positions(model))
    empty = (inputs == PAD_INPUT).all(dim=1).nonzero().flatten().tolist()
    if empty:
        raise UsageError(f"{data_file}: row {empty[0] + 1} has no tokens; give each row some text or token ids")
    return inputs, ids


def write_predictions(run_or_export: str | Path, data_file: str | Path, out: str | Path,
                      text_column: str = "text") -> int:
    """Load the released model (as `dpfleet.load`), predict on every row of ``data_file``, write ``out`` (CSV);
    return the number of rows. A table's ``id`` column comes first in ``out``, row for row; ``text_column`` is
    the column of a .jsonl or .csv file's text."""
    if Path(out).suffix.lower() != ".csv":
        raise UsageError(f"--out must name a .csv file (got {str(out)!r})")
    released = load_released(run_or_export)
    if released.pretrained:
        inputs, ids = token_inputs(released, data_file, text_column)
    else:
        inputs, ids = feature_inputs(released, data_file)
    outputs = predict_outputs(released.model, inputs)
    write_atomically(Path(out), predictions_csv(outputs, released.description["task"], ids))
    return len(inputs)
