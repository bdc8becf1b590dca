"""Text data: token ids of any length cut and padded to max_length through the Parquet sources, checks and planned
batches, and `dpfleet data tokenize` from raw text to a table a tiny GPT-2 with LoRA trains on.

The models are test_pretrained.py's tiny random ones with a word-level
tokenizer whose words are w0..w58 (ids 5..63); nothing reaches a hub.
"""

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from orchestrator import release  # noqa: E402
from orchestrator.cli import main  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.errors import UsageError  # noqa: E402
from orchestrator.preflight import dry_run, training_schemas  # noqa: E402
from test_pretrained import VOCABULARY, save_tiny_models  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.planned_batches import PlannedBatch, gather_window, private_window_folder, read_planned_batch, \
    read_planned_dataset, remove_window_folder, share_capacity  # noqa: E402
from workers.sources import DataError, check_source, dropped_rows, open_source, parse_spec, read_column, \
    split_schema  # noqa: E402
from workers.text import token_table  # noqa: E402
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


def word(index: int) -> str:
    return f"w{index}"


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


# --- dpfleet data tokenize ----------------------------------------------------------------------------------


def tokenize(capsys, *arguments) -> tuple[int, str, str]:
    with release.observe() as seen:
        status = main(["data", "tokenize", *map(str, arguments)])
    out, err = capsys.readouterr()
    assert release.undeclared_lines(out) == [] and all(artifact == "log" for artifact, _ in seen)
    return status, out, err


def test_tokenize_a_text_file_for_a_causal_lm_and_read_it_back(folders, tmp_path, capsys):
    lines = ["w1 w2 w3", "", "  ", " ".join(map(word, range(10, 30))), "w3 w3"]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    status, out, _ = tokenize(capsys, "--model", folders["gpt2"], "--task", "causal-lm", "--max-length", 8,
                              tmp_path / "train.txt", tmp_path / "train.parquet")
    assert status == 0
    output = tmp_path / "train.parquet"
    assert f"wrote {output}: 3 examples for causal-lm, input_ids of 8 token ids (padded with -1)" in out
    assert "1 of 3 examples had more than 8 tokens and were cut to 8" in out
    assert f'dataset = {{ format = "parquet", train = "{output}", test = "TEST.parquet", features = "input_ids"' in out
    spec = parse_spec({"format": "parquet", "train": str(output), "test": str(output), "features": "input_ids"})
    schema = split_schema(spec, "train")
    assert (schema.input_shape, schema.label_shape) == ((8,), (8,))
    inputs, labels = open_source(spec, "train").read(np.arange(3))
    first = [VOCABULARY.index(token) for token in ("w1", "w2", "w3")]
    assert inputs[0].tolist() == first + [-1] * 5 and labels[0].tolist() == first[1:] + [-100] * 6
    assert inputs[1].tolist() == [VOCABULARY.index(word(index)) for index in range(10, 18)]
    assert labels[1].tolist() == inputs[1].tolist()[1:] + [-100]
    assert check_source(spec, "train", full=True, num_classes=len(VOCABULARY)) == 3


def test_tokenize_jsonl_for_a_classifier_numbers_text_labels_and_keeps_the_user_id(folders, tmp_path, capsys):
    rows = [{"text": " ".join(map(word, range(index + 1))), "label": ["neg", "pos", "mid"][index % 3],
             "user_id": f"person-{index % 2}", "note": "dropped"} for index in range(6)]
    (tmp_path / "reviews.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, out, _ = tokenize(capsys, "--model", folders["bert"], "--task", "sequence-classification",
                              "--max-length", 4, tmp_path / "reviews.jsonl", tmp_path / "reviews.parquet")
    assert status == 0
    assert "the text labels are numbered in sorted order: 0 = 'mid', 1 = 'neg', 2 = 'pos'; the model takes " \
           "num_labels = 3" in out
    table = pq.read_table(tmp_path / "reviews.parquet")
    assert table.column_names == ["input_ids", "label", "user_id"]
    assert table.column("label").to_pylist() == [1, 2, 0, 1, 2, 0]
    assert table.column("user_id").to_pylist() == [f"person-{index % 2}" for index in range(6)]
    assert table.schema.field("input_ids").type == pa.list_(pa.field("element", pa.int64(), nullable=False), 4)
    path = str(tmp_path / "reviews.parquet")
    config = build_config({"steps": 1, "batch_size": 2, "noise_multiplier": 1.0, "privacy_unit": "user", "user_id": "user_id",
                           "model": {"hf": folders["bert"], "task": "sequence-classification", "num_labels": 3},
                           "dataset": {"format": "parquet", "train": path, "test": path, "features": "input_ids"}})
    ((_, schema),) = training_schemas(config)
    assert (schema.input_shape, schema.label_shape, schema.columns) == ((4,), (), ("input_ids",))
    assert read_column(config.dataset, "train", "user_id").tolist() == ["person-0", "person-1"] * 3


