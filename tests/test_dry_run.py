"""A newcomer's mistake costs no ε: the model runs on made-up examples of the data's schema before anything is
reserved, and each mistake is one short paragraph with exit status ≠ 0 and the ledger as it was."""

import csv
import io
import json
import os
import re
import sys
import textwrap

import pytest

from accounting.ledger.store import open_embedded_ledger
from orchestrator.cli import main

DATASET = "toy"
FEATURES = 8
CLASSES = 3

LINEAR_MODEL = """
from torch import nn


class Net(nn.Module):
    def __init__(self, features={features}, classes={classes}):
        super().__init__()
        self.layer = nn.Linear(features, classes)

    def forward(self, x):
        return self.layer(x.flatten(1))


def build():
    return Net()
"""


def write_csv(path, columns, rows, label_of=lambda row: row % CLASSES):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*columns, "label"])
        for row in range(rows):
            writer.writerow([*(0.1 * ((row + column) % 7) for column in range(len(columns))), label_of(row)])


def newcomer_job(tmp_path, module_text, module_name, test_columns=None, label_of=lambda row: row % CLASSES,
                 features=FEATURES, dataset_lines=""):
    """A CSV dataset, a model module beside the config (no PYTHONPATH), and the config; returns its path."""
    columns = [f"x{index}" for index in range(features)]
    write_csv(tmp_path / "train.csv", columns, 40, label_of)
    write_csv(tmp_path / "test.csv", test_columns or columns, 20)
    (tmp_path / f"{module_name}.py").write_text(module_text)
    config = tmp_path / "job.toml"
    config.write_text(textwrap.dedent(f"""\
        model = "{module_name}:build"
        workers = 1
        steps = 2
        batch_size = 10
        noise_multiplier = 1.0
        learning_rate = 0.1
        max_physical_batch = 16
        run_dir = "{tmp_path / 'run'}"

        [dataset]
        format = "csv"
        name = "{DATASET}"
        train = "{tmp_path / 'train.csv'}"
        test = "{tmp_path / 'test.csv'}"
        """) + dataset_lines)
    return str(config)


@pytest.fixture
def toy_budget(monkeypatch):
    """The dataset registered in the (per-test) embedded ledger, so that 'unchanged' has something to compare.

    The config's folder goes on the import path and PYTHONPATH; both are put back after the test.
    """
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with open_embedded_ledger() as ledger:
        ledger.create_dataset(DATASET, 10.0, 1e-5)


def assert_refused_before_reserving(config, capsys, *expected):
    """Exit status ≠ 0, at most 15 lines on stderr, no traceback, each ``expected`` text in it, and the ledger as
    it was: no job, nothing reserved or spent."""
    status = main(["train", "--config", config, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status != 0, err
    assert len(err.splitlines()) <= 15 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    with open_embedded_ledger() as ledger:
        budget = ledger.get_budget(DATASET)
        assert ledger.list_jobs() == []
    assert budget.reserved_epsilon == 0 and budget.spent_epsilon == 0 and budget.spent_epsilon_filter == 0
    return err


def test_a_model_for_another_input_shape_is_refused_before_reserving(tmp_path, capsys, toy_budget):
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=5, classes=CLASSES), "shape_model")
    err = assert_refused_before_reserving(config, capsys, "the model's forward pass", "input [8] float32",
                                          f"{tmp_path / 'shape_model.py'}:", "No budget was reserved")
    assert "(in forward)" in err


def test_a_model_for_another_channel_count_is_refused_before_reserving(tmp_path, capsys, toy_budget):
    module = textwrap.dedent("""
        from torch import nn


        def build():
            return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(16, 3))
        """)
    config = newcomer_job(tmp_path, module, "channel_model", features=48, dataset_lines="shape = [3, 4, 4]\n")
    assert_refused_before_reserving(config, capsys, "input [3, 4, 4] float32", "channels",
                                    "set the dataset's shape key")


def test_a_label_outside_the_classes_is_refused_naming_the_rule_and_no_row(tmp_path, capsys, toy_budget):
    # The analyst chooses the classes (the model's output width): a row number or a count in the refusal would
    # answer "which rows have a label >= 3, and how many" at no cost in ε. Only the owner's flag shows them.
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "label_model",
                          label_of=lambda row: 3 if row in (5, 9, 30, 38) else row % CLASSES)
    err = assert_refused_before_reserving(config, capsys, f"{tmp_path / 'train.csv'}: column 'label': labels must "
                                          "lie in 0..2 (num_classes 3)", "dpfleet data check --config FILE")
    assert not planted(err, 4, 5, 9, 30, 38), err
    assert main(["train", "--config", config, "--no-progress", "--show-values"]) == 2
    owner = capsys.readouterr().err
    assert "4 of rows 0..39 break it: row 5 (label 3), row 9 (label 3), row 30 (label 3), ..." in owner


