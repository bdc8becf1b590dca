"""`dpfleet eps` and `dpfleet noise` through the real command line."""

import json
import subprocess
import sys

import pytest

from orchestrator.cli import main

SEED_RUN = ["--dataset-size", "60000", "--batch-size", "250", "--delta", "1e-5"]


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_eps_all_json_prints_the_reference_figures(capsys):
    status, out, _ = run(capsys, "eps", *SEED_RUN, "--noise-multiplier", "1.3", "--epochs", "15",
                         "--accountant", "all", "--json")
    assert status == 0
    rows = {row["accountant"]: row for row in json.loads(out)}
    assert rows["pld"]["epsilon"] == pytest.approx(0.853, abs=0.002)
    assert rows["rdp"]["epsilon"] == pytest.approx(0.9422, abs=5e-5)
    assert rows["gdp"]["epsilon"] == pytest.approx(0.8237, abs=5e-5)
    assert rows["gdp"]["rigorous"] is False and rows["pld"]["rigorous"] is True
    for row in rows.values():
        assert set(row) == {"accountant", "epsilon", "delta", "steps", "sampling_rate", "noise_multiplier", "rigorous"}
        assert row["steps"] == 3600 and row["sampling_rate"] == 250 / 60000


def test_eps_table_labels_gdp_approximate(capsys):
    status, out, _ = run(capsys, "eps", *SEED_RUN, "--noise-multiplier", "1.3", "--steps", "720",
                         "--accountant", "all")
    assert status == 0
    assert "gdp (approximate)" in out and "0.5632" in out


def test_noise_meets_target(capsys):
    status, out, _ = run(capsys, "noise", *SEED_RUN, "--target-epsilon", "1.0", "--epochs", "15",
                         "--accountant", "rdp", "--json")
    assert status == 0
    row = json.loads(out)
    assert row["epsilon"] <= 1.0 and row["noise_multiplier"] == pytest.approx(1.254, abs=0.002)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--noise-multiplier", "0", "--epochs", "1"], "--noise-multiplier must be > 0"),
        (["--noise-multiplier", "-1.3", "--epochs", "1"], "--noise-multiplier must be > 0"),
        (["--noise-multiplier", "nan", "--epochs", "1"], "--noise-multiplier must be a finite number"),
        (["--noise-multiplier", "inf", "--epochs", "1"], "--noise-multiplier must be a finite number"),
        (["--noise-multiplier", "1", "--epochs", "-1"], "--epochs must be > 0"),
        (["--noise-multiplier", "1", "--steps", "-5"], "--steps must be an integer >= 1"),
        (["--noise-multiplier", "1", "--epochs", "1", "--accountant", "moments"], "--accountant must be one of"),
    ],
)
def test_eps_bad_input_exits_2_with_one_line(capsys, argv, message):
    status, out, err = run(capsys, "eps", *SEED_RUN, *argv)
    assert status == 2
    assert message in err and err.count("\n") == 1 and out == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset-size", "100", "--batch-size", "250", "--delta", "1e-5"], "must not exceed the dataset size"),
        (["--dataset-size", "100", "--batch-size", "10", "--delta", "1"], "--delta must be in (0, 1)"),
        (["--dataset-size", "100", "--batch-size", "10", "--delta", "0"], "--delta must be in (0, 1)"),
        (["--dataset-size", "100", "--batch-size", "0", "--delta", "1e-5"], "--batch-size must be an integer >= 1"),
    ],
)
def test_run_shape_bad_input(capsys, argv, message):
    status, _, err = run(capsys, "eps", *argv, "--noise-multiplier", "1", "--epochs", "1")
    assert status == 2 and message in err


def test_unreachable_target_is_a_usage_error(capsys):
    status, _, err = run(capsys, "noise", "--dataset-size", "100", "--batch-size", "100", "--delta", "1e-5",
                         "--steps", "100000", "--target-epsilon", "1e-7", "--accountant", "gdp")
    assert status == 2 and "--target-epsilon" in err


def test_console_script_has_no_traceback_on_bad_input():
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "eps", *SEED_RUN, "--noise-multiplier", "nan", "--epochs", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "--noise-multiplier" in result.stderr


def test_missing_flag_is_one_line_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "eps", "--dataset-size", "10"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "required" in result.stderr
