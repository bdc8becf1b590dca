"""What users expect of a command line: --version, help that lists the config keys, init, NO_COLOR, quiet pipes."""

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import __version__, release
from orchestrator.cli import build_parser, main, quiet_ray_start
from orchestrator.cli.display import plain_when_asked, show_progress
from orchestrator.cli.init import STARTER
from orchestrator.cli.train import check_run_dir_free
from orchestrator.config import GROUPS, TrainConfig, documented_keys, load_config, replaced, toml_literal
from orchestrator.planning import plan_run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"dpfleet {__version__}\n"
    assert 'version = {attr = "orchestrator.__version__"}' in (ROOT / "pyproject.toml").read_text()


def test_every_config_key_is_documented_in_a_known_group():
    keys = documented_keys()
    for key in keys:
        assert key.group in GROUPS, key.name
        assert key.meaning and key.valid and key.kind, key.name
    assert sorted(key.name for key in keys) == sorted(TrainConfig.model_fields)
    assert [GROUPS.index(key.group) for key in keys] == sorted(GROUPS.index(key.group) for key in keys)


def test_a_default_written_as_toml_reads_back_as_the_default():
    literals = {key.name: key.literal for key in documented_keys() if key.literal is not None}
    assert {"batch_size", "delta", "engine", "secure_noise", "shard_timeout"} <= set(literals)
    parsed = tomllib.loads("\n".join(f"{name} = {literal}" for name, literal in literals.items()))
    defaults = {name: field.default for name, field in TrainConfig.model_fields.items()}
    assert parsed == {name: defaults[name] for name in literals}
    assert toml_literal(1e-5) == "1e-05" and toml_literal("a\"b") == '"a\\"b"'


