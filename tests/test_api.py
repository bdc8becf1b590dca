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
