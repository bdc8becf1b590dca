"""Text data: token ids of any length cut and padded to max_length through the Parquet sources, checks, planned
batches and the dry run.

The models are test_pretrained.py's tiny random ones; nothing reaches a hub.
"""


import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")

from orchestrator.config import build_config  # noqa: E402
from orchestrator.errors import UsageError  # noqa: E402
from orchestrator.preflight import dry_run, training_schemas  # noqa: E402
from test_pretrained import save_tiny_models  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.planned_batches import PlannedBatch, gather_window, private_window_folder, read_planned_batch, \
    read_planned_dataset, remove_window_folder, share_capacity  # noqa: E402
from workers.sources import DataError, check_source, dropped_rows, open_source, parse_spec, read_column, \
    split_schema  # noqa: E402
from workers.window_keys import WindowKey  # noqa: E402

IDS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], []]
TAGS = [[1, 2, 0], [1], [0, 0, 1, 1, 2, 7], []]  # the 7 lies past max_length 4: it is cut, never checked


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(str(tmp_path_factory.mktemp("models")))


def token_spec(tmp_path, ids=IDS, labels=TAGS, **keys) -> dict:
    pq.write_table(pa.table({"input_ids": ids, "label": labels, "user_id": list(range(len(ids)))}),
                   tmp_path / "tokens.parquet", row_group_size=2)
    path = str(tmp_path / "tokens.parquet")
    return parse_spec({"format": "parquet", "train": path, "test": path, "features": "input_ids", **keys})


# --- Parquet: lists of any length, cut and padded ------------------------------------------------------------


def test_token_ids_and_labels_of_any_length_are_cut_and_padded_to_max_length(tmp_path):
    spec = token_spec(tmp_path, max_length=4)
    inputs, labels = open_source(spec, "train").read(np.array([3, 0, 2, 1]))
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.tolist() == [[-1] * 4, [5, 6, 7, -1], [9, 10, 11, 12], [8, -1, -1, -1]]
    assert labels.tolist() == [[-100] * 4, [1, 2, 0, -100], [0, 0, 1, 1], [1, -100, -100, -100]]
    schema = split_schema(spec, "train")
    assert (schema.input_shape, schema.label_shape, schema.input_floating) == ((4,), (4,), False)
    assert check_source(spec, "train", full=True, num_classes=3) == 4
    assert read_column(spec, "train", "user_id").tolist() == [0, 1, 2, 3]


def test_the_strict_check_takes_minus_100_in_a_list_of_labels_and_refuses_a_class_outside(tmp_path):
    spec = token_spec(tmp_path, max_length=4)
    with pytest.raises(DataError) as refused:
        check_source(spec, "train", full=True, num_classes=2)
    assert "labels must lie in 0..1 (num_classes 2), or -100 where a token does not count" in str(refused.value)
    assert "row 0 (label 2)" in refused.value.with_values and "label -100" not in refused.value.with_values
    # The lenient rule drops that row alone: row 2's labels outside 0..1 lie past max_length.
    assert dropped_rows({**spec, "num_classes": 2}, "train").kept.tolist() == [1, 2, 3]


def test_lists_of_any_length_without_max_length_are_refused_with_the_fix(tmp_path):
    for folder in "abc":
        (tmp_path / folder).mkdir()
    with pytest.raises(DataError, match="column 'label' is a list of labels and column 'input_ids' a list of token "
                                        "ids of any length; set dataset.max_length = N"):
        check_source(token_spec(tmp_path / "a"), "train")
    with pytest.raises(DataError, match=r"every example needs 3 values .* \(token ids of any length: set "
                                        r"dataset.max_length = N to cut and pad each to N\)"):
        check_source(token_spec(tmp_path / "b", labels=[0, 1, 0, 1]), "train")
    fixed = pa.list_(pa.int64(), 3)
    pq.write_table(pa.table({"input_ids": pa.array([[5, 6, 7]] * 2, fixed), "label": pa.array([[1, 2]] * 2)}),
                   tmp_path / "c" / "t.parquet")
    spec = parse_spec({"format": "parquet", "train": str(tmp_path / "c"), "test": str(tmp_path / "c")})
    with pytest.raises(DataError, match="column 'label' is a list of labels of any length; set dataset.max_length"):
        check_source(spec, "train")
    pq.write_table(pa.table({"input_ids": pa.array([[5, 6, 7]] * 2, fixed),
                             "label": pa.array([[1, 2]] * 2, pa.list_(pa.int64(), 2))}), tmp_path / "c" / "t.parquet")
    with pytest.raises(DataError, match="holds 2 labels per example and the features 3 values"):
        check_source(spec, "train")
    # Fixed-size lists of one length train as they are, without max_length.
    pq.write_table(pa.table({"input_ids": pa.array([[5, 6, 7]] * 2, fixed),
                             "label": pa.array([[6, 7, -100]] * 2, fixed)}), tmp_path / "c" / "t.parquet")
    assert split_schema(spec, "train").label_shape == (3,)
    assert open_source(spec, "train").read(np.array([1]))[1].tolist() == [[6, 7, -100]]


