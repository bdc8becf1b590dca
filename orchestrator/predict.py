"""`dpfleet predict`'s core: a released model's predictions on a file of examples, written as CSV.

Predictions are post-processing of the released model: they read the
model and the examples given, nothing of the run's private data.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import torch

from orchestrator.errors import UsageError
from orchestrator.export import load_released
from workers.data import write_atomically
from workers.sources import PARQUET_SUFFIXES, DataError, read_features, read_ids

# Rows per forward pass: bounds the memory a large file's predictions take.
PREDICT_BATCH_ROWS = 4096
# The column a table's rows carry through to their predictions, first, so they join on it rather than on row order.
ID_COLUMN = "id"
# The formats `predict` reads, by the file's suffix.
INPUT_FORMATS = {**{suffix: "parquet" for suffix in PARQUET_SUFFIXES}, ".csv": "csv", ".npy": "npy", ".npz": "npz"}


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


def write_predictions(run_or_export: str | Path, data_file: str | Path, out: str | Path) -> int:
    """Load the released model (as `dpfleet.load`), predict on every row of ``data_file``, write ``out`` (CSV);
    return the number of rows. A table's ``id`` column comes first in ``out``, row for row."""
    if Path(out).suffix.lower() != ".csv":
        raise UsageError(f"--out must name a .csv file (got {str(out)!r})")
    released = load_released(run_or_export)
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
    outputs = predict_outputs(released.model, inputs)
    write_atomically(Path(out), predictions_csv(outputs, description["task"], ids))
    return len(inputs)