def test_train_and_test_with_different_columns_are_refused_before_reserving(tmp_path, capsys, toy_budget):
    test_columns = [f"x{index}" for index in range(FEATURES - 1)] + ["extra"]
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "columns_model",
                          test_columns=test_columns)
    assert_refused_before_reserving(config, capsys, "the test split does not match the training split", "extra")


def test_a_bug_in_the_users_model_module_names_its_file_and_line(tmp_path, capsys, toy_budget):
    module = LINEAR_MODEL.format(features=FEATURES, classes=CLASSES).replace(
        "return self.layer(x.flatten(1))", "return self.layer(x.flatten(1)) * scale")
    line = module.splitlines().index("        return self.layer(x.flatten(1)) * scale") + 1
    config = newcomer_job(tmp_path, module, "buggy_model")
    assert_refused_before_reserving(config, capsys, f"{tmp_path / 'buggy_model.py'}:{line} (in forward)",
                                    "NameError: name 'scale' is not defined")


def test_a_model_module_that_fails_on_import_names_its_file_and_line(tmp_path, capsys, toy_budget):
    module = "import torch\n\nLAYERS = 3 / 0\n\n\ndef build():\n    return torch.nn.Linear(8, 3)\n"
    config = newcomer_job(tmp_path, module, "broken_import_model")
    assert_refused_before_reserving(config, capsys, f"{tmp_path / 'broken_import_model.py'}:3",
                                    "ZeroDivisionError")


def test_a_loss_that_does_not_fit_the_output_is_refused_before_reserving(tmp_path, capsys, toy_budget):
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "loss_model")
    with open(config, "a") as handle:
        handle.write("")
    text = open(config).read().replace('model = "loss_model:build"', 'model = "loss_model:build"\nloss = "mse"')
    open(config, "w").write(text)
    assert_refused_before_reserving(config, capsys, "the loss 'mse' on the model's output (shape [2, 3])")


def test_a_failure_after_reserving_releases_the_unrun_steps(tmp_path, capsys, toy_budget):
    # The model works in the driver's dry run and on the workers' made-up examples (standard normal, so some
    # |x| > 1), and fails in the gradient worker's process on the data's rows (all |x| < 1). The run starts its own
    # Ray, whose workers find the module beside the config as the driver does (the config's folder on PYTHONPATH).
    module = LINEAR_MODEL.format(features=FEATURES, classes=CLASSES).replace(
        "return self.layer(x.flatten(1))",
        f"if os.getpid() != {os.getpid()} and x.abs().max() < 1:\n"
        "            raise RuntimeError('worker-side failure')\n"
        "        return self.layer(x.flatten(1))").replace("from torch import nn", "import os\n\nfrom torch import nn")
    config = newcomer_job(tmp_path, module, "worker_failing_model")
    status = main(["train", "--config", config, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) <= 15 and "Traceback" not in err, err
    assert "worker-side failure" in err and "--debug" in err
    with open_embedded_ledger() as ledger:
        budget = ledger.get_budget(DATASET)
        (job,) = ledger.list_jobs()
    assert job.state == "released" and budget.reserved_epsilon == 0


def test_excluded_columns_and_the_user_id_are_no_features(tmp_path, monkeypatch):
    from orchestrator.config import build_config
    from workers.sources import split_schema

    monkeypatch.setattr(sys, "path", list(sys.path))
    columns = [f"x{index}" for index in range(FEATURES)] + ["user_id", "note"]
    for split in ("train", "test"):
        write_csv(tmp_path / f"{split}.csv", columns, 20)
    table = {"format": "csv", "train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.csv"),
             "exclude_columns": ["note"]}
    people = dict(privacy_unit="user", user_id="user_id", max_examples_per_user=2, noise_multiplier=1.0, steps=2,
                  batch_size=4)
    config = build_config({"dataset": table, **people})
    assert config.dataset["exclude_columns"] == ["note", "user_id"]
    schema = split_schema(config.dataset, "train")
    assert schema.columns == tuple(columns[:FEATURES]) and schema.input_shape == (FEATURES,)
    # Asked for by name, the user id is a feature.
    named = {key: value for key, value in table.items() if key != "exclude_columns"} | {"features": ["x0", "user_id"]}
    asked = build_config({"dataset": named, **people})
    assert split_schema(asked.dataset, "train").columns == ("x0", "user_id")


