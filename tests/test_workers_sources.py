"""Every data-source format on small files made here: reads by index, sizes from metadata, one-line checks."""

import os
import stat
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from workers import sources
from workers.sources import FIND_ROWS, DataError, check_source, open_source, parse_spec, source_size

ROWS, WIDTH = 50, 6
RNG = np.random.default_rng(7)
FEATURES = RNG.random((ROWS, WIDTH), dtype=np.float32)
LABELS = np.arange(ROWS) % 3
PICKED = np.array([49, 3, 3, 0, 27, 12])


def list_table(features=FEATURES, labels=LABELS):
    return pa.table({"pixels": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), features.shape[1]),
                     "label": labels})


def assert_reads(spec, expected_features=FEATURES, expected_labels=LABELS, shape=None):
    source = open_source(spec, "train")
    assert len(source) == len(expected_labels) == source_size(spec, "train")
    inputs, labels = source.read(PICKED)
    expected = torch.from_numpy(expected_features[PICKED])
    assert torch.equal(inputs.reshape(len(PICKED), -1), expected.reshape(len(PICKED), -1))
    assert labels.tolist() == expected_labels[PICKED].tolist()
    if shape is not None:
        assert inputs.shape[1:] == tuple(shape)
    none_inputs, none_labels = source.read(np.array([], dtype=np.int64))
    assert none_inputs.shape == (0, *inputs.shape[1:]) and none_labels.shape == (0,)
    assert none_inputs.dtype == inputs.dtype and none_labels.dtype == labels.dtype
    return inputs, labels


def table_spec(file_format, train, test=None, **keys):
    return parse_spec({"format": file_format, "train": str(train), "test": str(test or train), **keys})


def test_parquet_directory_of_files_reads_rows_across_files_and_row_groups(tmp_path):
    (tmp_path / "train").mkdir()
    pq.write_table(list_table().slice(0, 20), tmp_path / "train" / "a.parquet", row_group_size=7)
    pq.write_table(list_table().slice(20), tmp_path / "train" / "b.parquet", row_group_size=4)
    (tmp_path / "train" / "_SUCCESS").write_text("")
    spec = table_spec("parquet", tmp_path / "train", features="pixels", shape=[2, 3])
    inputs, labels = assert_reads(spec, shape=[2, 3])
    assert inputs.dtype == torch.float32 and labels.dtype == torch.int64
    assert check_source(spec, "train", full=True, num_classes=3) == ROWS


def test_parquet_scalar_feature_columns_and_float_labels(tmp_path):
    targets = FEATURES[:, 0] * 2.0
    columns = {f"x{i}": FEATURES[:, i] for i in range(WIDTH)}
    pq.write_table(pa.table({**columns, "target": targets}), tmp_path / "t.parquet", row_group_size=16)
    spec = table_spec("parquet", tmp_path / "t.parquet", label="target")
    inputs, labels = assert_reads(spec, expected_labels=targets)
    assert labels.dtype == torch.float32