def test_tokenize_a_saved_dataset_dict_takes_its_split(folders, tmp_path, capsys):
    splits = datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"text": [" ".join(map(word, range(count))) for count in (2, 3, 4)],
                                           "label": [0, 1, 1], "id": [f"{split}-{row}" for row in range(3)]})
        for split in ("train", "test")})
    splits.save_to_disk(str(tmp_path / "saved"))
    status, out, _ = tokenize(capsys, "--model", folders["gpt2"], "--task", "sequence-classification", "--split",
                              "test", "--max-length", 6, tmp_path / "saved", tmp_path / "test.parquet")
    assert status == 0 and "the text labels" not in out
    table = pq.read_table(tmp_path / "test.parquet")
    assert table.column("id").to_pylist() == ["test-0", "test-1", "test-2"]
    assert table.column("label").to_pylist() == [0, 1, 1]
    assert table.column("input_ids").to_pylist()[0] == [VOCABULARY.index("w0"), VOCABULARY.index("w1")] + [-1] * 4
    status, _, err = tokenize(capsys, "--model", folders["gpt2"], "--task", "causal-lm", "--split", "validation",
                              tmp_path / "saved", tmp_path / "other.parquet")
    assert status == 2 and "holds the splits train, test; choose one with --split (got 'validation')" in err


def test_tokenize_prints_no_row_of_the_text(folders, tmp_path, capsys):
    secret = "w41 w42 w43 w44"
    (tmp_path / "private.jsonl").write_text(json.dumps({"text": secret, "label": "w58-only-here"}) + "\n")
    status, out, err = tokenize(capsys, "--model", folders["gpt2"], "--task", "causal-lm", tmp_path / "private.jsonl",
                                tmp_path / "private.parquet")
    assert status == 0 and secret not in out + err and "w58-only-here" not in out + err
    ids = pq.read_table(tmp_path / "private.parquet").column("input_ids").to_pylist()[0]
    assert " ".join(map(str, ids[:4])) not in out + err
    # A refused input names its column and a count, never a row.
    (tmp_path / "unlabelled.jsonl").write_text(json.dumps({"text": "w1", "label": "pos"}) + "\n"
                                               + json.dumps({"text": secret, "label": None}) + "\n")
    status, out, err = tokenize(capsys, "--model", folders["gpt2"], "--task", "sequence-classification",
                                tmp_path / "unlabelled.jsonl", tmp_path / "unlabelled.parquet")
    assert status == 2 and "column 'label': 1 example(s) have no label (null); fill or drop them" in err
    assert secret not in out + err and not (tmp_path / "unlabelled.parquet").exists()


def wordpiece_tokenizer():
    """A BERT-like tokenizer whose words "w1x" and "w2xx" split into several tokens, with [CLS] and [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocabulary = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "w1", "w2", "w3",
                                                               "##x"])}
    tokenizer = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]")


def test_token_classification_gives_each_words_label_to_its_first_token():
    table = pa.table({"text": [["w1x", "w3", "w2xx"], ["w3", "w1x", "w3", "w2"]], "label": [["B", "O", "I"],
                                                                                          ["O", "B", "O", "O"]]})
    tokenized = token_table(table, wordpiece_tokenizer(), "token-classification", 6)
    assert tokenized.label_names == ("B", "I", "O") and tokenized.truncated == 2
    ids = tokenized.table.column("input_ids").to_pylist()
    labels = tokenized.table.column("label").to_pylist()
    # [CLS] w1 ##x w3 w2 ##x ##x [SEP] and [CLS] w3 w1 ##x w3 w2 [SEP] are 8 and 7 tokens: cut to 6, [SEP] kept.
    assert ids[0] == [2, 4, 7, 6, 5, 3] and labels[0] == [-100, 0, -100, 2, 1, -100]
    assert ids[1] == [2, 6, 4, 7, 6, 3] and labels[1] == [-100, 2, 0, -100, 2, -100]
    # Text split on white space is words too; a label list of another length than the words is refused.
    spaced = token_table(pa.table({"text": ["w3 w1x"], "label": [[1, 0]]}), wordpiece_tokenizer(),
                         "token-classification", 8)
    assert spaced.table.column("label").to_pylist() == [[-100, 1, 0, -100, -100, -100, -100, -100]]
    with pytest.raises(ValueError, match="1 example\\(s\\) have another number of labels than words"):
        token_table(pa.table({"text": ["w3 w1x"], "label": [[1]]}), wordpiece_tokenizer(), "token-classification", 8)


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


def test_a_tiny_gpt2_with_lora_trains_in_bf16_on_tokenized_text(local_ray, folders, tmp_path, capsys):
    generator = random.Random(0)
    for split, count in (("train", 40), ("test", 10)):
        (tmp_path / f"{split}.txt").write_text("".join(
            " ".join(word(generator.randrange(59)) for _ in range(generator.randrange(2, 12))) + "\n"
            for _ in range(count)))
        assert tokenize(capsys, "--model", folders["gpt2"], "--task", "causal-lm", "--max-length", 8,
                        tmp_path / f"{split}.txt", tmp_path / f"{split}.parquet")[0] == 0
    config = tmp_path / "job.toml"
    config.write_text(
        f'model = {{ hf = "{folders["gpt2"]}", task = "causal-lm" }}\n'
        'adapter = { kind = "lora", r = 2, alpha = 4, target_modules = ["c_attn"] }\n'
        f'steps = 3\nbatch_size = 8\nnoise_multiplier = 1.0\nmax_physical_batch = 4\nworkers = 1\n'
        'precision = "bf16"\n'
        f'run_dir = "{tmp_path / "run"}"\n'
        f'dataset = {{ format = "parquet", train = "{tmp_path / "train.parquet"}", test = '
        f'"{tmp_path / "test.parquet"}", features = "input_ids" }}\n')
    assert main(["train", "--config", str(config), "--no-progress", "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["dataset_size"] == 40
    assert "c_attn.lora_A.default (Linear): fast" in out  # LoRA's factors on the fast engine's rules, in bf16
    assert 0 < summary["epsilon"] < 10 and np.isfinite(summary["test_loss"])
