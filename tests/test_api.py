"""`import dpfleet`: the Python API trains through the same ledger path as the CLI and returns what it released."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.cli import main
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


def test_predict_on_a_file_without_the_models_columns_is_one_paragraph(tmp_path, capsys):
    export = tmp_path / "absent.safetensors"
    assert main(["predict", str(export), "--data", str(tmp_path / "x.csv"), "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "neither a run directory nor an exported" in err, err