def test_max_length_takes_one_list_column_of_integers_and_no_shape(tmp_path):
    with pytest.raises(ValueError, match="give one or the other"):
        parse_spec({"format": "parquet", "train": "t", "test": "t", "max_length": 4, "shape": [4]})
    with pytest.raises(ValueError, match="max_length must be an integer >= 1"):
        parse_spec({"format": "parquet", "train": "t", "test": "t", "max_length": 0})
    pq.write_table(pa.table({"x": [[0.5, 1.5]], "label": [0]}), tmp_path / "floats.parquet")
    path = str(tmp_path / "floats.parquet")
    with pytest.raises(DataError, match="max_length cuts and pads token ids, which are integers"):
        check_source(parse_spec({"format": "parquet", "train": path, "test": path, "max_length": 4}), "train")
    pq.write_table(pa.table({"a": [1], "b": [2], "label": [0]}), tmp_path / "columns.parquet")
    path = str(tmp_path / "columns.parquet")
    with pytest.raises(DataError, match="the features are the column\\(s\\) a, b; name the token ids' column"):
        check_source(parse_spec({"format": "parquet", "train": path, "test": path, "max_length": 4}), "train")


def test_planned_batches_carry_a_label_per_token(local_ray, tmp_path, request):
    generator = np.random.default_rng(5)
    ids = [list(generator.integers(5, 60, generator.integers(0, 9))) for _ in range(60)]
    spec = token_spec(tmp_path, ids=ids, labels=[[token % 3 for token in row] for row in ids], max_length=6)
    dataset = read_planned_dataset(spec)
    assert dataset.max_length == 6 and dataset.no_rows[1].shape == (0, 6) and dataset.row_bytes == 6 * 8 * 2
    shares = {step: np.array_split(np.flatnonzero(generator.random(60) < 0.3), 2) for step in range(3)}
    folder = private_window_folder()
    request.addfinalizer(lambda: remove_window_folder(folder))
    key = WindowKey()
    _, ephemeral = gather_window(dataset, shares, folder, key.run, share_capacity(9))
    source = open_source(spec, "train")
    for step, parts in shares.items():
        for worker, share in enumerate(parts):
            planned = read_planned_batch(PlannedBatch(folder, step, worker, key.run,
                                                      key.file_key(ephemeral, step, worker)), dataset)
            if not len(share):
                assert planned is None
                continue
            inputs, labels = source.read(share)
            torch.testing.assert_close(planned[0], inputs)
            torch.testing.assert_close(planned[1], labels)


# --- training -----------------------------------------------------------------------------------------------


def test_the_dry_run_sees_token_ids_and_a_label_per_token_of_the_datas_length(folders, tmp_path):
    spec = token_spec(tmp_path, max_length=5)
    config = build_config({"steps": 1, "batch_size": 2, "noise_multiplier": 1.0, "dataset": spec,
                           "model": {"hf": folders["llama"], "task": "token-classification", "num_labels": 3}})
    ((_, schema),) = training_schemas(config)
    assert (schema.input_shape, schema.label_shape, schema.input_floating) == ((5,), (5,), False)
    assert dry_run(config, build_model(config.model_spec)) == 3
    # Longer than the model's 32 positions: refused before anything is reserved, with the key to change.
    config = build_config({"steps": 1, "batch_size": 2, "noise_multiplier": 1.0, "dataset": {**spec, "max_length": 40},
                           "model": {"hf": folders["gpt2"], "task": "causal-lm"}})
    with pytest.raises(UsageError, match=r"input \[40\] int64\) failed: IndexError.*set the dataset's max_length "
                                         "to at most the tokens the model takes"):
        dry_run(config, build_model(config.model_spec))
