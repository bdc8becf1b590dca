"""`import dpfleet`: the Python API trains through the same ledger path as the CLI and returns what it released."""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.cli import main
from orchestrator.errors import UsageError
from orchestrator.export import card_path
from test_dry_run import CLASSES, DATASET, FEATURES, LINEAR_MODEL, newcomer_job

ROOT = Path(__file__).resolve().parents[1]


def import_dpfleet():
    """`dpfleet` as the installed distribution maps it (orchestrator/dpfleet/), also before this tree is installed."""
    try:
        import dpfleet
    except ModuleNotFoundError:
        location = ROOT / "orchestrator" / "dpfleet" / "__init__.py"
        spec = importlib.util.spec_from_file_location("dpfleet", location, submodule_search_locations=[
            str(location.parent)])
        dpfleet = importlib.util.module_from_spec(spec)
        sys.modules["dpfleet"] = dpfleet
        spec.loader.exec_module(dpfleet)
    return dpfleet


def test_the_distribution_installs_the_api_as_the_package_dpfleet():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'where = [".", "orchestrator"]' in text and '"dpfleet"' in text and 'exclude = ["orchestrator.dpfleet"]' in text
    dpfleet = import_dpfleet()
    assert sorted(dpfleet.__all__) == ["Ledger", "Result", "epsilon", "load", "noise_multiplier", "train"]


def test_epsilon_and_noise_multiplier_are_the_clis(capsys):
    dpfleet = import_dpfleet()
    assert main(["eps", "--dataset-size", "600", "--batch-size", "30", "--noise-multiplier", "1.0", "--steps", "25",
                 "--delta", "1e-5", "--json"]) == 0
    assert dpfleet.epsilon(1.0, 600, 30, steps=25, delta=1e-5) == pytest.approx(json.loads(capsys.readouterr().out)["epsilon"])
    sigma = dpfleet.noise_multiplier(2.0, 600, 30, epochs=2, delta=1e-5)
    assert dpfleet.epsilon(sigma, 600, 30, epochs=2, delta=1e-5) <= 2.0 < dpfleet.epsilon(sigma * 0.99, 600, 30, epochs=2,
                                                                                        delta=1e-5)
    with pytest.raises(ValueError, match="exactly one of steps and epochs"):
        dpfleet.epsilon(1.0, 600, 30, delta=1e-5)


def test_train_charges_the_ledger_and_returns_the_exported_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    dpfleet = import_dpfleet()
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "api_model")
    result = dpfleet.train(config, steps=3, seed=1)
    with dpfleet.Ledger() as ledger:
        budget = ledger.get_budget(DATASET)
        (job,) = ledger.list_jobs()
    assert job.state == "released" and job.committed_steps == 3 and budget.reserved_epsilon == 0
    assert result.epsilon == pytest.approx(budget.spent_epsilon, rel=1e-9) and result.delta == 1e-5
    assert result.run_dir == tmp_path / "run" and set(result.metrics) >= {"accuracy", "loss"}
    model = dpfleet.load(result.export_path)
    assert model(torch.zeros(4, FEATURES)).shape == (4, CLASSES)