def test_the_summary_says_whether_sigma_or_the_target_was_fixed():
    from orchestrator.cli.train import noise_row
    from orchestrator.config import build_config

    base = {"dataset": "mnist", "steps": 50, "batch_size": 250}
    assert noise_row(build_config({**base, "noise_multiplier": 1.1}), {"noise_multiplier": 1.1, "steps": 50}) == [
        "noise multiplier (fixed)", 1.1]
    chosen = noise_row(build_config({**base, "target_epsilon": 2.0}), {"noise_multiplier": 0.7, "steps": 50})
    assert chosen == ["noise multiplier (chosen for the fixed target epsilon 2 over 50 steps)", 0.7]


def nan_and_label_rows(row):
    """Labels for the lenient tests: rows 4 and 11 have a label outside 0..2 (row 7's features are made NaN)."""
    return 5 if row in (4, 11) else row % CLASSES


def with_bad_rows(tmp_path, config_text):
    """Row 7 of the training CSV gets a NaN feature, row 33 an infinite one."""
    path = tmp_path / "train.csv"
    lines = path.read_text().splitlines()
    for row, value in ((7, "nan"), (33, "inf")):
        cells = lines[row + 1].split(",")
        cells[2] = value
        lines[row + 1] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    return config_text


def planted(text, *numbers):
    """The planted numbers that appear in `text` as numbers of their own (not inside 0.12, 2e-12 or an id)."""
    return [number for number in numbers if re.search(rf"(?<![\w.+-]){number}(?![\w.])", text)]


def test_strict_refuses_nan_rows_naming_the_rule_and_no_row(tmp_path, capsys, toy_budget):
    config = with_bad_rows(tmp_path, newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES),
                                                  "strict_model"))
    # A CSV's "nan" reads as a missing value; "inf" as infinity.
    err = assert_refused_before_reserving(config, capsys, "column 'x2': no value may be null", 'check_data = "lenient"')
    assert not planted(err, 7), err
    text = (tmp_path / "train.csv").read_text().replace(",nan,", ",0.5,")
    (tmp_path / "train.csv").write_text(text)
    err = assert_refused_before_reserving(config, capsys, "column 'x2': features must be finite")
    assert not planted(err, 33), err
    assert main(["train", "--config", config, "--no-progress", "--show-values"]) == 2
    assert "1 of rows 0..39 break it: row 33 (inf)" in capsys.readouterr().err


def lenient_job(tmp_path):
    """A lenient job whose training CSV has 14 of its 40 rows dropped: rows 7 and 33 not finite, and the other 12 of
    rows 1, 4, .., 37 with label 5, outside 0..2; the test split's 20 rows are all kept."""
    config = with_bad_rows(tmp_path, newcomer_job(
        tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "lenient_model",
        label_of=lambda row: 5 if row % 3 == 1 else row % CLASSES))
    text = open(config).read().replace("run_dir =", 'check_data = "lenient"\nrun_dir =')
    open(config, "w").write(text)
    return config


def test_lenient_prints_no_count_of_what_it_drops_and_n_counts_every_row(tmp_path, capsys, toy_budget):
    config = lenient_job(tmp_path)
    assert main(["train", "--config", config, "--no-progress", "--json"]) == 0
    out, err = capsys.readouterr()
    assert ('check_data = "lenient" drops rows that fail its rules (finite values, labels in 0..2): they take no '
            "part in training or evaluation. How many is not printed") in out
    # 14 dropped, 2 of them not finite, 12 labels outside, 26 kept: none of these counts is printed, and N is
    # every row of the file (q = 10/40), not the 26 rows kept.
    assert not planted(out + err, 14, 12, 26), out + err
    summary = json.loads(out.splitlines()[-1])
    assert summary["sampling_rate"] == pytest.approx(10 / 40)
    run_dir = tmp_path / "run"
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".csv", ".txt"):
            assert "dropped" not in path.read_text() and not planted(path.read_text(), 14, 26), path
    with open_embedded_ledger() as ledger:
        (job,) = ledger.list_jobs()
    assert job.state == "released" and job.committed_steps == 2
    # The data's owner asks for the count (run_job hands --show-values to the trainer as show_values).
    from orchestrator.config import load_config
    from orchestrator.trainer import Trainer

    log = io.StringIO()
    Trainer(load_config(config, {}), show_progress=False, show_values=True, out=log)
    assert ('check_data = "lenient" dropped 14 of 40 train rows (2 with a NaN or infinite value, 12 with a label '
            "outside 0..2); 0 of 20 test rows") in log.getvalue()


