"""Where a split's examples live, and how a worker reads only the ones a step needs.

A dataset is described by a *spec*, a plain picklable value that crosses to
every Ray actor, each of which opens its own files:

- ``"mnist"`` or ``"fashion-mnist"``: the built-in datasets of ``workers.data``;
- ``"package.module:function"``: a function returning (train, test) map-style
  ``torch.utils.data.Dataset``s whose items are (input, label);
- a dict with ``format`` one of ``FORMATS`` and a ``train`` and ``test``
  location (see ``parse_spec``). Locations are local paths or any URL that
  pyarrow or fsspec understands.

Every source follows ``ExampleSource``: a size, and ``read(indices)`` giving
(inputs, labels) tensors of just those examples. File sources never hold a
whole split: NumPy arrays are memory-mapped (or read by byte range where the
filesystem is remote), Parquet is read one row group at a time through a small
LRU cache of decoded row groups located by an offset index built from the
file metadata, and image folders open one file per example. Reading never
decides which examples take part: the driver's Poisson sample does.

``check_source`` inspects files from metadata and a streaming scan (nothing
is kept) and raises ``DataError`` with one line naming the file, the column
where it applies and the rule; the rows are named only to the data's owner.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import re
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import IO, Any, Protocol

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.fs as pa_fs
import pyarrow.parquet as pq

from workers import data
from workers.lazy import LazyModule
from workers.pretrained_spec import IGNORED_LABEL, PAD_INPUT

# Only reading examples as tensors needs torch; sizes, columns and block selections come from metadata.
torch = LazyModule("torch")

SPLITS = data.SPLITS
BUILTINS = tuple(data.DATASETS)
FORMATS = ("parquet", "csv", "npy", "npz", "imagefolder")
PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
# The formats whose invalid rows check_data = "lenient" can drop (``drop_invalid_rows`` in their spec).
LENIENT_FORMATS = ("parquet", "csv", "npy", "npz")
_FORMAT_KEYS = {
    "parquet": {"features", "exclude_columns", "label", "shape", "max_length"},
    "csv": {"features", "exclude_columns", "label", "shape"},
    "npy": {"shape"},
    "npz": {"features", "label", "shape"},
    "imagefolder": {"mode"},
}
# Rows per chunk when a check scans an array or a CSV file.
_SCAN_ROWS = 65536
_IMAGE_MODES = ("L", "RGB", "RGBA")


class DataError(ValueError):
    """A data file that cannot be trained on: one line naming the file (column) and the rule it breaks.

    The message never names a row, counts rows or quotes a value from the
    data: whoever runs a job may not be the data's owner, and chooses the
    rules. ``with_values`` is the same line with the rows, their count and
    values, for the data's owners (``dpfleet train --show-values``).
    """

    def __init__(self, message: str, with_values: str | None = None) -> None:
        super().__init__(message)
        self.with_values = with_values or message


class ExampleSource(Protocol):
    """A split's examples: how many there are, and the (inputs, labels) tensors at given indices."""

    def __len__(self) -> int:
        """Number of examples in the split."""

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs [len(indices), ...] and labels [len(indices)] (or [len(indices), T], a label per token) of the
        examples at ``indices``, in that order."""


# --- specs --------------------------------------------------------------------


def parse_spec(value: Any) -> str | dict:
    """Validate a config's ``dataset`` value into a spec; raises ValueError naming the bad key.

    A table's local locations become absolute paths, so that workers started
    in another directory find the same files.
    """
    if isinstance(value, str):
        if value in BUILTINS or _is_function_reference(value):
            return value
        raise ValueError(
            f"dataset must be one of {', '.join(BUILTINS)}, 'package.module:function', or a table with "
            f"format = {' | '.join(FORMATS)} (got {value!r})"
        )
    if not isinstance(value, Mapping):
        raise ValueError(f"dataset must be a name or a table with a 'format' key (got {value!r})")
    spec = dict(value)
    file_format = spec.get("format")
    if file_format not in FORMATS:
        raise ValueError(f"dataset.format must be one of {', '.join(FORMATS)} (got {file_format!r})")
    allowed = _FORMAT_KEYS[file_format] | {"format", "train", "test", "num_classes", "name"}
    if file_format in LENIENT_FORMATS:
        allowed = allowed | {"drop_invalid_rows"}  # set by the config from check_data = "lenient", never by hand
    if file_format == "parquet":
        allowed = allowed | {"blocks", "train_parts"}
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(
            f"a {file_format} dataset takes {', '.join(sorted(allowed))}; unknown: {', '.join(sorted(unknown))}"
        )
    if "blocks" in spec:
        spec["blocks"] = _parse_blocks(spec["blocks"])
    for split in SPLITS:
        if split not in spec:
            if split == "train" and "blocks" in spec:
                continue  # the training rows are the blocks a run chooses (select_blocks)
            raise ValueError(f"dataset.{split} is required: where the {split} split of the {file_format} data is")
        if split == "train" and "blocks" in spec and isinstance(spec[split], list):
            # The chosen blocks' locations, as select_blocks wrote them into a run's config.
            spec[split] = [_location(f"dataset.{split}", location) for location in spec[split]]
            continue
        spec[split] = _parse_location(f"dataset.{split}", spec[split], file_format)
    if "features" in spec:
        features = spec["features"]
        names = [features] if isinstance(features, str) else features
        if not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"dataset.features must be a column name or a list of them (got {features!r})")
        if file_format == "npz" and not isinstance(features, str):
            raise ValueError(f"dataset.features of an npz dataset is one array name (got {features!r})")
    if "exclude_columns" in spec:
        excluded = spec["exclude_columns"]
        if not (isinstance(excluded, list) and all(isinstance(name, str) and name for name in excluded)):
            raise ValueError(f"dataset.exclude_columns must be a list of column names (got {excluded!r})")
        if "features" in spec:
            raise ValueError("dataset.features names the feature columns and exclude_columns leaves columns out of "
                             "all of them: give one or the other")
    if "label" in spec and not (isinstance(spec["label"], str) and spec["label"]):
        raise ValueError(f"dataset.label must be a column name (got {spec['label']!r})")
    if "shape" in spec:
        shape = spec["shape"]
        if not (isinstance(shape, list) and shape and all(isinstance(n, int) and n >= 1 for n in shape)):
            raise ValueError(f"dataset.shape must be a list of integers >= 1, e.g. [1, 28, 28] (got {shape!r})")
    if "max_length" in spec:
        length = spec["max_length"]
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"dataset.max_length must be an integer >= 1, the tokens each example is cut or padded "
                             f"to (got {length!r})")
        if "shape" in spec:
            raise ValueError("dataset.max_length cuts and pads one list column of token ids to a length, and shape "
                             "reshapes fixed-length features: give one or the other")
    if "num_classes" in spec:
        count = spec["num_classes"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"dataset.num_classes must be an integer >= 2 (got {count!r})")
    if "name" in spec and not (isinstance(spec["name"], str) and 0 < len(spec["name"]) <= 128):
        raise ValueError(f"dataset.name must be a name of 1 to 128 characters (got {spec['name']!r})")
    if "mode" in spec and spec["mode"] not in _IMAGE_MODES:
        raise ValueError(f"dataset.mode must be one of {', '.join(_IMAGE_MODES)} (got {spec['mode']!r})")
    return spec


BLOCK_SELECTORS = ("rows", "partition", "user_hash", "user_range")
USER_SELECTORS = ("user_hash", "user_range")


def _parse_blocks(value: Any) -> dict[str, dict]:
    """A Parquet dataset's blocks: { name = where its training rows are }, in the order given.

    A block is a location (``"data/2026-11-01/"``) or a table with
    ``files`` (a location or a list of them; default: the dataset's
    ``train``) and at most one selector: ``rows = [FIRST, STOP]``,
    ``partition = { column = "day", value = "2026-11-01" }``,
    ``user_hash = { buckets = B, bucket = I }`` or ``user_range = [FIRST, STOP]``.
    Each becomes the declaration the ledger stores for the block
    ({"files": [...], selector: ...}), which a run's blocks must match.
    """
    if not (isinstance(value, Mapping) and value):
        raise ValueError(
            f'dataset.blocks must be a table {{ "2026-11-01" = "data/2026-11-01/", ... }} of block names and the '
            f"locations of their training rows (got {value!r})"
        )
    return {str(name): _block_declaration(f"dataset.blocks.{name}", where) for name, where in value.items()}


def _block_declaration(key: str, value: Any) -> dict:
    if not isinstance(value, Mapping):
        return {"files": [_location(key, value)]}
    unknown = set(value) - {"files", *BLOCK_SELECTORS}
    selectors = [name for name in BLOCK_SELECTORS if name in value]
    if unknown or len(selectors) > 1 or not value:
        raise ValueError(
            f"{key} takes files and at most one of {', '.join(BLOCK_SELECTORS)} (got {', '.join(sorted(value))})"
        )
    declaration = {}
    if "files" in value:
        files = [value["files"]] if isinstance(value["files"], str) else value["files"]
        if not (isinstance(files, list) and files):
            raise ValueError(f"{key}.files must be a location or a list of them (got {value['files']!r})")
        declaration["files"] = sorted({_location(f"{key}.files", location) for location in files})
    for selector in selectors:
        chosen = value[selector]
        if selector in ("rows", "user_range"):
            if not (isinstance(chosen, list) and len(chosen) == 2 and all(isinstance(n, int) for n in chosen)
                    and 0 <= chosen[0] < chosen[1]):
                raise ValueError(f"{key}.{selector} must be [FIRST, STOP], integers with 0 <= FIRST < STOP "
                                 f"(got {chosen!r})")
            declaration[selector] = list(chosen)
        elif selector == "partition":
            if not (isinstance(chosen, Mapping) and set(chosen) == {"column", "value"}):
                raise ValueError(f'{key}.partition must be {{ column = "COLUMN", value = VALUE }} (got {chosen!r})')
            declaration[selector] = {"column": str(chosen["column"]), "value": str(chosen["value"])}
        else:
            if not (isinstance(chosen, Mapping) and set(chosen) == {"buckets", "bucket"}
                    and all(isinstance(chosen[part], int) for part in chosen)
                    and 0 <= chosen["bucket"] < chosen["buckets"]):
                raise ValueError(f"{key}.user_hash must be {{ buckets = B, bucket = I }}, 0 <= I < B (got {chosen!r})")
            declaration[selector] = {"buckets": chosen["buckets"], "bucket": chosen["bucket"]}
    return declaration


def select_blocks(spec: Mapping, blocks: Iterable[str]) -> dict:
    """The spec of a run on some blocks of a Parquet dataset: its training rows are those blocks' rows only.

    When every chosen block is files alone, ``train`` becomes the list of
    their locations, in the order given, so a source opened from it reads
    no other block's file. Otherwise ``train_parts`` lists, per chosen
    block, its files (the dataset's ``train`` where it names none) and its
    selector, and the train split is those rows only (``open_source``).
    ``blocks`` stays, so that the spec reads back the same.
    """
    chosen = list(blocks)
    known = spec.get("blocks") or {}
    missing = [name for name in chosen if name not in known]
    if missing or not chosen:
        raise ValueError(
            f"blocks must name one or more of the dataset's blocks ({', '.join(known) or 'it has none'}); "
            f"unknown: {', '.join(missing) or 'none given'}"
        )
    if all(set(known[name]) == {"files"} for name in chosen):
        return {**spec, "train": [location for name in chosen for location in known[name]["files"]]}
    parts = []
    for name in chosen:
        if "files" not in known[name] and not isinstance(spec.get("train"), str):
            raise ValueError(f"block {name} selects rows of the dataset's train location; give dataset.train")
        parts.append({"block": name, "files": [spec["train"]], **known[name]} if "files" not in known[name]
                     else {"block": name, **known[name]})
    # `train` stays the dataset's own where it has one; else the chosen files, which checks of the split read.
    return {"train": [location for part in parts for location in part["files"]], **spec, "train_parts": parts}


def canonical_user_id(user_id: Any) -> str:
    """One text per person, whatever type a file stores the id as: 7, 7.0, "7" and "7.0" are all "7".

    An integer, a float with an integral value and a text that reads as
    one are the integer's decimal digits; any other text is itself. A
    fractional or non-finite number (7.5, NaN) is refused (DataError): it
    could be a rounded integer or the text "7.5", so which person it is
    would be a guess.
    """
    value = user_id.item() if isinstance(user_id, np.generic) else user_id
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return str(int(number)) if np.isfinite(number) and number == int(number) else value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"a user id must be an integer or a text (got a {type(value).__name__}); store the id "
                        "column as integers or text")
    if isinstance(value, float) and not (np.isfinite(value) and value == int(value)):
        raise DataError("a user id must be an integer or a text (got a fractional or non-finite number); such an "
                        "id could be a rounded integer or a text, so store the id column as integers or text")
    return str(int(value))


def user_hash_buckets(user_ids: np.ndarray, buckets: int) -> np.ndarray:
    """Each user id's hash bucket of ``buckets``: the first 8 bytes of SHA-256 of the canonical id, big-endian, mod B.

    The same for the same person on every machine and in every column type
    (``canonical_user_id``), so that a block declared by user id hash holds
    the same people wherever and however they are stored.
    """
    return np.array(
        [int.from_bytes(hashlib.sha256(canonical_user_id(user_id).encode()).digest()[:8], "big") % buckets
         for user_id in user_ids],
        dtype=np.int64,
    )


def check_block_people(spec: Mapping, user_id: str | None) -> None:
    """Refuse a run whose chosen blocks are declared by user id when a row's person falls outside its block.

    Each block with ``user_hash`` or ``user_range`` must hold only the rows
    of the people it declares; ``user_id`` is the column naming each row's
    person (None: synthetic users, which no declaration by user id can match).
    """
    for part in spec.get("train_parts") or ():
        selector = next((name for name in USER_SELECTORS if name in part), None)
        if selector is None:
            continue
        if user_id is None:
            raise DataError(f"block {part['block']} is declared by user id ({selector}); train it with user_id, the "
                            "column naming each row's person, not synthetic_users")
        ids = read_column({**spec, "train": part["files"], "train_parts": None}, "train", user_id)
        if selector == "user_hash":
            inside = user_hash_buckets(ids, part["user_hash"]["buckets"]) == part["user_hash"]["bucket"]
        else:
            numeric = np.issubdtype(ids.dtype, np.integer)
            inside = (ids >= part["user_range"][0]) & (ids < part["user_range"][1]) if numeric else \
                np.zeros(len(ids), dtype=bool)
        if not inside.all():
            row = int(np.flatnonzero(~inside)[0])
            raise DataError(
                f"block {part['block']}: row {row} of {', '.join(part['files'])} belongs to user "
                f"{_scalar(ids[row])!r}, who is not in the block's declared people ({selector} {part[selector]}); a block declared by user id must "
                "hold only its people's rows, so that no person is charged by two blocks. Move the row to its "
                "person's block"
            )


def spec_name(spec: str | Mapping) -> str:
    """A short name for a spec: the built-in or function name, else the table's ``name``, else its train location."""
    if isinstance(spec, str):
        return spec
    if "name" in spec:
        return spec["name"]
    train = spec["train"] if "train" in spec else \
        [location for block in spec["blocks"].values() for location in block.get("files", ())] or ["blocks"]
    if isinstance(train, list):
        train = train[0]
    return train if isinstance(train, str) else train["features"]


def _is_function_reference(value: str) -> bool:
    module, _, function = value.partition(":")
    return bool(module) and function.isidentifier()


def _parse_location(key: str, value: Any, file_format: str) -> str | dict:
    if file_format == "npy":
        if not (isinstance(value, Mapping) and set(value) == {"features", "label"}):
            raise ValueError(
                f"{key} of an npy dataset must be a table {{ features = \"x.npy\", label = \"y.npy\" }} (got {value!r})"
            )
        return {part: _location(f"{key}.{part}", value[part]) for part in ("features", "label")}
    return _location(key, value)


def _location(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty path or URL (got {value!r})")
    if "://" in value:
        return value
    return os.path.abspath(os.path.expanduser(value))


# --- opening sources ------------------------------------------------------------


def open_source(spec: str | Mapping, split: str, data_root: str | None = None) -> ExampleSource:
    """The ``split`` of the dataset ``spec`` as an ExampleSource; ``data_root`` is the built-ins' cache."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
    if isinstance(spec, str):
        if spec in BUILTINS:
            return InMemorySource(*data.load_split(spec, split, data_root))
        return TorchDatasetSource(_datasets_of(spec)[SPLITS.index(split)])
    if split == "train" and spec.get("train_parts"):
        return SelectedRowsSource([
            (source, _selected_rows(spec, part, source))
            for part in spec["train_parts"]
            for source in [open_source({**spec, "train": part["files"], "train_parts": None}, split)]
        ])
    opener = {"parquet": ParquetSource, "csv": CsvSource, "npy": NumpySource, "npz": NumpySource,
              "imagefolder": ImageFolderSource}[spec["format"]]
    if spec.get("drop_invalid_rows"):
        source = opener(spec, split)
        return SelectedRowsSource([(source, _valid_rows(spec, split, source).kept)])
    return opener(spec, split)


def source_size(spec: str | Mapping, split: str) -> int:
    """Number of examples in a split, from the built-in's known size or the files' metadata; reads no example."""
    if isinstance(spec, str):
        if spec in BUILTINS:
            return data.dataset_size(spec, split)
        return len(_datasets_of(spec)[SPLITS.index(split)])
    if spec["format"] == "csv" and not (split == "train" and spec.get("train_parts")) \
            and not spec.get("drop_invalid_rows"):
        return _csv_rows(spec, split)
    return len(open_source(spec, split))


def read_column(spec: str | Mapping, split: str, column: str) -> np.ndarray:
    """One column of a Parquet or CSV split, whole and in row order (a small per-row field, such as a user id)."""
    if isinstance(spec, str) or spec["format"] not in ("parquet", "csv"):
        raise DataError(f"{spec_name(spec)}: a column such as user_id can be read from Parquet or CSV tables only")
    if split == "train" and spec.get("train_parts"):
        columns = []
        for part in spec["train_parts"]:
            part_spec = {**spec, "train": part["files"], "train_parts": None}
            columns.append(read_column(part_spec, split, column)[_selected_rows(spec, part, open_source(part_spec,
                                                                                                         split))])
        return np.concatenate(columns)
    suffixes = PARQUET_SUFFIXES if spec["format"] == "parquet" else (".csv",)
    filesystem, paths = _files_at(spec[split], suffixes)
    parts = []
    for path in paths:
        if spec["format"] == "parquet":
            schema = _parquet_file(filesystem, path).schema_arrow
            if column not in schema.names:
                raise DataError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)})")
            parts.append(pq.read_table(path, columns=[column], filesystem=filesystem).column(column).to_numpy())
            continue
        for _, batch in _csv_batches(path, filesystem):
            if column not in batch.schema.names:
                raise DataError(f"{path}: no column {column!r} (columns: {', '.join(batch.schema.names)})")
            parts.append(batch.column(column).to_numpy(zero_copy_only=False))
    return np.concatenate(parts)


@dataclass(frozen=True)
class DroppedRows:
    """What a table's ``drop_invalid_rows`` (check_data = "lenient") leaves out of a split, in counts of rows.

    ``not_finite`` rows have a NaN or infinite feature (or floating label);
    ``label_outside`` rows have an integer label outside 0..num_classes-1 (a label per token may also be
    IGNORED_LABEL).
    ``kept`` holds the positions of the other rows, in order.
    """

    rows: int
    not_finite: int
    label_outside: int
    kept: np.ndarray = dataclass_field(repr=False, compare=False)

    @property
    def dropped(self) -> int:
        """How many rows are left out."""
        return self.rows - len(self.kept)

    def among_kept(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of ``rows`` (row numbers in the split's files): which are kept (a mask), and the kept ones' positions
        among the kept rows, the indices of the split as ``drop_invalid_rows`` reads it."""
        rows = np.asarray(rows, dtype=np.int64)
        positions = np.searchsorted(self.kept, rows)
        kept = positions < len(self.kept)
        kept[kept] = self.kept[positions[kept]] == rows[kept]
        return kept, positions[kept]


def dropped_rows(spec: Mapping, split: str) -> DroppedRows:
    """Which rows of a table's ``split`` check_data = "lenient" drops, and why, deciding each row by its own values
    alone (so one example's presence changes no other row's fate)."""
    source = open_source({**spec, "drop_invalid_rows": False}, split)
    return _valid_rows(spec, split, source)


# The rows each split keeps, per process: a worker opens its split more than once. Keyed by the spec as JSON.
_KEPT_ROWS: dict[tuple[str, str], DroppedRows] = {}


def _valid_rows(spec: Mapping, split: str, source: ExampleSource) -> DroppedRows:
    """The rows of ``source`` (``split`` of ``spec``) whose features and labels are finite and whose integer labels
    lie in 0..num_classes-1 (when the spec's num_classes is given), found by one scan in chunks."""
    key = (json.dumps(spec, sort_keys=True, default=str), split)
    if key not in _KEPT_ROWS:
        num_classes = spec.get("num_classes")
        finite, inside = [], []
        for start in range(0, len(source), _SCAN_ROWS):
            inputs, labels = source.read(np.arange(start, min(start + _SCAN_ROWS, len(source))))
            rows_finite = torch.ones(len(labels), dtype=torch.bool)
            if inputs.is_floating_point():
                rows_finite &= torch.isfinite(inputs.reshape(len(inputs), -1)).all(dim=1)
            if labels.is_floating_point():
                rows_finite &= torch.isfinite(labels.reshape(len(labels), -1)).all(dim=1)
            rows_inside = torch.ones(len(labels), dtype=torch.bool)
            if num_classes is not None and not labels.is_floating_point():
                rows_inside = (labels >= 0) & (labels < num_classes)
                if labels.dim() > 1:  # a label per token; IGNORED_LABEL marks one that does not count
                    rows_inside = (rows_inside | (labels == IGNORED_LABEL)).reshape(len(labels), -1).all(dim=1)
            finite.append(rows_finite.numpy())
            inside.append(rows_inside.numpy())
        finite, inside = np.concatenate(finite), np.concatenate(inside)
        _KEPT_ROWS[key] = DroppedRows(len(finite), int((~finite).sum()), int((finite & ~inside).sum()),
                                      np.flatnonzero(finite & inside).astype(np.int64))
    return _KEPT_ROWS[key]


def read_features(spec: Mapping, location: str) -> torch.Tensor:
    """Every row's features in the file(s) at ``location``, read as the table ``spec`` reads its splits.

    The spec's format, ``features`` or ``exclude_columns`` and ``shape``
    apply; a label column may be there or not (it is never a feature). An
    npy location is the features array alone; an npz one holds the spec's
    ``features`` array. The inputs a model predicts on, in row order.
    """
    file_format = spec["format"]
    if file_format in ("npy", "npz"):
        array = _npy_array(location) if file_format == "npy" else _npz_array(location, spec.get("features", "features"))
        return _feature_tensor(array.rows(np.arange(len(array))).reshape(len(array), -1), spec.get("shape"))
    if file_format not in ("parquet", "csv"):
        raise DataError(f"{location}: predictions read Parquet, CSV, npy or npz files (the dataset is {file_format})")
    filesystem, paths = _files_at(location, PARQUET_SUFFIXES if file_format == "parquet" else (".csv",))
    parts = []
    for path in paths:
        if file_format == "parquet":
            tables = [_parquet_file(filesystem, path).read(use_threads=False)]
        else:
            tables = [pa.Table.from_batches([batch]) for _, batch in _csv_batches(path, filesystem)]
        for table in tables:
            columns = _feature_columns(spec, table.schema, path, label_required=False)
            _check_feature_types(table.schema, columns, path, spec.get("max_length"))
            parts.append(_table_to_numpy(table, columns, None, spec.get("max_length"))[0])
    if not parts or not sum(len(part) for part in parts):
        raise DataError(f"{location}: no rows to predict on")
    return _feature_tensor(np.concatenate(parts), spec.get("shape"))


def read_ids(spec: Mapping, location: str, column: str = "id") -> list | None:
    """Every row's ``column`` in the table file(s) at ``location``, in ``read_features``'s row order, as the file
    holds it (a CSV's as its text); None when a file lacks the column or the location is not Parquet or CSV."""
    file_format = spec["format"]
    if file_format not in ("parquet", "csv"):
        return None
    filesystem, paths = _files_at(location, PARQUET_SUFFIXES if file_format == "parquet" else (".csv",))
    ids = []
    for path in paths:
        if file_format == "parquet":
            parquet = _parquet_file(filesystem, path)
            if column not in parquet.schema_arrow.names:
                return None
            ids.extend(parquet.read([column], use_threads=False).column(column).to_pylist())
            continue
        for _, batch in _csv_batches(path, filesystem, {column: pa.string()}):
            if column not in batch.schema.names:
                return None
            ids.extend(batch.column(column).to_pylist())
    return ids


def read_first(spec: str | Mapping, split: str, count: int | None = None,
               data_root: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` examples of a split (all when None) as (inputs, labels)."""
    source = open_source(spec, split, data_root)
    return source.read(np.arange(len(source) if count is None else min(count, len(source))))


class InMemorySource:
    """Examples already held as tensors (the built-in datasets, loaded whole from their verified cache)."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices`` (a copy)."""
        selected = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return self.inputs[selected], self.labels[selected]


def _selected_rows(spec: Mapping, part: Mapping, source: ExampleSource) -> np.ndarray:
    """The positions, in its files, of the rows a block's selector chooses (every row for a selector by user id)."""
    if "rows" in part:
        first, stop = part["rows"]
        if stop > len(source):
            raise DataError(f"block {part['block']}: rows [{first}, {stop}) run past the {len(source)} rows of "
                            f"{', '.join(part['files'])}; declare a range within them")
        return np.arange(first, stop, dtype=np.int64)
    if "partition" in part:
        column, value = part["partition"]["column"], part["partition"]["value"]
        values = read_column({**spec, "train": part["files"], "train_parts": None}, "train", column)
        return np.flatnonzero(values.astype(str) == value).astype(np.int64)
    return np.arange(len(source), dtype=np.int64)


class SelectedRowsSource:
    """The rows some blocks select: for each (source, row positions) in turn, those rows of it, in that order."""

    def __init__(self, parts: list[tuple[ExampleSource, np.ndarray]]) -> None:
        self.parts = parts
        self.starts = np.concatenate([[0], np.cumsum([len(rows) for _, rows in parts], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected rows at ``indices``: one read per part, put back in the order asked."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return _none_of(self.parts[0][0])
        part_of = np.searchsorted(self.starts, indices, side="right") - 1
        inputs, labels = [None] * len(indices), [None] * len(indices)
        for part in np.unique(part_of):
            chosen = np.flatnonzero(part_of == part)
            source, rows = self.parts[part]
            part_inputs, part_labels = source.read(rows[indices[chosen] - self.starts[part]])
            for position, index in enumerate(chosen):
                inputs[index], labels[index] = part_inputs[position], part_labels[position]
        return torch.stack(inputs), torch.stack(labels)


class PrefetchingSource:
    """A source whose next step's rows are read on a background thread while this step's gradients compute.

    ``prefetch(indices)`` starts reading rows that were already sampled; a
    later ``read`` of exactly those indices takes the rows read ahead. The
    sample is drawn before any reading, so reading never decides which
    examples take part. The wrapped source is used by one thread at a time:
    a read of other rows first waits for the read ahead under way.
    """

    def __init__(self, source: ExampleSource) -> None:
        self.source = source
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._ahead: tuple[np.ndarray, Future] | None = None

    def __len__(self) -> int:
        return len(self.source)

    def prefetch(self, indices: np.ndarray) -> None:
        """Start reading the rows at ``indices`` (replacing any read ahead not yet taken)."""
        self._settle()
        indices = np.array(indices, dtype=np.int64)
        self._ahead = (indices, self._reader.submit(self.source.read, indices))

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices``: those read ahead when they are the same rows, else read now."""
        indices = np.asarray(indices, dtype=np.int64)
        if self._ahead is not None and np.array_equal(self._ahead[0], indices):
            _, reading = self._ahead
            self._ahead = None
            return reading.result()
        self._settle()
        return self.source.read(indices)

    def _settle(self) -> None:
        """Wait for the read ahead under way, if any; its rows stay for a matching ``read`` (errors surface there)."""
        if self._ahead is not None:
            wait([self._ahead[1]])


class TorchDatasetSource:
    """A map-style torch Dataset of (input, label) items, read one item per index."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacks the items at ``indices``; labels become int64 or float32 tensors."""
        if not len(indices):
            return _none_of(self)
        items = [self.dataset[int(index)] for index in indices]
        inputs = torch.stack([torch.as_tensor(item[0]) for item in items])
        return inputs, _label_tensor(np.asarray([_scalar(item[1]) for item in items]))


@functools.lru_cache(maxsize=8)
def _datasets_of(reference: str) -> tuple:
    """Call ``package.module:function`` once per process; it must return (train, test) Datasets."""
    module_name, _, function_name = reference.partition(":")
    try:
        function: Callable = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"dataset {reference!r}: cannot import it ({error}); check the module path") from None
    datasets = function()
    if not (isinstance(datasets, tuple) and len(datasets) == 2
            and all(hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in datasets)):
        raise ValueError(
            f"dataset {reference!r} must return (train, test) map-style torch Datasets (got {type(datasets).__name__})"
        )
    return datasets


def _none_of(source: ExampleSource) -> tuple[torch.Tensor, torch.Tensor]:
    """A read of no examples, with the per-example shape and dtypes of a real one (the first example's)."""
    inputs, labels = source.read(np.zeros(1, dtype=np.int64))
    return inputs[:0], labels[:0]


def _scalar(label: Any) -> Any:
    return label.item() if hasattr(label, "item") else label


def _label_array(labels: np.ndarray) -> np.ndarray:
    """Integer labels as int64 (classes), floating ones as float32 (targets)."""
    return np.ascontiguousarray(labels, dtype=np.float32 if np.issubdtype(labels.dtype, np.floating) else np.int64)


def _feature_array(features: np.ndarray) -> np.ndarray:
    """Floating (and boolean) features as float32, integer ones (token ids) as int64."""
    floating = np.issubdtype(features.dtype, np.floating) or features.dtype == np.bool_
    return np.ascontiguousarray(features, dtype=np.float32 if floating else np.int64)


def _label_tensor(labels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(_label_array(labels))


def _feature_tensor(features: np.ndarray, shape: list[int] | None) -> torch.Tensor:
    """``_feature_array`` as a tensor, each example reshaped to ``shape`` when given."""
    array = _feature_array(features)
    return torch.from_numpy(array if shape is None else array.reshape(len(array), *shape))


# --- filesystems ----------------------------------------------------------------


def _pyarrow_filesystem(location: str) -> tuple[pa_fs.FileSystem, str]:
    """pyarrow's own filesystem for the location where it has one (local, s3, gs, hdfs), else fsspec's, wrapped."""
    if "://" not in location:
        return pa_fs.LocalFileSystem(), location
    try:
        return pa_fs.FileSystem.from_uri(location)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        filesystem, path = fsspec.core.url_to_fs(location)
        return pa_fs.PyFileSystem(pa_fs.FSSpecHandler(filesystem)), path


def _files_at(location: str | list[str], suffixes: tuple[str, ...]) -> tuple[pa_fs.FileSystem, list[str]]:
    """The file at ``location``, or the files under that directory ending in one of ``suffixes``, sorted.

    A list of locations (the chosen blocks of a dataset) gives the files of
    each in turn; they must be on one filesystem.
    """
    if isinstance(location, list):
        found = [_files_at(part, suffixes) for part in location]
        kinds = {filesystem.type_name for filesystem, _ in found}
        if len(kinds) > 1:
            raise DataError(f"{', '.join(location)}: the blocks of one dataset must be on one filesystem")
        return found[0][0], [path for _, paths in found for path in paths]
    filesystem, path = _pyarrow_filesystem(location)
    info = filesystem.get_file_info(path)
    if info.type == pa_fs.FileType.NotFound:
        raise DataError(f"{location}: no such file or directory; check the dataset's train/test locations")
    if info.type == pa_fs.FileType.File:
        return filesystem, [path]
    found = filesystem.get_file_info(pa_fs.FileSelector(path, recursive=True))
    files = sorted(
        entry.path for entry in found
        if entry.type == pa_fs.FileType.File and entry.path.endswith(suffixes)
        and not any(part.startswith(("_", ".")) for part in entry.path[len(path):].split("/"))
    )
    if not files:
        raise DataError(f"{location}: directory holds no {' or '.join(suffixes)} files")
    return filesystem, files


# --- Parquet ----------------------------------------------------------------------


def _feature_columns(spec: Mapping, schema: pa.Schema, file_name: str, label_required: bool = True) -> list[str]:
    """The feature column names: ``features`` as given, else every column but the label and ``exclude_columns``.

    Without ``label_required`` (inputs to predict on), a table may lack the label column.
    """
    label = spec.get("label", "label")
    if label not in schema.names and label_required:
        raise DataError(f"{file_name}: no label column {label!r} (columns: {', '.join(schema.names)}); "
                        "set the dataset's label key")
    features = spec.get("features")
    if features is None:
        excluded = spec.get("exclude_columns", [])
        missing = [name for name in excluded if name not in schema.names]
        if missing and label_required:
            raise DataError(f"{file_name}: no column {', '.join(map(repr, missing))} to exclude (columns: "
                            f"{', '.join(schema.names)}); fix the dataset's exclude_columns")
        return [name for name in schema.names if name != label and name not in excluded]
    names = [features] if isinstance(features, str) else list(features)
    for name in names:
        if name not in schema.names:
            raise DataError(f"{file_name}: no feature column {name!r} (columns: {', '.join(schema.names)}); "
                            "set the dataset's features key")
    return names


def _check_schema(spec: Mapping, schema: pa.Schema, file_name: str) -> tuple[list[str], int | None]:
    """Feature columns and, for one fixed-size list column (any list column with ``max_length``), each example's
    length; refuses non-numeric types, and a label column that is neither numbers nor a list of integers."""
    columns = _feature_columns(spec, schema, file_name)
    label = spec.get("label", "label")
    label_type = schema.field(label).type
    if _is_list(label_type) and not pa.types.is_integer(label_type.value_type):
        raise DataError(f"{file_name}: column {label!r} has type {label_type}; a list of labels (one per token) must "
                        f"hold integers: classes, or {IGNORED_LABEL} where a token does not count")
    if not (_is_list(label_type) or pa.types.is_integer(label_type) or pa.types.is_floating(label_type)):
        raise DataError(f"{file_name}: column {label!r} has type {label_type}; labels must be integers "
                        "(classes) or floating point (targets), or a list of integers (one class per token)")
    length = _check_feature_types(schema, columns, file_name, spec.get("max_length"))
    if _is_list(label_type) and "max_length" not in spec:
        if not pa.types.is_fixed_size_list(label_type) or length is None:
            which = f"column {label!r} is a list of labels of any length" if length is not None else \
                f"column {label!r} is a list of labels and column {columns[0]!r} a list of token ids of any length"
            raise DataError(f"{file_name}: {which}; set dataset.max_length = N to cut each example's "
                            f"token ids and labels to N and pad them (ids with {PAD_INPUT}, labels with "
                            f"{IGNORED_LABEL})")
        if label_type.list_size != length:
            raise DataError(f"{file_name}: column {label!r} holds {label_type.list_size} labels per example and the "
                            f"features {length} values; a list of labels gives one label per token: write one per "
                            "token id, or set dataset.max_length = N to cut and pad both to N")
    return columns, length


def _check_feature_types(schema: pa.Schema, columns: list[str], file_name: str,
                         max_length: int | None = None) -> int | None:
    """Refuses non-numeric feature columns; returns the feature length (None for a variable-length list column).

    With ``max_length`` the features must be one list column of integers
    (token ids), which reads cut and pad to that length.
    """
    if len(columns) == 1 and _is_list(schema.field(columns[0]).type):
        list_type = schema.field(columns[0]).type
        if not _is_numeric(list_type.value_type):
            raise DataError(f"{file_name}: column {columns[0]!r} has type {list_type}; features must be lists "
                            "of numbers")
        if max_length is not None:
            if not pa.types.is_integer(list_type.value_type):
                raise DataError(f"{file_name}: column {columns[0]!r} has type {list_type}; dataset.max_length cuts "
                                "and pads token ids, which are integers: leave max_length out for other features")
            return max_length
        return list_type.list_size if pa.types.is_fixed_size_list(list_type) else None
    if max_length is not None:
        raise DataError(f"{file_name}: dataset.max_length cuts and pads one list column of token ids, and the "
                        f"features are the column(s) {', '.join(columns)}; name the token ids' column in the "
                        "dataset's features key")
    for name in columns:
        if not _is_numeric(schema.field(name).type):
            raise DataError(f"{file_name}: column {name!r} has type {schema.field(name).type}; features must be "
                            "numeric columns or one list column of numbers")
    return len(columns)


def _is_list(data_type: pa.DataType) -> bool:
    return pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_fixed_size_list(data_type)


def _is_numeric(data_type: pa.DataType) -> bool:
    return pa.types.is_integer(data_type) or pa.types.is_floating(data_type) or pa.types.is_boolean(data_type)


def _table_to_numpy(table: pa.Table, columns: list[str], label: str | None,
                    max_length: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(features [rows, length], labels [rows] or [rows, tokens]) of a decoded table; labels None when ``label`` is
    None. With ``max_length``, a list column's rows are cut to that length and padded: features (token ids) with
    PAD_INPUT, a list of labels with IGNORED_LABEL."""
    if len(columns) == 1 and _is_list(table.schema.field(columns[0]).type):
        features = _list_rows(table.column(columns[0]), max_length, PAD_INPUT)
    else:
        features = np.stack([table.column(name).to_numpy() for name in columns], axis=1)
    if label is None:
        return features, None
    if _is_list(table.schema.field(label).type):
        return features, _list_rows(table.column(label), max_length, IGNORED_LABEL)
    return features, table.column(label).to_numpy()


def _list_rows(column: pa.ChunkedArray, length: int | None, fill: int) -> np.ndarray:
    """A list column as an array of one row per example: as stored without ``length`` (every list of one size),
    else each list cut to ``length`` values and padded with ``fill``, as int64."""
    values = column.combine_chunks()
    flat = values.flatten().to_numpy(zero_copy_only=False)
    if length is None:
        return flat.reshape(len(values), -1) if len(values) else flat.reshape(0, 0)
    counts = pc.fill_null(pc.list_value_length(values), 0).to_numpy().astype(np.int64)
    kept = np.minimum(counts, length)
    rows = np.repeat(np.arange(len(values)), kept)
    positions = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)
    padded = np.full((len(values), length), fill, dtype=np.int64)
    padded[rows, positions] = flat[np.repeat(np.cumsum(counts) - counts, kept) + positions]
    return padded


class ParquetSource:
    """A split stored as one Parquet file or a directory of them, read by row group.

    The row-offset index comes from the files' metadata; ``read`` decodes
    only the row groups holding the requested rows, with one call per file.
    """

    def __init__(self, spec: Mapping, split: str) -> None:
        self.location = spec[split]
        self.shape = spec.get("shape")
        self.label = spec.get("label", "label")
        self.max_length = spec.get("max_length")
        self.filesystem, self.paths = _files_at(self.location, PARQUET_SUFFIXES)
        self.files = [_parquet_file(self.filesystem, path) for path in self.paths]
        self.columns, _ = _check_schema(spec, self.files[0].schema_arrow, self.paths[0])
        group_sizes, group_files, group_numbers = [], [], []
        for file_index, parquet in enumerate(self.files):
            for group in range(parquet.metadata.num_row_groups):
                group_sizes.append(parquet.metadata.row_group(group).num_rows)
                group_files.append(file_index)
                group_numbers.append(group)
        self.group_starts = np.concatenate([[0], np.cumsum(group_sizes, dtype=np.int64)])
        self.group_files = np.asarray(group_files, dtype=np.int64)
        self.group_numbers = np.asarray(group_numbers, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices``: the row groups holding them are decoded together, once each."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return _none_of(self)
        groups = np.searchsorted(self.group_starts, indices, side="right") - 1
        needed = np.unique(groups)  # sorted: by file, then by row group within the file
        tables = [
            self.files[file_index].read_row_groups(
                self.group_numbers[needed[self.group_files[needed] == file_index]].tolist(),
                columns=[*self.columns, self.label], use_threads=False,
            )
            for file_index in np.unique(self.group_files[needed])
        ]
        features, labels = _table_to_numpy(pa.concat_tables(tables), self.columns, self.label, self.max_length)
        # Row r of group g sits at (rows of the needed groups before g) + r in the decoded table.
        needed_sizes = np.diff(self.group_starts)[needed]
        decoded_starts = np.cumsum(needed_sizes) - needed_sizes
        positions = decoded_starts[np.searchsorted(needed, groups)] + indices - self.group_starts[groups]
        return _feature_tensor(features[positions], self.shape), _label_tensor(labels[positions])


def _parquet_file(filesystem: pa_fs.FileSystem, path: str) -> pq.ParquetFile:
    """The opened file, pre-buffering: a read's column chunks are fetched by concurrent, coalesced requests.

    A step's rows lie in row groups all over the files, mostly not in the page
    cache when the data outgrows memory. Fetched concurrently, 125 random rows
    from a cold 16-rows-a-group file took 30 to 52 ms against 87 to 165 ms one
    request at a time (2-core VM, local disk); from the page cache they take
    about 25 ms against 10 ms, so the cold case decides.
    """
    try:
        return pq.ParquetFile(filesystem.open_input_file(path), pre_buffer=True)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({str(error).splitlines()[0]})") from None


# --- CSV ------------------------------------------------------------------------------


def private_scratch_file() -> IO[bytes]:
    """An open, unnamed file for a copy of training data, readable and writable by this process only.

    On Linux it is made with O_TMPFILE and never has a name; elsewhere it is
    unlinked as soon as it is made, before anything is written to it. Either
    way nothing can open it from the filesystem, and the kernel frees its
    blocks when the last descriptor or memory map goes, which a SIGKILL of
    the process does too: no copy outlives the process, and there is nothing
    to clean up after a crash. Its mode is 0600.
    """
    return tempfile.TemporaryFile(prefix="dpfleet-csv-")



# The parts of pyarrow's CSV errors that come from the file's contents: the text of a row, a field's value, and
# the number of the row that breaks the format.
_CSV_QUOTED_CONTENT = (re.compile(r"(Expected \d+ columns, got \d+): .*"), re.compile(r"(invalid value) '.*'"),
                       re.compile(r"()Row #\d+: "))


def _csv_error(path: str, error: pa.ArrowInvalid) -> DataError:
    """Unreadable CSV, as pyarrow words it, without the row's number, its text or a field's value."""
    problem = str(error).splitlines()[0]
    unquoted = problem
    for pattern in _CSV_QUOTED_CONTENT:
        unquoted = pattern.sub(r"\1", unquoted)
    return DataError(f"{path}: not readable as CSV ({unquoted}); {FIND_ROWS}", f"{path}: not readable as CSV ({problem})")


def _csv_batches(path: str, filesystem: pa_fs.FileSystem,
                 column_types: Mapping[str, pa.DataType] | None = None) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row number, batch) over one CSV file, ``column_types`` naming the type of any column not to infer;
    unreadable CSV (a row with the wrong number of fields) raises DataError with pyarrow's message, which names the
    row (``_csv_error``)."""
    with filesystem.open_input_stream(path) as stream:
        try:
            # One thread, so pyarrow's row numbers count from the top of the file.
            reader = pa_csv.open_csv(stream, read_options=pa_csv.ReadOptions(use_threads=False),
                                     convert_options=pa_csv.ConvertOptions(column_types=column_types))
        except pa.ArrowInvalid as error:
            raise _csv_error(path, error) from None
        first_row = 0
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as error:
                raise _csv_error(path, error) from None
            yield first_row, batch
            first_row += batch.num_rows


def _csv_rows(spec: Mapping, split: str) -> int:
    """Rows of a CSV split, counted by a streaming pass that also checks every file's columns."""
    filesystem, paths = _files_at(spec[split], (".csv",))
    rows = 0
    for path in paths:
        file_rows = 0
        for _, batch in _csv_batches(path, filesystem):
            _check_schema(spec, batch.schema, path)
            file_rows += batch.num_rows
        if file_rows == 0:
            raise DataError(f"{path}: empty file (no rows under the header); remove it or write examples into it")
        rows += file_rows
    return rows


class CsvSource:
    """A split stored as CSV (one file or a directory of them), parsed by pyarrow.

    CSV has no random access, so the worker converts it once, streaming, into
    memory-mapped NumPy arrays and reads those. The arrays live in unnamed
    files (``private_scratch_file``): the copy of the training rows is never
    reachable by a path, and the kernel frees it when the worker's process
    ends, however it ends (Ray stops workers with SIGKILL).
    """

    def __init__(self, spec: Mapping, split: str) -> None:
        filesystem, paths = _files_at(spec[split], (".csv",))
        label = spec.get("label", "label")
        self.shape = spec.get("shape")
        self._feature_file, self._label_file = private_scratch_file(), private_scratch_file()
        rows, row_layout = 0, None
        for path in paths:
            for _, batch in _csv_batches(path, filesystem):
                columns, _ = _check_schema(spec, batch.schema, path)
                features, labels = _table_to_numpy(pa.Table.from_batches([batch]), columns, label)
                features, labels = _feature_array(features), _label_array(labels)
                row_layout = row_layout or (features.dtype, features.shape[1:], labels.dtype)
                self._feature_file.write(features.tobytes())
                self._label_file.write(labels.tobytes())
                rows += len(labels)
        if not rows:
            raise DataError(f"{spec[split]}: no rows under the CSV header; write examples into it")
        self._feature_file.flush()
        self._label_file.flush()
        feature_dtype, row_shape, label_dtype = row_layout
        self.features = np.memmap(self._feature_file, dtype=feature_dtype, mode="r", shape=(rows, *row_shape))
        self.labels = np.memmap(self._label_file, dtype=label_dtype, mode="r", shape=(rows,))

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices`` from the memory-mapped copy."""
        indices = np.asarray(indices, dtype=np.int64)
        return _feature_tensor(np.array(self.features[indices]), self.shape), _label_tensor(np.array(self.labels[indices]))


# --- NumPy ---------------------------------------------------------------------------


class ArrayInFile:
    """One C-ordered array stored in a file at a byte offset: memory-mapped where local, else read by range."""

    def __init__(self, location: str, name: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.location, self.name, self.offset, self.dtype, self.shape = location, name, offset, dtype, shape
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.mapped = None
        if "://" not in location:
            self.mapped = np.memmap(location, dtype=dtype, mode="r", offset=offset, shape=shape)

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """A copy of the rows at ``indices``."""
        if self.mapped is not None:
            return np.array(self.mapped[indices])
        out = np.empty((len(indices), *self.shape[1:]), dtype=self.dtype)
        with fsspec.open(self.location, "rb") as handle:
            for position, index in enumerate(indices):
                handle.seek(self.offset + int(index) * self.row_bytes)
                out[position] = np.frombuffer(handle.read(self.row_bytes), dtype=self.dtype).reshape(self.shape[1:])
        return out


def _npy_header(handle, where: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, bytes before the data) from an .npy header read by numpy's own format module."""
    start = handle.tell()
    try:
        version = np.lib.format.read_magic(handle)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"format version {version} (numpy.save writes 1.0 or 2.0)")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(handle)
    except ValueError as error:
        raise DataError(f"{where}: not a NumPy .npy array ({error})") from None
    if fortran_order:
        raise DataError(f"{where}: array is Fortran-ordered; save it C-ordered (np.ascontiguousarray) for row reads")
    if dtype.hasobject:
        raise DataError(f"{where}: array holds Python objects; save a numeric array")
    return dtype, tuple(shape), handle.tell() - start


def _npy_array(location: str) -> ArrayInFile:
    try:
        with fsspec.open(location, "rb") as handle:
            dtype, shape, header_bytes = _npy_header(handle, location)
    except FileNotFoundError:
        raise DataError(f"{location}: no such file; check the dataset's train/test locations") from None
    return ArrayInFile(location, location, header_bytes, dtype, shape)


def _npz_array(location: str, key: str) -> ArrayInFile:
    """The stored (uncompressed) member ``key``.npy of an .npz file, located through zipfile's own records."""
    where = f"{location}[{key}]"
    try:
        with fsspec.open(location, "rb") as handle:
            try:
                archive = zipfile.ZipFile(handle)
            except zipfile.BadZipFile:
                raise DataError(f"{location}: not an .npz file (not a zip archive)") from None
            names = [name.removesuffix(".npy") for name in archive.namelist()]
            if key not in names:
                raise DataError(f"{location}: no array {key!r} (arrays: {', '.join(names)}); set the dataset's "
                                "features/label keys")
            member = archive.getinfo(f"{key}.npy")
            if member.compress_type != zipfile.ZIP_STORED:
                raise DataError(f"{where}: compressed (np.savez_compressed); save with np.savez so rows can be "
                                "read in place")
            handle.seek(member.header_offset)
            header = struct.unpack(zipfile.structFileHeader, handle.read(zipfile.sizeFileHeader))
            data_start = (member.header_offset + zipfile.sizeFileHeader
                          + header[zipfile._FH_FILENAME_LENGTH] + header[zipfile._FH_EXTRA_FIELD_LENGTH])
            handle.seek(data_start)
            dtype, shape, header_bytes = _npy_header(handle, where)
    except FileNotFoundError:
        raise DataError(f"{location}: no such file; check the dataset's train/test locations") from None
    return ArrayInFile(location, where, data_start + header_bytes, dtype, shape)


def _numpy_arrays(spec: Mapping, split: str) -> tuple[ArrayInFile, ArrayInFile]:
    """(features, labels) arrays of an npy or npz split, with their shapes and dtypes checked."""
    if spec["format"] == "npy":
        features, labels = _npy_array(spec[split]["features"]), _npy_array(spec[split]["label"])
    else:
        features = _npz_array(spec[split], spec.get("features", "features"))
        labels = _npz_array(spec[split], spec.get("label", "label"))
    if len(features.shape) == 0 or len(features) == 0:
        raise DataError(f"{features.name}: empty (no examples); write examples into it")
    if not (np.issubdtype(features.dtype, np.number) or features.dtype == np.bool_):
        raise DataError(f"{features.name}: dtype {features.dtype}; features must be numeric")
    if len(labels.shape) != 1:
        raise DataError(f"{labels.name}: labels must be one-dimensional (got shape {labels.shape})")
    if not (np.issubdtype(labels.dtype, np.integer) or np.issubdtype(labels.dtype, np.floating)):
        raise DataError(f"{labels.name}: dtype {labels.dtype}; labels must be integers or floating point")
    if len(labels) != len(features):
        raise DataError(f"{labels.name}: {len(labels)} labels for {len(features)} examples in {features.name}")
    return features, labels


class NumpySource:
    """A split stored as NumPy arrays (.npy features + labels files, or one uncompressed .npz), read in place."""

    def __init__(self, spec: Mapping, split: str) -> None:
        self.features, self.labels = _numpy_arrays(spec, split)
        self.shape = spec.get("shape")

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at ``indices``, each reshaped to the spec's ``shape`` when given."""
        indices = np.asarray(indices, dtype=np.int64)
        return _feature_tensor(self.features.rows(indices), self.shape), _label_tensor(self.labels.rows(indices))


# --- image folders -----------------------------------------------------------------------


def _image_files(location: str) -> tuple[fsspec.AbstractFileSystem, list[str], list[tuple[str, int]]]:
    """(filesystem, class names, (file, class index) pairs) in torchvision's ImageFolder layout and order."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    filesystem, root = fsspec.core.url_to_fs(location)
    if not filesystem.isdir(root):
        raise DataError(f"{location}: no such directory; an image folder holds one subdirectory per class")
    classes = sorted(os.path.basename(entry["name"].rstrip("/")) for entry in filesystem.ls(root, detail=True)
                     if entry["type"] == "directory" and not os.path.basename(entry["name"].rstrip("/")).startswith("."))
    if not classes:
        raise DataError(f"{location}: no class subdirectories; put each class's images in <root>/<class>/")
    examples = []
    for class_index, name in enumerate(classes):
        files = sorted(path for path in filesystem.find(f"{root.rstrip('/')}/{name}")
                       if path.lower().endswith(IMG_EXTENSIONS))
        examples.extend((path, class_index) for path in files)
    if not examples:
        raise DataError(f"{location}: no image files ({', '.join(IMG_EXTENSIONS)}) in its class subdirectories")
    return filesystem, classes, examples


class ImageFolderSource:
    """A split stored as ``<root>/<class>/<image>`` files; images are decoded only when read.

    Labels are class indices in sorted class-name order (as torchvision's
    ImageFolder assigns them); pixels become float32 [C, H, W] in [0, 1].
    """

    def __init__(self, spec: Mapping, split: str) -> None:
        self.filesystem, self.classes, self.examples = _image_files(spec[split])
        self.mode = spec.get("mode", "RGB")

    def __len__(self) -> int:
        return len(self.examples)

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Decodes the images at ``indices``."""
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        if not len(indices):
            return _none_of(self)
        images = []
        for index in indices:
            with self.filesystem.open(self.examples[int(index)][0], "rb") as handle:
                images.append(pil_to_tensor(Image.open(handle).convert(self.mode)))
        labels = np.asarray([self.examples[int(index)][1] for index in indices], dtype=np.int64)
        return torch.stack(images).to(torch.float32).div_(255.0), torch.from_numpy(labels)


# --- schemas ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitSchema:
    """What a split's examples look like, from metadata alone (a declaration, a footer, a header): no row's values.

    ``columns`` names the feature columns (a table's) or the features array
    (NumPy's), and is empty for other data; ``input_shape`` is one example's
    feature shape, as the sources read it (the spec's ``shape`` when given).
    ``classes`` is how many classes the integer labels number from 0 where
    the data says so without its labels (a built-in's, an image folder's
    class folders, a declared ``num_classes``), else None; two splits with
    the same examples' form compare equal whatever their ``classes``.
    ``label_shape`` is one example's label shape: () for one label, [T]
    for a table's list of labels (one per token).
    """

    columns: tuple[str, ...]
    input_shape: tuple[int, ...]
    input_floating: bool
    label_floating: bool
    classes: int | None = dataclass_field(default=None, compare=False)
    label_shape: tuple[int, ...] = ()


def split_schema(spec: str | Mapping, split: str) -> SplitSchema | None:
    """The schema of ``split`` from what describes it, never from a training example's values.

    A built-in's is known (``workers.data.DATASETS``); an image folder's is
    its class folders and its first image's header (its size; the channels
    are the spec's ``mode``); a table's is its Parquet footer, CSV header or
    NumPy header. A ``module:function`` dataset's is the function's
    ``example_schema`` (``function_schema``); without one, the test split's
    is its first example's shape and dtypes (the driver loads the test split
    to evaluate on), and the training split's is None. None too for a
    variable-length list column without ``shape`` or ``max_length``; with
    ``max_length`` N, token ids and a list of labels are [N] each.
    """
    if isinstance(spec, str):
        if spec in BUILTINS:
            source = data.DATASETS[spec]
            return SplitSchema((), tuple(source.input_shape), True, False, source.classes)
        return function_schema(spec, split)
    classes = spec.get("num_classes")
    if spec["format"] == "imagefolder":
        return _image_folder_schema(spec, split)
    if spec["format"] in ("npy", "npz"):
        features, labels = _numpy_arrays(spec, split)
        shape = tuple(spec["shape"]) if "shape" in spec else tuple(features.shape[1:])
        return SplitSchema(("features" if spec["format"] == "npy" else spec.get("features", "features"),), shape,
                           bool(np.issubdtype(features.dtype, np.floating) or features.dtype == np.bool_),
                           bool(np.issubdtype(labels.dtype, np.floating)), classes)
    filesystem, paths = _files_at(spec[split], PARQUET_SUFFIXES if spec["format"] == "parquet" else (".csv",))
    if spec["format"] == "parquet":
        schema = _parquet_file(filesystem, paths[0]).schema_arrow
    else:
        schema = next(_csv_batches(paths[0], filesystem), (0, None))[1]
        if schema is None:
            return None
        schema = schema.schema
    columns, length = _check_schema(spec, schema, paths[0])
    if "shape" not in spec and length is None:
        return None
    types = [schema.field(name).type for name in columns]
    types = [types[0].value_type] if len(columns) == 1 and _is_list(types[0]) else types
    label_type = schema.field(spec.get("label", "label")).type
    label_shape = (spec.get("max_length", getattr(label_type, "list_size", None)),) if _is_list(label_type) else ()
    return SplitSchema(tuple(columns), tuple(spec["shape"]) if "shape" in spec else (length,),
                       any(pa.types.is_floating(kind) or pa.types.is_boolean(kind) for kind in types),
                       pa.types.is_floating(label_type), classes, label_shape)


# The keys of a module:function dataset's declared schema, and the dtypes each may name.
_DECLARED_DTYPES = {"input_dtype": ("float32", "int64"), "label_dtype": ("int64", "float32")}


def function_schema(reference: str, split: str) -> SplitSchema | None:
    """A ``module:function`` dataset's schema: the function's ``example_schema``, a mapping such as
    ``{"input_shape": [1, 28, 28], "input_dtype": "float32", "label_dtype": "int64", "classes": 10}``
    (dtypes default to these, ``classes`` to unknown); without one, the test split's first example's shape and
    dtypes, and None for the training split. Raises DataError naming a malformed declaration."""
    module_name, _, function_name = reference.partition(":")
    try:
        declared = getattr(getattr(importlib.import_module(module_name), function_name), "example_schema", None)
    except (ImportError, AttributeError) as error:
        raise DataError(f"dataset {reference!r}: cannot import it ({error}); check the module path") from None
    if declared is not None:
        return _declared_schema(reference, declared)
    if split == "train":
        return None
    inputs, labels = _none_of(TorchDatasetSource(_datasets_of(reference)[SPLITS.index(split)]))
    return SplitSchema((), tuple(inputs.shape[1:]), inputs.is_floating_point() or inputs.dtype == torch.bool,
                       labels.is_floating_point())


def _declared_schema(reference: str, declared: Any) -> SplitSchema:
    """The SplitSchema a function's ``example_schema`` declares; DataError naming what is wrong with it."""
    where = f"dataset {reference!r}: its function's example_schema"
    if not isinstance(declared, Mapping):
        raise DataError(f"{where} must be a mapping with input_shape (got {type(declared).__name__})")
    unknown = set(declared) - {"input_shape", "classes", *_DECLARED_DTYPES}
    shape = declared.get("input_shape")
    if unknown or not (isinstance(shape, (list, tuple)) and shape
                       and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise DataError(f"{where} needs input_shape, a list of integers >= 1 (e.g. [1, 28, 28]), and takes "
                        f"{', '.join(_DECLARED_DTYPES)} and classes (got {dict(declared)!r})")
    dtypes = {}
    for key, allowed in _DECLARED_DTYPES.items():
        dtypes[key] = declared.get(key, allowed[0])
        if dtypes[key] not in allowed:
            raise DataError(f"{where}: {key} must be one of {', '.join(allowed)} (got {dtypes[key]!r})")
    classes = declared.get("classes")
    if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int) or classes < 2):
        raise DataError(f"{where}: classes must be an integer >= 2 (got {classes!r})")
    return SplitSchema((), tuple(shape), dtypes["input_dtype"] == "float32", dtypes["label_dtype"] == "float32",
                       classes)


def _image_folder_schema(spec: Mapping, split: str) -> SplitSchema:
    """An image folder's schema: channels from its ``mode``, height and width from its first image's header,
    classes from its class folders (as ImageFolderSource numbers them); no pixel is decoded."""
    from PIL import Image

    filesystem, classes, examples = _image_files(spec[split])
    with filesystem.open(examples[0][0], "rb") as handle:
        width, height = Image.open(handle).size
    channels = len(spec.get("mode", "RGB"))
    return SplitSchema((), (channels, height, width), True, False, spec.get("num_classes", len(classes)))


# --- checks -----------------------------------------------------------------------------


# How the data's owner finds the rows a refusal names no number of: row numbers and counts come from private values.
FIND_ROWS = "its owner lists the rows with `dpfleet data check --config FILE` (or dpfleet train --show-values)"


@dataclass(frozen=True)
class RuleBreach:
    """The rows of one scanned chunk of a file that break one rule of ``check_source``.

    ``rows`` are row numbers in the file, ``values`` the offending value of
    each (a feature, a label, a length; None for a null). The rows, their
    count and the values come from private data: only the data's owner may
    read them (``error`` keeps them to its ``with_values``).
    """

    path: str
    column: str
    rule: str
    fix: str
    first_row: int
    scanned: int
    rows: np.ndarray
    values: np.ndarray | None

    def value(self, position: int) -> str:
        """The offending value of the ``position``-th row, as text."""
        return "null" if self.values is None else str(self.values[position])

    def listing(self, most: int = 3) -> str:
        """'2 of rows 0..39: row 4 (label 7), row 11 (label 3)': how many of the chunk's rows, and the first ones."""
        shown = ", ".join(f"row {row} ({self.value(position)})" for position, row in enumerate(self.rows[:most]))
        return (f"{len(self.rows)} of rows {self.first_row}..{self.first_row + self.scanned - 1} break it: {shown}"
                f"{', ...' if len(self.rows) > most else ''}")

    def error(self) -> DataError:
        """The refusal: the file, column, rule and fix, and how the owner finds the rows; with values, the rows."""
        message = f"{self.path}: column {self.column!r}: {self.rule}; {self.fix}"
        return DataError(f"{message}; {FIND_ROWS}", f"{message}; {self.listing()}")


def check_source(spec: str | Mapping, split: str, full: bool = False, num_classes: int | None = None,
                 found: Callable[[RuleBreach], None] | None = None) -> int:
    """Check a split's files before training; return its number of examples.

    Always: files exist and are readable, are not empty, have the feature and
    label columns with numeric types, and every example has the same number of
    feature values (the spec's ``shape`` when given). With ``full``, every
    value is also scanned: a NaN or infinite feature, a null, or an integer
    label outside 0..num_classes-1 (when ``num_classes`` is known) is refused.
    Raises DataError naming the file, column and rule, and the rows only in
    its ``with_values``. With ``found``, rows that break a rule are handed to
    it (one ``RuleBreach`` per file chunk, column and rule) and the scan goes
    on, for the data's owner (``dpfleet data check``). A ``module:function``
    dataset is only sized: checking its values would read its examples here.
    """
    if isinstance(spec, str):
        return source_size(spec, split)
    num_classes = spec.get("num_classes", num_classes)
    checker = {"parquet": _check_parquet, "csv": _check_csv, "npy": _check_numpy, "npz": _check_numpy,
               "imagefolder": _check_images}[spec["format"]]
    return checker(spec, split, full, num_classes, found or _refuse)


def _refuse(breach: RuleBreach) -> None:
    raise breach.error()


def _check_parquet(spec: Mapping, split: str, full: bool, num_classes: int | None,
                   found: Callable[[RuleBreach], None]) -> int:
    filesystem, paths = _files_at(spec[split], PARQUET_SUFFIXES)
    label = spec.get("label", "label")
    expected_length = _shape_size(spec)
    rows = 0
    for path in paths:
        parquet = _parquet_file(filesystem, path)
        if parquet.metadata.num_rows == 0:
            raise DataError(f"{path}: empty file (0 rows); remove it or write examples into it")
        columns, length = _check_schema(spec, parquet.schema_arrow, path)
        expected_length = _agreed_length(path, columns, length, expected_length)
        if length is None or full:
            # A variable-length list column can only be checked row by row.
            first_row = 0
            for batch in parquet.iter_batches(batch_size=_SCAN_ROWS, columns=[*columns, label], use_threads=False):
                expected_length = _check_batch(path, first_row, batch, columns, label, expected_length, full,
                                               num_classes, found, spec.get("max_length"))
                first_row += batch.num_rows
        rows += parquet.metadata.num_rows
    return rows


def _check_csv(spec: Mapping, split: str, full: bool, num_classes: int | None,
               found: Callable[[RuleBreach], None]) -> int:
    filesystem, paths = _files_at(spec[split], (".csv",))
    label = spec.get("label", "label")
    expected_length = _shape_size(spec)
    rows = 0
    for path in paths:
        file_rows = 0
        for first_row, batch in _csv_batches(path, filesystem):
            columns, length = _check_schema(spec, batch.schema, path)
            expected_length = _agreed_length(path, columns, length, expected_length)
            if full:
                _check_batch(path, first_row, batch, columns, label, expected_length, full, num_classes, found)
            file_rows += batch.num_rows
        if file_rows == 0:
            raise DataError(f"{path}: empty file (no rows under the header); remove it or write examples into it")
        rows += file_rows
    return rows


def _check_numpy(spec: Mapping, split: str, full: bool, num_classes: int | None,
                 found: Callable[[RuleBreach], None]) -> int:
    features, labels = _numpy_arrays(spec, split)
    length = int(np.prod(features.shape[1:], dtype=np.int64))
    if "shape" in spec and _shape_size(spec) != length:
        raise DataError(f"{features.name}: {length} values per example, but dataset.shape {spec['shape']} holds "
                        f"{_shape_size(spec)}; fix the shape")
    if full:
        array_name = "features" if spec["format"] == "npy" else spec.get("features", "features")
        value_names = [f"{array_name}[{position}]" for position in range(length)]
        for start in range(0, len(labels), _SCAN_ROWS):
            rows = np.arange(start, min(start + _SCAN_ROWS, len(labels)))
            _check_values(features.name, labels.name, rows, features.rows(rows).reshape(len(rows), -1),
                          value_names, labels.rows(rows), num_classes, found)
    return len(labels)


def _check_images(spec: Mapping, split: str, full: bool, num_classes: int | None,
                  found: Callable[[RuleBreach], None]) -> int:
    from PIL import Image, UnidentifiedImageError

    filesystem, classes, examples = _image_files(spec[split])
    if num_classes is not None and len(classes) > num_classes:
        raise DataError(f"{spec[split]}: {len(classes)} class folders, but num_classes is {num_classes}; "
                        "remove folders or raise num_classes")
    first_size = None
    for path, _ in examples:
        try:
            with filesystem.open(path, "rb") as handle:
                size = Image.open(handle).size  # reads the header only
        except (UnidentifiedImageError, OSError) as error:
            raise DataError(f"{path}: not a readable image ({error})") from None
        first_size = first_size or (size, path)
        if size != first_size[0]:
            expected = f"{first_size[0][0]}x{first_size[0][1]} (as {first_size[1]}); every image must have the same size"
            raise DataError(f"{path}: not {expected}", f"{path}: {size[0]}x{size[1]} pixels, expected {expected}")
    return len(examples)


def _shape_size(spec: Mapping) -> int | None:
    return int(np.prod(spec["shape"])) if "shape" in spec else None


def _agreed_length(path: str, columns: list[str], length: int | None, expected: int | None) -> int | None:
    """The feature length every file must share; refuses a fixed length that differs from it."""
    if length is None or expected is None:
        return expected if length is None else length
    if length != expected:
        raise DataError(f"{path}: column {columns[0]!r}: {length} values per example, expected {expected} "
                        "(dataset.shape, or the first file); every example needs the same number of features")
    return expected


def _check_batch(path: str, first_row: int, batch: pa.RecordBatch, columns: list[str], label: str,
                 expected_length: int | None, full: bool, num_classes: int | None,
                 found: Callable[[RuleBreach], None], max_length: int | None = None) -> int | None:
    """Checks one batch of a table's rows; returns the feature length (the first row's, if none was set).

    Rows that break a rule go to ``found``; the rows after them are checked
    for the other rules (when ``found`` lets the scan go on). With
    ``max_length`` a list column's rows may have any length: reads cut and
    pad them.
    """
    rows = np.arange(first_row, first_row + batch.num_rows)
    breach = functools.partial(RuleBreach, path, first_row=first_row, scanned=batch.num_rows)
    good = np.ones(batch.num_rows, dtype=bool)
    if max_length is not None:
        names = columns * max_length
    elif len(columns) == 1 and _is_list(batch.schema.field(columns[0]).type):
        lengths = pc.fill_null(pc.list_value_length(batch.column(columns[0])), -1).to_numpy()
        if expected_length is None and len(lengths):
            expected_length = int(lengths[0])
        wrong = np.flatnonzero(lengths != expected_length)
        if len(wrong):
            tokens = pa.types.is_integer(batch.schema.field(columns[0]).type.value_type)
            found(breach(columns[0], f"every example needs {expected_length} values (null or another length)",
                         "write every example with the same number of features" + (
                             " (token ids of any length: set dataset.max_length = N to cut and pad each to N)"
                             if tokens else ""), rows=rows[wrong],
                         values=np.array([f"{length} values" if length >= 0 else "null" for length in lengths[wrong]])))
            good[wrong] = False
        names = columns * (expected_length or 0)
    else:
        names = columns
    if full:
        for name in [*columns, label]:
            nulls = np.flatnonzero(batch.column(name).is_null().to_numpy(zero_copy_only=False) & good)
            if len(nulls):
                found(breach(name, "no value may be null (a missing value, or NaN in a CSV)",
                             'fill or drop those rows, or set check_data = "lenient" to drop them',
                             rows=rows[nulls], values=None))
                good[nulls] = False
        kept = pa.Table.from_batches([batch])
        if not good.all():
            kept = kept.filter(pa.array(good))
        if kept.num_rows:
            features, labels = _table_to_numpy(kept, columns, label, max_length)
            _check_values(path, path, rows[good], features, names, labels, num_classes, found, label,
                          (first_row, batch.num_rows))
    return expected_length


def _check_values(feature_file: str, label_file: str, rows: np.ndarray, features: np.ndarray, names: list[str],
                  labels: np.ndarray, num_classes: int | None, found: Callable[[RuleBreach], None],
                  label_name: str = "label", chunk: tuple[int, int] | None = None) -> None:
    """Hands ``found`` the rows (numbers ``rows``) with a NaN or infinite feature, one breach per feature column,
    and those with an integer label outside 0..num_classes-1; ``chunk`` is (first row, rows) of the scan."""
    first_row, scanned = chunk or (int(rows[0]), len(rows))
    if np.issubdtype(features.dtype, np.floating):
        bad = ~np.isfinite(features)
        if bad.any():
            # The row's first bad value names its column; rows are grouped by that column.
            bad_rows = np.flatnonzero(bad.any(axis=1))
            first_bad = bad[bad_rows].argmax(axis=1)
            columns = np.array(names, dtype=object)[first_bad]
            for column in dict.fromkeys(columns):
                chosen = columns == column
                found(RuleBreach(feature_file, column, "features must be finite",
                                 'fix or drop those rows, or set check_data = "lenient" to drop them', first_row,
                                 scanned, rows[bad_rows[chosen]],
                                 features[bad_rows[chosen], first_bad[chosen]]))
    if num_classes is not None and np.issubdtype(labels.dtype, np.integer):
        outside = (labels < 0) | (labels >= num_classes)
        per_token = labels.ndim > 1
        if per_token:  # a label per token; IGNORED_LABEL marks one that does not count
            outside = (outside & (labels != IGNORED_LABEL)).reshape(len(labels), -1)
            bad = np.flatnonzero(outside.any(axis=1))
            shown = labels.reshape(len(labels), -1)[bad, outside[bad].argmax(axis=1)]
        else:
            bad = np.flatnonzero(outside)
            shown = labels[bad]
        if len(bad):
            ignored = f", or {IGNORED_LABEL} where a token does not count" if per_token else ""
            found(RuleBreach(label_file, label_name, f"labels must lie in 0..{num_classes - 1} (num_classes "
                             f"{num_classes}){ignored}", "give the model one output per class, set the dataset's "
                             'num_classes, or set check_data = "lenient" to drop those rows', first_row, scanned,
                             rows[bad], np.array([f"label {label}" for label in shown])))


# --- writing ----------------------------------------------------------------------------

# Rows per Parquet row group that write_parquet_shards writes: a step's random rows each cost one row
# group's decoding, so small groups keep reads near the cost of the rows themselves. Reading 125 random rows
# of 784 float32 took 19, 9 and 6 ms of CPU at 32, 16 and 8 rows per group; the footer grows as groups
# shrink (about 230 bytes a group, 29 MB for 2 million rows at 16), and every reader holds it.
PARQUET_ROW_GROUP_ROWS = 16


def write_parquet_shards(directory: str, batches: Iterable[tuple[np.ndarray, np.ndarray]], rows: int,
                         shards: int, compression: str = "none") -> list[str]:
    """Write ``rows`` examples, given in order as (features [n, ...], labels [n]) batches, as Parquet shards.

    Shard k (``part-0000k.parquet`` in ``directory``) holds rows
    k*rows//shards .. (k+1)*rows//shards - 1. Each example's features are
    flattened into one fixed-size list column ``features``; labels go to
    ``label``. Batches are streamed, so the dataset need not fit in memory.
    ``compression`` is a Parquet codec: "none" reads fastest (decompressing
    each small row group costs more than reading it), "zstd" is smallest.
    Returns the paths written.
    """
    if not 1 <= shards <= rows:
        raise ValueError(f"shards must be between 1 and the number of rows ({rows}) (got {shards})")
    filesystem, root = _pyarrow_filesystem(directory)
    filesystem.create_dir(root, recursive=True)
    bounds = [shard * rows // shards for shard in range(shards + 1)]
    paths = [f"{root.rstrip('/')}/part-{shard:05d}.parquet" for shard in range(shards)]
    writer, shard, written = None, -1, 0
    try:
        for features, labels in batches:
            features = features.reshape(len(features), -1)
            while len(labels):
                if writer is None or written == bounds[shard + 1]:
                    if writer is not None:
                        writer.close()
                    shard += 1
                    writer = pq.ParquetWriter(
                        filesystem.open_output_stream(paths[shard]), _schema_of(features, labels),
                        compression=compression, use_dictionary=False, write_statistics=["label"],
                    )
                take = min(len(labels), bounds[shard + 1] - written)
                writer.write_table(training_table(features[:take], labels[:take]),
                                   row_group_size=PARQUET_ROW_GROUP_ROWS)
                features, labels, written = features[take:], labels[take:], written + take
    finally:
        if writer is not None:
            writer.close()
    if written != rows:
        raise ValueError(f"batches held {written} rows, expected {rows}")
    return paths


def _schema_of(features: np.ndarray, labels: np.ndarray) -> pa.Schema:
    """Required (non-null) columns: Parquet then stores no definition levels, and a row group decodes twice as fast."""
    element = pa.field("element", pa.from_numpy_dtype(features.dtype), nullable=False)
    return pa.schema([pa.field("features", pa.list_(element, features.shape[1]), nullable=False),
                      pa.field("label", pa.from_numpy_dtype(labels.dtype), nullable=False)])


def training_table(features: np.ndarray, labels: np.ndarray) -> pa.Table:
    """Examples as ``write_parquet_shards`` writes them: a fixed-size list column ``features`` and ``label``."""
    schema = _schema_of(features, labels)
    values = pa.array(np.ascontiguousarray(features).ravel())
    return pa.table({"features": pa.FixedSizeListArray.from_arrays(values, type=schema.field("features").type),
                     "label": labels}, schema=schema)