def test_predict_writes_the_released_models_predictions_from_a_run_or_its_export(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    dpfleet = import_dpfleet()
    config = newcomer_job(tmp_path, LINEAR_MODEL.format(features=FEATURES, classes=CLASSES), "predict_model")
    result = dpfleet.train(config, steps=2, seed=2)
    model = dpfleet.load(result.export_path)
    # The examples to predict on: the columns in another order, with the label column left out.
    rows = torch.rand(5, FEATURES)
    columns = [f"x{index}" for index in range(FEATURES)]
    data = tmp_path / "new.csv"
    data.write_text(",".join(reversed(columns)) + "\n" + "".join(
        ",".join(repr(value) for value in reversed(row.tolist())) + "\n" for row in rows))
    with torch.no_grad():
        expected = model(rows)
    for source in (result.export_path, result.run_dir):
        out = tmp_path / f"predictions-{Path(source).name}.csv"
        assert main(["predict", str(source), "--data", str(data), "--out", str(out)]) == 0
        assert f"wrote 5 predictions to {out}" in capsys.readouterr().out
        header, *lines = out.read_text().splitlines()
        assert header == "prediction," + ",".join(f"output_{index}" for index in range(CLASSES))
        written = torch.tensor([[float(value) for value in line.split(",")] for line in lines])
        torch.testing.assert_close(written[:, 1:], expected)
        assert written[:, 0].long().tolist() == expected.argmax(dim=1).tolist()
    # From another folder, with the model's module off the import path: exit status 2, naming the folder the run
    # imported it from, which its checkpoint and the export's card record.
    trained_in = os.path.realpath(tmp_path)
    assert json.loads(card_path(result.export_path).read_text())["model"]["module_folder"] == trained_in
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if os.path.realpath(entry or ".") != trained_in])
    monkeypatch.delitem(sys.modules, "predict_model")
    for source in (result.export_path, result.run_dir):
        assert main(["predict", str(source), "--data", str(data), "--out", str(tmp_path / "p.csv")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"the run imported it from {trained_in}: run from that folder, or set PYTHONPATH={trained_in}" in err
        with pytest.raises(UsageError, match=f"the run imported it from {re.escape(trained_in)}"):
            dpfleet.load(source)


def test_predict_on_a_file_without_the_models_columns_is_one_paragraph(tmp_path, capsys):
    export = tmp_path / "absent.safetensors"
    assert main(["predict", str(export), "--data", str(tmp_path / "x.csv"), "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "neither a run directory nor an exported" in err, err


def hand_export(tmp_path, module_name, recorded=True):
    """An export of a 3-feature, 2-class linear model from the module ``module_name`` in tmp_path/src: its weights
    and its card, written as `dpfleet export` writes them (no training run needed); without ``recorded``, as a card
    written before the folder the module was imported from was recorded."""
    from safetensors.torch import save_file

    source = tmp_path / "src"
    source.mkdir()
    (source / f"{module_name}.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(3, 2)\n")
    model = torch.nn.Linear(3, 2)
    export = tmp_path / "model.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(export))
    description = {
        "spec": f"{module_name}:make", "builtin": False, "input_columns": ["a", "b", "c"], "input_shape": [3],
        "input_dtype": "float32", "output_shape": [2], "task": "multiclass", "loss": "cross_entropy", "classes": 2}
    if recorded:
        description["module_folder"] = os.path.realpath(source)
    (tmp_path / "model.model-card.json").write_text(json.dumps({"model": description}))
    return source, export, model


def predict_refused(export, tmp_path, capsys):
    """`dpfleet predict` on ``export``: exit status 2 and one line on stderr, which it returns."""
    assert main(["predict", str(export), "--data", str(tmp_path / "x.csv"), "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_predict_from_another_folder_names_the_folders_searched_and_the_runs_folder(tmp_path, monkeypatch, capsys):
    source, export, _ = hand_export(tmp_path, "predict_elsewhere_model")
    trained_in = os.path.realpath(source)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    dpfleet = import_dpfleet()
    with pytest.raises(UsageError) as raised:
        dpfleet.load(export)
    message = str(raised.value)
    assert "module 'predict_elsewhere_model' cannot be imported" in message
    assert f"the current folder is {elsewhere.resolve()}" in message and "predict_elsewhere_model.py in " in message
    assert f"the run imported it from {trained_in}: run from that folder, or set PYTHONPATH={trained_in}" in message
    err = predict_refused(export, tmp_path, capsys)
    assert str(elsewhere.resolve()) in err and f"PYTHONPATH={trained_in}" in err, err
    monkeypatch.syspath_prepend(str(source))  # the fix the message names
    assert dpfleet.load(export)(torch.zeros(1, 3)).shape == (1, 2)


def test_a_card_without_the_runs_folder_names_the_folders_searched_and_a_gone_module_its_folder(
        tmp_path, monkeypatch, capsys):
    source, export, _ = hand_export(tmp_path, "predict_unrecorded_model", recorded=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    err = predict_refused(export, tmp_path, capsys)
    assert "run from the folder that holds predict_unrecorded_model.py, or set PYTHONPATH to that folder" in err
    assert "the run imported it" not in err
    # The run's folder is on the import path, but the module is no longer in it.
    gone = tmp_path / "gone"
    gone.mkdir()
    source, export, _ = hand_export(gone, "predict_gone_model")
    (source / "predict_gone_model.py").unlink()
    monkeypatch.syspath_prepend(str(source))
    err = predict_refused(export, tmp_path, capsys)
    assert (f"the run imported it from {os.path.realpath(source)}, which holds no predict_gone_model.py now: put it "
            "back there") in err, err


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_predict_passes_a_tables_id_column_through_first(tmp_path, monkeypatch, suffix):
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    source, export, model = hand_export(tmp_path, f"predict_id_model_{suffix[1:]}")
    monkeypatch.syspath_prepend(str(source))
    rows = torch.rand(4, 3)
    ids = ["007", "b", "x9", "010"] if suffix == ".csv" else [7, 3, 11, 5]
    table = pa.table({"c": rows[:, 2].tolist(), "id": ids, "a": rows[:, 0].tolist(), "b": rows[:, 1].tolist()})
    data = tmp_path / f"new{suffix}"
    pa_csv.write_csv(table, str(data)) if suffix == ".csv" else pq.write_table(table, str(data))
    out = tmp_path / "predictions.csv"
    assert main(["predict", str(export), "--data", str(data), "--out", str(out)]) == 0
    header, *lines = out.read_text().splitlines()
    assert header == "id,prediction,output_0,output_1"
    assert [line.split(",")[0] for line in lines] == [str(value) for value in ids]
    with torch.no_grad():
        expected = model(rows)
    torch.testing.assert_close(torch.tensor([[float(v) for v in line.split(",")[2:]] for line in lines]), expected)
    without = tmp_path / f"without{suffix}"
    table = table.drop_columns(["id"])
    pa_csv.write_csv(table, str(without)) if suffix == ".csv" else pq.write_table(table, str(without))
    assert main(["predict", str(export), "--data", str(without), "--out", str(out)]) == 0
    assert out.read_text().splitlines()[0] == "prediction,output_0,output_1"