def test_a_lenient_sample_is_drawn_over_every_row_and_the_dropped_rows_leave_it():
    import numpy as np

    from workers.sources import DroppedRows

    kept = np.array([0, 2, 3, 7], dtype=np.int64)
    dropped = DroppedRows(9, 3, 2, kept)
    mask, positions = dropped.among_kept(np.array([0, 1, 3, 7, 8]))
    assert mask.tolist() == [True, False, True, True, False] and positions.tolist() == [0, 2, 3]


def test_data_check_lists_the_rows_their_count_and_values_and_reserves_nothing(tmp_path, capsys, toy_budget):
    config = lenient_job(tmp_path)
    assert main(["data", "check", "--config", config, "--rows", "3"]) == 1
    out = capsys.readouterr().out
    train = tmp_path / "train.csv"
    assert "NOT private" in out and "dataset train: 14 of 40 rows break a rule" in out
    assert (f"{train}: column 'label': labels must lie in 0..2 (num_classes 3): 12 row(s): row 1 (label 5), "
            "row 4 (label 5), row 10 (label 5), ...") in out
    assert (f"{train}: column 'x2': no value may be null (a missing value, or NaN in a CSV): 1 row(s): row 7 "
            "(null)") in out
    assert f"{train}: column 'x2': features must be finite: 1 row(s): row 33 (inf)" in out
    assert "dataset test: 0 of 20 rows break a rule" in out
    with open_embedded_ledger() as ledger:
        assert ledger.list_jobs() == []
    assert main(["data", "check", "--config", config, "--split", "test"]) == 0
    assert main(["data", "check", "--config", config, "--shard", "0"]) == 2
    assert "the config has none" in capsys.readouterr().err


def test_lenient_is_refused_where_the_rows_it_drops_would_differ_between_readers():
    from orchestrator.config import build_config
    from orchestrator.errors import UsageError

    with pytest.raises(UsageError, match='check_data = "lenient" .* cannot be combined with a dataset other than'):
        build_config({"dataset": "mnist", "check_data": "lenient", "steps": 1, "batch_size": 10,
                      "noise_multiplier": 1.0})