def test_parquet_reads_rows_from_many_groups_and_files_in_any_order(tmp_path):
    table = list_table()
    pq.write_table(table.slice(0, ROWS // 2), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(table.slice(ROWS // 2), tmp_path / "b.parquet", row_group_size=4)
    source = open_source(table_spec("parquet", tmp_path, features="pixels"), "train")
    indices = np.array([ROWS - 1, 0, 5, 5, ROWS // 2, 2, ROWS // 2 - 1])
    inputs, labels = source.read(indices)
    assert torch.equal(inputs, torch.as_tensor(FEATURES[indices]).reshape(inputs.shape))
    assert torch.equal(labels, torch.as_tensor(LABELS[indices]))


def test_parquet_on_an_fsspec_filesystem(tmp_path):
    import fsspec

    with fsspec.open("memory://dpfleet-test/train.parquet", "wb") as handle:
        pq.write_table(list_table(), handle, row_group_size=9)
    assert_reads(parse_spec({"format": "parquet", "train": "memory://dpfleet-test/train.parquet",
                             "test": "memory://dpfleet-test/train.parquet", "features": "pixels"}))


def test_written_parquet_shards_split_the_rows_in_order(tmp_path):
    batches = [(FEATURES[start:start + 15].reshape(-1, 2, 3), LABELS[start:start + 15]) for start in range(0, ROWS, 15)]
    paths = sources.write_parquet_shards(str(tmp_path / "out"), batches, ROWS, 4)
    assert [pq.ParquetFile(path).metadata.num_rows for path in paths] == [12, 13, 12, 13]
    assert_reads(table_spec("parquet", tmp_path / "out", features="features"))


class WatchedSource(sources.InMemorySource):
    """An in-memory source that records each read and fails if two threads ever read at once."""

    def __init__(self):
        super().__init__(torch.from_numpy(FEATURES), torch.from_numpy(LABELS))
        self.reads, self.reading = [], threading.Lock()

    def read(self, indices):
        assert self.reading.acquire(blocking=False), "two reads at once"
        try:
            time.sleep(0.05)
            self.reads.append((threading.current_thread().name, list(indices)))
            return super().read(indices)
        finally:
            self.reading.release()


def test_rows_read_ahead_are_the_rows_asked_for_and_reads_never_overlap():
    watched = WatchedSource()
    ahead = sources.PrefetchingSource(watched)
    ahead.prefetch(PICKED)
    inputs, labels = ahead.read(PICKED)
    assert torch.equal(inputs, torch.from_numpy(FEATURES[PICKED])) and labels.tolist() == LABELS[PICKED].tolist()
    assert [(thread.startswith("prefetch"), rows) for thread, rows in watched.reads] == [(True, PICKED.tolist())]
    # Other rows than those read ahead: read now, after the read ahead finishes; its rows stay for their own read.
    ahead.prefetch([1, 2])
    inputs, _ = ahead.read([5])
    assert torch.equal(inputs, torch.from_numpy(FEATURES[[5]]))
    assert ahead.read([1, 2])[1].tolist() == LABELS[[1, 2]].tolist()
    assert [(thread.startswith("prefetch"), rows) for thread, rows in watched.reads[1:]] == [(True, [1, 2]), (False, [5])]
    # A new read ahead replaces one never taken; the old rows are then read again when asked for.
    ahead.prefetch([7])
    ahead.prefetch([8])
    ahead.read([7])
    assert [rows for _, rows in watched.reads[3:]] == [[7], [8], [7]]


def test_npy_files_are_memory_mapped(tmp_path):
    np.save(tmp_path / "x.npy", FEATURES.reshape(ROWS, 2, 3))
    np.save(tmp_path / "y.npy", LABELS)
    files = {"features": str(tmp_path / "x.npy"), "label": str(tmp_path / "y.npy")}
    spec = parse_spec({"format": "npy", "train": files, "test": files})
    assert_reads(spec, shape=[2, 3])
    assert isinstance(open_source(spec, "train").features.mapped, np.memmap)
    assert check_source(spec, "train", full=True, num_classes=3) == ROWS


def test_npz_members_are_read_in_place_and_compressed_ones_refused(tmp_path):
    np.savez(tmp_path / "d.npz", x=FEATURES, y=LABELS.astype(np.int32))
    assert_reads(table_spec("npz", tmp_path / "d.npz", features="x", label="y"))
    np.savez_compressed(tmp_path / "c.npz", x=FEATURES, y=LABELS)
    with pytest.raises(DataError, match=r"c\.npz\[x\]: compressed"):
        open_source(table_spec("npz", tmp_path / "c.npz", features="x", label="y"), "train")


def test_csv_is_streamed_into_a_memory_map_of_unnamed_owner_only_files(tmp_path):
    table = pa.table({**{f"x{i}": FEATURES[:, i] for i in range(WIDTH)}, "label": LABELS})
    pa_csv.write_csv(table, tmp_path / "t.csv")
    spec = table_spec("csv", tmp_path / "t.csv")
    assert_reads(spec)
    source = open_source(spec, "train")
    assert isinstance(source.features, np.memmap)
    # The copy of the rows has no name (no link to it from any folder) and only its owner may read it.
    for copy in (source._feature_file, source._label_file):
        status = os.fstat(copy.fileno())
        assert status.st_nlink == 0 and stat.S_IMODE(status.st_mode) == 0o600


def test_image_folder_in_torchvision_layout(tmp_path):
    pixels = RNG.integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
    for index, class_name in enumerate(["cat", "dog", "cat", "emu", "dog"]):
        (tmp_path / class_name).mkdir(exist_ok=True)
        Image.fromarray(pixels[index], mode="L").save(tmp_path / class_name / f"{index}.png")
    spec = table_spec("imagefolder", tmp_path, mode="L")
    source = open_source(spec, "train")
    inputs, labels = source.read(np.array([4, 0]))
    # sorted classes cat, dog, emu; files within a class sorted: cat/0, cat/2, dog/1, dog/4, emu/3
    assert labels.tolist() == [2, 0]
    assert inputs.shape == (2, 1, 4, 3)
    assert torch.equal(inputs[1, 0], torch.from_numpy(pixels[0]).float() / 255)
    assert check_source(spec, "train") == 5


class ArrayDataset(torch.utils.data.Dataset):
    """(input, label) items over arrays, as a user's module:function would return."""

    def __init__(self, features, labels):
        self.features, self.labels = features, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return torch.from_numpy(self.features[index]), int(self.labels[index])


def array_datasets():
    return ArrayDataset(FEATURES, LABELS), ArrayDataset(FEATURES[:10], LABELS[:10])


def test_module_function_datasets():
    spec = parse_spec(f"{__name__}:array_datasets")
    assert_reads(spec)
    assert source_size(spec, "test") == 10


def test_specs_are_validated_and_local_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_spec({"format": "parquet", "train": "data/train", "test": "s3://bucket/test"})
    assert spec["train"] == str(tmp_path / "data" / "train") and spec["test"] == "s3://bucket/test"
    assert sources.spec_name(spec) == str(tmp_path / "data" / "train")
    with pytest.raises(ValueError, match="dataset.format must be one of parquet, csv, npy, npz, imagefolder"):
        parse_spec({"format": "hdf5", "train": "a", "test": "b"})
    with pytest.raises(ValueError, match="dataset.test is required"):
        parse_spec({"format": "parquet", "train": "a"})
    with pytest.raises(ValueError, match="unknown: mode"):
        parse_spec({"format": "parquet", "train": "a", "test": "b", "mode": "L"})
    with pytest.raises(ValueError, match="must be one of mnist, fashion-mnist, 'package.module:function'"):
        parse_spec("cifar10")


# --- checks: one line naming the file, and the row and column where they apply -------------------


def one_line_error(spec, split="train", **options):
    return one_line_errors(spec, split, **options)[0]


def one_line_errors(spec, split="train", **options):
    """The error's message, and the same line quoting the value (`with_values`, for the data's owners)."""
    with pytest.raises(DataError) as raised:
        check_source(spec, split, **options)
    message, with_values = str(raised.value), raised.value.with_values
    assert "\n" not in message and "\n" not in with_values
    return message, with_values


def test_check_refuses_a_missing_column_and_a_wrong_dtype(tmp_path):
    pq.write_table(list_table(), tmp_path / "t.parquet")
    path = tmp_path / "t.parquet"
    assert one_line_error(table_spec("parquet", path, features="pixels", label="y")) == (
        f"{path}: no label column 'y' (columns: pixels, label); set the dataset's label key")
    assert one_line_error(table_spec("parquet", path, features="image")).startswith(
        f"{path}: no feature column 'image'")
    pq.write_table(pa.table({"pixels": list_table()["pixels"], "label": [str(v) for v in LABELS]}), path)
    assert one_line_error(table_spec("parquet", path, features="pixels")).startswith(
        f"{path}: column 'label' has type string; labels must be integers")


def test_check_names_the_row_and_column_of_a_ragged_row(tmp_path):
    rows = [list(map(float, row)) for row in FEATURES]
    rows[31] = rows[31][:-1]
    pq.write_table(pa.table({"pixels": rows, "label": LABELS}), tmp_path / "t.parquet")
    message, with_values = one_line_errors(table_spec("parquet", tmp_path / "t.parquet", features="pixels"))
    rule = (f"{tmp_path / 't.parquet'}: column 'pixels': every example needs 6 values (null or another length); "
            "write every example with the same number of features")
    # The row's number is the data's: only the owner's line quotes it, with its length.
    assert message == f"{rule}; {FIND_ROWS}" and "31" not in message
    assert with_values == f"{rule}; 1 of rows 0..{ROWS - 1} break it: row 31 (5 values)"
    with open(tmp_path / "t.csv", "w") as handle:
        handle.write("a,b,label\n1,2,0\n3,4,1\n5,7777\n")
    message, with_values = one_line_errors(table_spec("csv", tmp_path / "t.csv"))
    # pyarrow quotes the row's text; only the owner's line keeps it.
    assert message == (f"{tmp_path / 't.csv'}: not readable as CSV (CSV parse error: Expected 3 columns, got 2); "
                       f"{FIND_ROWS}")
    assert with_values == (f"{tmp_path / 't.csv'}: not readable as CSV (CSV parse error: Row #4: Expected 3 columns, "
                           "got 2: 5,7777)")


def test_a_csv_value_of_the_wrong_type_is_named_by_row_and_column_not_quoted(tmp_path):
    # pyarrow infers a column's type from the first block (1 MB) and refuses a later value that does not parse.
    (tmp_path / "t.csv").write_text("a,label\n" + "1,0\n" * 300_000 + "x9secret,1\n")
    message, with_values = one_line_errors(table_spec("csv", tmp_path / "t.csv"))
    assert message == (f"{tmp_path / 't.csv'}: not readable as CSV (In CSV column #0: CSV conversion error to int64: "
                       f"invalid value); {FIND_ROWS}")
    assert "x9secret" not in message and with_values.endswith("Row #300002: CSV conversion error to int64: invalid "
                                                              "value 'x9secret')")


def test_check_refuses_a_fixed_length_that_disagrees_with_the_shape_or_other_files(tmp_path):
    (tmp_path / "d").mkdir()
    pq.write_table(list_table(), tmp_path / "d" / "a.parquet")
    pq.write_table(list_table(features=FEATURES[:, :4]), tmp_path / "d" / "b.parquet")
    assert one_line_error(table_spec("parquet", tmp_path / "d", features="pixels")).startswith(
        f"{tmp_path / 'd' / 'b.parquet'}: column 'pixels': 4 values per example, expected 6")
    assert one_line_error(table_spec("parquet", tmp_path / "d" / "a.parquet", features="pixels",
                                     shape=[1, 28, 28])).startswith(
        f"{tmp_path / 'd' / 'a.parquet'}: column 'pixels': 6 values per example, expected 784")


def test_check_refuses_empty_and_missing_files(tmp_path):
    pq.write_table(list_table().slice(0, 0), tmp_path / "empty.parquet")
    assert one_line_error(table_spec("parquet", tmp_path / "empty.parquet", features="pixels")) == (
        f"{tmp_path / 'empty.parquet'}: empty file (0 rows); remove it or write examples into it")
    (tmp_path / "empty.csv").write_text("a,label\n")
    assert one_line_error(table_spec("csv", tmp_path / "empty.csv")).startswith(f"{tmp_path / 'empty.csv'}: empty")
    np.save(tmp_path / "x.npy", np.zeros((0, 3), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(0, np.int64))
    files = {"features": str(tmp_path / "x.npy"), "label": str(tmp_path / "y.npy")}
    assert one_line_error(parse_spec({"format": "npy", "train": files, "test": files})).startswith(
        f"{tmp_path / 'x.npy'}: empty")
    assert one_line_error(table_spec("parquet", tmp_path / "nowhere")).startswith(
        f"{tmp_path / 'nowhere'}: no such file or directory")


def test_full_check_refuses_labels_out_of_range_and_non_finite_features(tmp_path):
    path = tmp_path / "t.parquet"
    features = FEATURES.copy()
    features[17, 4] = np.nan
    pq.write_table(list_table(features=features), path)
    spec = table_spec("parquet", path, features="pixels")
    assert check_source(spec, "train") == ROWS  # the basic check reads no values
    rule = 'features must be finite; fix or drop those rows, or set check_data = "lenient" to drop them'
    assert one_line_errors(spec, full=True) == (f"{path}: column 'pixels': {rule}; {FIND_ROWS}",
                                                f"{path}: column 'pixels': {rule}; 1 of rows 0..{ROWS - 1} break it: "
                                                "row 17 (nan)")
    labels = LABELS.copy()
    labels[40] = 3
    pq.write_table(list_table(labels=labels), path)
    labels_rule = ("labels must lie in 0..2 (num_classes 3); give the model one output per class, set the dataset's "
                   'num_classes, or set check_data = "lenient" to drop those rows')
    assert one_line_errors(spec, full=True, num_classes=3) == (
        f"{path}: column 'label': {labels_rule}; {FIND_ROWS}",
        f"{path}: column 'label': {labels_rule}; 1 of rows 0..{ROWS - 1} break it: row 40 (label 3)")
    assert check_source(spec, "train", full=True, num_classes=4) == ROWS
    np.save(tmp_path / "x.npy", features)
    np.save(tmp_path / "y.npy", LABELS)
    files = {"features": str(tmp_path / "x.npy"), "label": str(tmp_path / "y.npy")}
    assert one_line_error(parse_spec({"format": "npy", "train": files, "test": files}), full=True) == (
        f"{tmp_path / 'x.npy'}: column 'features[4]': {rule}; {FIND_ROWS}")


def test_check_refuses_images_of_another_size(tmp_path):
    (tmp_path / "a").mkdir()
    Image.new("L", (4, 4)).save(tmp_path / "a" / "0.png")
    Image.new("L", (5, 4)).save(tmp_path / "a" / "1.png")
    message, with_values = one_line_errors(table_spec("imagefolder", tmp_path))
    assert message == (f"{tmp_path / 'a' / '1.png'}: not 4x4 (as {tmp_path / 'a' / '0.png'}); every image must have "
                       "the same size")
    assert with_values.startswith(f"{tmp_path / 'a' / '1.png'}: 5x4 pixels, expected 4x4")