def test_train_help_lists_every_config_key_under_its_group(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    epilog = help_text[help_text.index("config keys (TOML), by group"):]
    positions = [epilog.index(f"\n{group}:\n") for group in GROUPS]
    assert positions == sorted(positions)
    for key in documented_keys():
        start = positions[GROUPS.index(key.group)]
        end = positions[GROUPS.index(key.group) + 1] if key.group != GROUPS[-1] else len(epilog)
        assert f"\n  {key.name} " in epilog[start:end], key.name


def test_init_writes_the_main_job_with_every_key_commented(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    assert "wrote dpfleet.toml" in capsys.readouterr().out
    text = (tmp_path / "dpfleet.toml").read_text()
    assert tomllib.loads(text) == STARTER
    for key in documented_keys():
        assert f"# {key.name}: " in text, key.name
    starter = load_config("dpfleet.toml", {})
    main_job = load_config(str(ROOT / "examples" / "mnist.toml"), {})
    assert replaced(starter, run_dir=main_job.run_dir) == main_job
    assert plan_run(starter).steps == 3600


def test_init_does_not_replace_a_file_unless_forced(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text("epochs = 1\n")
    assert main(["init", str(path)]) == 2
    assert "exists" in capsys.readouterr().err and path.read_text() == "epochs = 1\n"
    assert main(["init", str(path), "--force"]) == 0
    assert tomllib.loads(path.read_text()) == STARTER


def test_train_refuses_a_finished_run_dir_unless_told_to_overwrite_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text('{"epsilon": 1.0}')
    config = tmp_path / "job.toml"
    config.write_text(f'steps = 5\nnoise_multiplier = 1.0\nrun_dir = "{run_dir}"\n')
    assert main(["train", "--config", str(config), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"dpfleet train: error: run_dir {str(run_dir)!r} holds a finished run (its summary.json), which this run "
        "would overwrite; give another --run-dir, or add --overwrite to replace it (dpfleet.train: overwrite=True)\n")
    assert (run_dir / "summary.json").read_text() == '{"epsilon": 1.0}'
    check_run_dir_free(str(run_dir), overwrite=True)
    check_run_dir_free(str(tmp_path / "new"), overwrite=False)


def test_rays_start_up_lines_show_only_with_verbose():
    started = logging.LogRecord("ray._private.worker", logging.INFO, "worker.py", 1, "Started a local Ray instance.",
                                None, None)
    token = logging.LogRecord("ray._private.authentication.authentication_token_setup", logging.INFO, "x.py", 1,
                              "Token authentication is disabled.", None, None)
    other = logging.LogRecord("ray._private.worker", logging.WARNING, "worker.py", 1, "a worker died", None, None)
    try:
        for verbose in (False, True, False):
            quiet_ray_start(verbose)
            shown = [logging.getLogger(record.name).filter(record) for record in (started, token, other)]
            assert [bool(each) for each in shown] == [verbose, verbose, True]
    finally:
        quiet_ray_start(True)
    assert "--verbose" in build_parser(("train",)).format_help()


@pytest.mark.parametrize("environ, stream, plain", [
    ({}, Terminal(), False),
    ({"NO_COLOR": "1"}, Terminal(), True),
    ({"NO_COLOR": ""}, Terminal(), False),
    ({}, io.StringIO(), True),
    ({"RAY_COLOR_PREFIX": "1"}, io.StringIO(), False),
])
def test_no_color_and_pipes_turn_off_rays_coloured_log_prefixes(environ, stream, plain):
    plain_when_asked(environ, stream)
    assert (environ.get("RAY_COLOR_PREFIX") == "0") == plain


def test_progress_bars_only_on_a_terminal_and_not_when_hidden():
    assert show_progress(False, Terminal())
    assert not show_progress(True, Terminal())
    assert not show_progress(False, io.StringIO())


def test_a_piped_training_prints_one_line_per_epoch_and_no_carriage_returns(tmp_path):
    """`make train 2>&1 | cat`: without a terminal, no progress bar redraws; each epoch is one line."""
    config = tmp_path / "tiny.toml"
    config.write_text(
        'dataset = "mnist"\nmodel = "gdp_cnn"\nworkers = 1\nepochs = 3\nbatch_size = 20\ntrain_subset = 100\n'
        f'test_subset = 100\nnoise_multiplier = 2.0\nseed = 3\nrun_dir = "{tmp_path / "run"}"\n'
    )
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "DPFLEET_HOME": str(tmp_path / "home")}
    environ.pop("NO_COLOR", None)
    finished = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", "--config", str(config)],
        cwd=tmp_path, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    output = finished.stdout
    assert finished.returncode == 0, output[-3000:]
    assert "\r" not in output and "\x1b[" not in output
    # Every line, Ray's and the workers' included, is one that orchestrator/release.py declares.
    assert release.undeclared_lines(output) == []
    lines = output.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("epoch ")] == ["epoch 1", "epoch 2", "epoch 3"]
    summary = lines.index(next(line for line in lines if line.startswith("summary ")))
    assert summary <= 20, "\n".join(lines[:summary])


def test_a_reader_that_stops_early_ends_the_command_quietly_as_sigpipe_would(tmp_path):
    # `dpfleet ... | head -c 0`: the reader is gone before the first line; no error paragraph, status 141.
    command = [sys.executable, "-m", "orchestrator.cli", "eps", "--noise-multiplier", "1.0", "--dataset-size",
               "60000", "--batch-size", "256", "--steps", "100", "--delta", "1e-5", "--accountant", "rdp"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "DPFLEET_HOME": str(tmp_path / "home")}
    reader, writer = os.pipe()
    os.close(reader)
    with subprocess.Popen(command, cwd=tmp_path, env=environ, stdout=writer, stderr=subprocess.PIPE,
                          text=True) as started:
        os.close(writer)
        _, err = started.communicate(timeout=120)
    assert started.returncode == 141 and err == "", err


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch, capsys):
    # A closed socket (a ledger, a worker) is not a reader that left: it is reported.
    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("orchestrator.cli.privacy.run_eps", broken)
    assert main(["eps", "--noise-multiplier", "1", "--dataset-size", "10", "--batch-size", "2", "--steps", "1",
                 "--delta", "1e-5"]) == 1
    assert "error: BrokenPipeError: [Errno 32] Broken pipe" in capsys.readouterr().err