def test_early_stopping_ends_the_run_at_an_evaluation_and_releases_the_unrun_steps(tmp_path, capsys, toy_budget):
    # min_delta 1e9: no evaluation improves the loss, so patience 1 stops the run at the first evaluation point
    # (step 4). Blocks of 4 steps on a slow clock: the first is charged at once, the next two never.
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "stopping_model")
    text = open(config).read().replace("steps = 2", "steps = 12").replace("run_dir =", (
        "early_stopping_patience = 1\nearly_stopping_min_delta = 1e9\nevaluate_every = { steps = 4 }\n"
        "commit_every = 4\ncommit_interval = 60\nrun_dir ="))
    open(config, "w").write(text)
    assert main(["train", "--config", config, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "stopped early after step 4 of 12: test loss did not improve for 1 evaluation(s)" in out
    assert "steps (stopped early; the rest released, not charged)" in out and "4 of 12" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stopped_early"] is True and summary["planned_steps"] == 12
    with open_embedded_ledger() as ledger:
        budget = ledger.get_budget(DATASET)
        (job,) = ledger.list_jobs()
    assert job.state == "released" and job.committed_steps == 4 and budget.reserved_epsilon == 0
    assert budget.spent_epsilon == pytest.approx(summary["epsilon"], rel=1e-9)


def test_the_early_stopping_rule_counts_evaluations_since_the_best():
    from orchestrator.early_stopping import evaluations_without_improvement, stops_early

    losses = [{"test_loss": value} for value in (1.0, 0.8, 0.85, 0.79, 0.9, 0.95)]
    assert evaluations_without_improvement(losses, "loss", 0.0) == 2
    assert evaluations_without_improvement(losses, "loss", 0.05) == 4  # 0.79 is not 0.05 better than 0.8
    accuracies = [{"test_accuracy": value} for value in (0.1, 0.5, 0.4)]
    assert stops_early(accuracies, "accuracy", 1, 0.0) and not stops_early(accuracies, "accuracy", 2, 0.0)
    from orchestrator.config import build_config
    from orchestrator.errors import UsageError

    with pytest.raises(UsageError, match='early_stopping_metric must be "loss" or one of the run\'s metrics'):
        build_config({"dataset": "mnist", "steps": 1, "batch_size": 10, "noise_multiplier": 1.0,
                      "early_stopping_patience": 2, "early_stopping_metric": "auroc"})


def test_a_model_that_fails_under_the_runs_clipping_engine_is_refused_before_reserving(tmp_path, capsys, toy_budget):
    # Plain autograd runs .item(); torch.func's vmap, which the vmap engine batches examples with, cannot.
    module = LINEAR_MODEL.format(features=FEATURES, classes=CLASSES).replace(
        "return self.layer(x.flatten(1))", "return self.layer(x.flatten(1)) * (1.0 if x.sum().item() else 1.0)")
    config = newcomer_job(tmp_path, module, "engine_model")
    text = open(config).read().replace("run_dir =", 'engine = "vmap"\nrun_dir =')
    open(config, "w").write(text)
    assert_refused_before_reserving(config, capsys, "one clipped sum by the vmap clipping engine (precision fp32)",
                                    f"{tmp_path / 'engine_model.py'}:", "No budget was reserved")


def test_bf16_runs_on_the_fast_engine_and_is_refused_with_microbatches():
    # A bf16 run on the fast engine, LoRA's rules included: test_text_data trains a tiny GPT-2 so.
    from orchestrator.config import build_config
    from orchestrator.errors import UsageError

    job = {"dataset": "mnist", "steps": 1, "batch_size": 10, "noise_multiplier": 1.0, "precision": "bf16"}
    assert build_config(job).engine == "fast"
    with pytest.raises(UsageError, match='precision = "bf16" cannot be combined with microbatch_size: change those'):
        build_config({**job, "microbatch_size": 2})


# --- every kind of data: built-ins, image folders, functions, transforms, shards ----------------------------------

MNIST_MISFIT = """
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear({features}, {classes})

    def forward(self, x):
        return self.layer(x.flatten(1))


def build():
    return Net()
"""


def any_data_job(tmp_path, module_text, module_name, dataset, extra=""):
    """A config for the model module beside it on ``dataset`` (a TOML value or a [dataset] table's lines), under
    the ledger name DATASET; no data is written and, for a built-in, none is fetched (DPFLEET_DATA is empty)."""
    (tmp_path / f"{module_name}.py").write_text(module_text)
    table = dataset.startswith("[")
    config = tmp_path / "job.toml"
    config.write_text(textwrap.dedent(f"""\
        model = "{module_name}:build"
        {'' if table else f'dataset = {dataset}'}
        dataset_name = "{DATASET}"
        workers = 1
        steps = 2
        batch_size = 10
        noise_multiplier = 1.0
        learning_rate = 0.1
        max_physical_batch = 16
        data_root = "{tmp_path / 'no-data'}"
        run_dir = "{tmp_path / 'run'}"
        """) + extra + (f"\n{dataset}\n" if table else ""))
    return str(config)


def refused_in_time(config, capsys, *expected):
    """``assert_refused_before_reserving``, then the same command again: exit status 2 within 3 s (its modules
    imported by the first)."""
    import time

    err = assert_refused_before_reserving(config, capsys, *expected)
    started = time.monotonic()
    assert main(["train", "--config", config, "--no-progress"]) == 2
    assert time.monotonic() - started < 3.0
    assert capsys.readouterr().err.strip() == err
    return err


def test_a_model_for_another_input_size_is_refused_on_mnist_before_reserving(tmp_path, capsys, toy_budget):
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=100, classes=10), "mnist_misfit", '"mnist"')
    err = refused_in_time(config, capsys, "input [1, 28, 28] float32",
                          "The model's first layer 'layer' (Linear) takes 100 values; the data gives 1×28×28 = 784.",
                          "No budget was reserved; make the first layer 'layer' take 784 values (nn.Linear(784, ...))")
    assert "shape key" not in err, "a built-in takes no shape key"
    assert not (tmp_path / "no-data").exists(), "the built-in's schema is known: nothing is fetched"
    assert "vmap" not in err


def test_dpfleet_train_builds_and_checks_the_model_once_and_the_trainer_takes_it(tmp_path, capsys, toy_budget,
                                                                                  monkeypatch):
    from orchestrator.errors import UsageError
    from orchestrator.trainer import Trainer

    module = textwrap.dedent("""
        from torch import nn

        BUILT = []


        def build():
            BUILT.append(nn.Sequential(nn.Flatten(), nn.Linear(8, 3)))
            return BUILT[-1]
        """)
    config = newcomer_job(tmp_path, module, "built_once_model")
    trained = []

    def stop_after_the_model(trainer, *args):
        trained.append(trainer.model)
        raise UsageError("stopped after the model, before the plan")

    monkeypatch.setattr(Trainer, "_plan_run", stop_after_the_model)
    assert main(["train", "--config", config, "--no-progress"]) == 2
    assert "stopped after the model" in capsys.readouterr().err
    built = sys.modules["built_once_model"].BUILT
    assert len(built) == 1 and trained == built, "the dry run's model is the one the trainer trains"


def test_a_classifier_with_fewer_outputs_than_the_builtins_classes_is_refused(tmp_path, capsys, toy_budget):
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=784, classes=5), "mnist_five", '"fashion-mnist"')
    refused_in_time(config, capsys, "the model gives 5 outputs per example and the data 'fashion-mnist' has 10 "
                    "classes (labels 0..9)", "give the model's last layer 10 outputs")


def test_shards_of_a_builtin_are_checked_before_reserving_or_starting_ray(tmp_path, capsys, toy_budget):
    shards = 'shards = [{ dataset = "mnist", part = 0, parts = 2 }, { dataset = "mnist", part = 1, parts = 2 }]\n'
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=100, classes=10), "shard_misfit", '"mnist"', shards)
    text = open(config).read().replace("workers = 1\n", "")
    open(config, "w").write(text)
    refused_in_time(config, capsys, "takes 100 values; the data gives 1×28×28 = 784")


def test_training_transforms_are_checked_by_their_output_on_a_made_up_example(tmp_path, capsys, toy_budget):
    resize = 'train_transforms = [{ name = "Resize", size = [8, 8] }]\n'
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=784, classes=10), "resized", '"mnist"', resize)
    refused_in_time(config, capsys, "input [1, 28, 28] float32, after train_transforms: input [1, 8, 8] float32",
                    "takes 784 values; it gets 64", "take 64 values")
    too_large = 'train_transforms = [{ name = "RandomCrop", size = 32 }]\n'
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=784, classes=10), "cropped", '"mnist"', too_large)
    refused_in_time(config, capsys, "train_transforms on a made-up example of the data's shape (input [1, 28, 28] "
                    "float32) failed: ValueError: Required crop size (32, 32) is larger than input image size "
                    "(28, 28)", "make each transform fit the data's shape")


def write_image_folder(root, classes=3, size=(6, 4)):
    from PIL import Image

    for split in ("train", "test"):
        for index in range(classes):
            folder = root / split / f"class{index}"
            folder.mkdir(parents=True)
            for image in range(5):
                Image.new("RGB", size, (40 * index, 10 * image, 0)).save(folder / f"{image}.png")


def test_an_image_folder_gives_its_schema_from_its_first_images_header(tmp_path, capsys, toy_budget):
    write_image_folder(tmp_path / "images")
    folder = (f'[dataset]\nformat = "imagefolder"\ntrain = "{tmp_path / "images" / "train"}"\n'
              f'test = "{tmp_path / "images" / "test"}"')
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=100, classes=3), "folder_misfit", folder)
    refused_in_time(config, capsys, "input [3, 4, 6] float32", "the data gives 3×4×6 = 72")


def test_more_outputs_than_the_datas_classes_warns_and_a_table_without_classes_gets_a_note(tmp_path, monkeypatch):
    from orchestrator.config import load_config
    from orchestrator.preflight import build_checked_model, dry_run

    monkeypatch.setattr(sys, "path", list(sys.path))
    write_image_folder(tmp_path / "images", classes=2)
    folder = (f'[dataset]\nformat = "imagefolder"\ntrain = "{tmp_path / "images" / "train"}"\n'
              f'test = "{tmp_path / "images" / "test"}"')
    config = load_config(any_data_job(tmp_path, MNIST_MISFIT.format(features=72, classes=5), "wide", folder), {})
    said = []
    assert dry_run(config, build_checked_model(config), said.append) == 5
    assert said == [f"warning: the model gives 5 outputs per example and the data '{tmp_path / 'images' / 'train'}' "
                    "has 2 classes (labels 0..1): "
                    "cross_entropy takes one output per class, and the extra outputs learn only to be unlikely; "
                    "give the model's last layer 2 outputs"]
    # A table whose labels are 0/1 and that declares no classes: its labels are private, so the note names the fix.
    (tmp_path / "csv").mkdir()
    table = load_config(newcomer_job(tmp_path / "csv", LINEAR_MODEL.format(features=FEATURES, classes=5),
                                     "five_outputs", label_of=lambda row: row % 2), {})
    said.clear()
    assert dry_run(table, build_checked_model(table), said.append) == 5
    assert said == ["note: the dataset declares no num_classes, so the model's 5 outputs number its classes (labels "
                    "0..4); if its labels have fewer classes (e.g. 0/1), set the dataset's num_classes and give the "
                    "model's last layer one output per class"]
    declared = table.model_copy(update={"dataset": {**table.dataset, "num_classes": 2}})
    said.clear()
    dry_run(declared, build_checked_model(declared), said.append)
    assert said and said[0].startswith("warning: the model gives 5 outputs per example and the data 'toy' has 2")


def test_bce_with_two_outputs_gets_the_hint_of_its_loss(tmp_path, capsys, toy_budget):
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=2), "bce_two",
                          label_of=lambda row: row % 2)
    text = open(config).read().replace('model = "bce_two:build"', 'model = "bce_two:build"\nloss = "bce_with_logits"')
    open(config, "w").write(text)
    err = refused_in_time(config, capsys, "the loss 'bce_with_logits' on the model's output (shape [2, 2])",
                          "bce_with_logits takes one output per label column: 1 output for one 0/1 label column",
                          "the model gives 2 per example")
    assert "one output per class" not in err


DATASET_FUNCTION = """
import torch


class Examples(torch.utils.data.Dataset):
    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return torch.full((2, 5), float(index)), index % 3


def data():
    return Examples(30), Examples(10)
"""


@pytest.mark.parametrize("declared", [True, False])
def test_a_function_dataset_gives_its_declared_schema_or_its_first_test_example(tmp_path, capsys, toy_budget,
                                                                               declared):
    module = DATASET_FUNCTION + ('\ndata.example_schema = {"input_shape": [2, 5], "classes": 3}\n' if declared
                                 else "")
    (tmp_path / f"examples_{declared}.py").write_text(module)  # beside the config, so on the import path
    config = any_data_job(tmp_path, MNIST_MISFIT.format(features=100, classes=3), f"function_misfit_{declared}",
                          f'"examples_{declared}:data"')
    refused_in_time(config, capsys, "input [2, 5] float32", "the data gives 2×5 = 10")


def test_a_model_that_fails_a_plain_pass_is_refused_by_the_engines_never_handed_to_vmap():
    import warnings

    import torch
    from torch import nn

    from workers.engines import ExampleSchema, ModelDoesNotFitData, prepare_engine
    from workers.tasks import build_loss

    schema = ExampleSchema((1, 28, 28), torch.float32, (), torch.int64)
    for engine in ("fast", "vmap"):
        model = nn.Sequential(nn.Flatten(), nn.Linear(100, 10))
        with warnings.catch_warnings(record=True) as caught, pytest.raises(ModelDoesNotFitData, match=(
                r"plain forward pass and loss on synthetic examples of the data's shape \(input \[1, 28, 28\] "
                r"float32\): RuntimeError: mat1 and mat2 shapes cannot be multiplied")):
            warnings.simplefilter("always")
            prepare_engine(engine, model, schema, build_loss("cross_entropy"))
        assert not [warning for warning in caught if "vmap" in str(warning.message)]
    # A model that runs and that the layer rules cannot serve (two linear layers sharing a weight) still runs on
    # the vmap engine.
    first, second = nn.Linear(7, 7), nn.Linear(7, 7)
    second.weight = first.weight
    tied = nn.Sequential(first, nn.Tanh(), second)
    with pytest.warns(UserWarning, match="is tied to several modules.*computing this model's clipped sum with the vmap"):
        prepare_engine("fast", tied, ExampleSchema((7,), torch.float32, (), torch.int64), build_loss("cross_entropy"))
