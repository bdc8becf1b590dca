"""The commands that answer at once load no torch, torchvision or Ray: checked in fresh processes, by `sys.modules`.

Each process runs a list of commands through `orchestrator.cli.main`, as the
`dpfleet` script does, and after each one writes down which of the watched
packages are loaded; a package loaded by one command stays loaded for the
next, so the first command that names one is the culprit. The help, the
version and a ledger client load no dp-accounting or scipy either: they have
no epsilon to compute. `dpfleet ledger fits` plans a training job as
`dpfleet train` does: its planning, the sizes and user counts it reads from
the data's metadata and the config's check, whose model, engine, loss and
metrics names are the workers' registries' torch-free lists
(``workers.names``), load no torch either.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from accounting.ledger.store import open_embedded_ledger
from orchestrator.cli import build_parser, reference
from orchestrator.cli.data_parser import BUILTIN_DATASETS
from servers import REPOSITORY, start_serve_process
from workers.data import DATASETS

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
HEAVY = ("torch", "torchvision", "ray")
ACCOUNTING_LIBRARIES = ("dp_accounting", "scipy")
# Loaded by the workers' evaluation only: seconds of its own (its image metrics load torchvision's models).
METRICS_LIBRARY = ("torchmetrics",)
# Runs the commands given after the report's path, separated by "::"; writes one report entry per command.
DRIVER = f"""
import json, sys
from orchestrator.cli import main

commands, report = [[]], []
for word in sys.argv[2:]:
    if word == "::":
        commands.append([])
    else:
        commands[-1].append(word)
for argv in commands:
    try:
        status = main(argv)
    except SystemExit as exited:
        status = exited.code
    loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY + ACCOUNTING_LIBRARIES +
                                                                         METRICS_LIBRARY!r}))
    report.append({{"argv": argv, "status": status, "loaded": loaded}})
with open(sys.argv[1], "w") as handle:
    json.dump(report, handle)
"""
RUN_SHAPE = ["--dataset-size", "10000", "--batch-size", "100", "--steps", "10", "--delta", "1e-5"]


def driver(report: Path) -> list[str]:
    """The command line of a driver process that writes its report to ``report``."""
    return [sys.executable, "-c", DRIVER, str(report)]


def run_commands(tmp_path: Path, commands: list[list[str]], **environment: str) -> list[dict]:
    """Run ``commands`` in one fresh driver process; its report, one entry per command."""
    report = tmp_path / "report.json"
    words = [word for command in commands for word in ["::", *command]][1:]
    completed = subprocess.run(
        [*driver(report), *words], cwd=REPOSITORY, capture_output=True, text=True, timeout=300,
        env={**{key: value for key, value in os.environ.items() if not key.startswith("DPFLEET_")}, **environment},
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(report.read_text())


def help_commands() -> list[list[str]]:
    """`--help` of the top level, of `data` and its commands, and of `ledger` and every command under it."""
    words = [path for path, _, _ in reference._commands(build_parser()) if path[0] in ("ledger", "data")]
    return [["--help"], *[[*path, "--help"] for path in words]]


def assert_light(report: list[dict], statuses: dict[str, int], forbidden: tuple[str, ...] = HEAVY) -> None:
    """Every command exited as expected (0 unless ``statuses`` says otherwise) and loaded none of ``forbidden``."""
    for entry in report:
        command = " ".join(entry["argv"])
        assert entry["status"] == statuses.get(command, 0), command
        loaded = sorted(set(entry["loaded"]) & set(forbidden))
        assert loaded == [], f"dpfleet {command} loaded {', '.join(loaded)}"


def test_the_parser_names_every_built_in_dataset():
    assert sorted(BUILTIN_DATASETS) == sorted(DATASETS)


def test_help_version_accounting_init_and_the_embedded_ledger_load_no_torch_or_ray(tmp_path):
    db = tmp_path / "home" / "ledger.db"
    commands = [
        *help_commands(),
        ["--version"],
        ["eps", "--noise-multiplier", "1.0", "--accountant", "all", *RUN_SHAPE],
        ["eps", "--noise-multiplier", "1.0", "--microbatch-size", "4", *RUN_SHAPE],
        ["noise", "--target-epsilon", "2", *RUN_SHAPE],
        ["init", str(tmp_path / "starter.toml")],
        ["config", "schema"],
        ["ledger", "tenant", "create", "acme"],
        ["ledger", "dataset", "create", "mnist", "--epsilon", "2", "--delta", "1e-5", "--scheduling", "dpf"],
        ["ledger", "dataset", "raise", "mnist", "--epsilon", "3"],
        ["ledger", "block", "add", "mnist", "day-1", "--epsilon", "1", "--rows", "0:100"],
        ["ledger", "quota", "set", "local/mnist", "acme", "--epsilon", "1"],
        ["ledger", "status"],
        ["ledger", "history", "--json"],
        ["ledger", "jobs"],
        ["ledger", "jobs", "--queued"],
        ["ledger", "release", "no-such-reservation"],
        ["ledger", "cancel", "no-such-job"],
        ["ledger", "verify", "--db", str(db)],
    ]
    report = run_commands(tmp_path, commands, DPFLEET_HOME=str(db.parent))
    assert [entry["argv"] for entry in report] == commands
    answered_at_once = len(help_commands()) + 1
    assert_light(report[:answered_at_once], {}, HEAVY + ACCOUNTING_LIBRARIES)
    assert_light(report, {"ledger release no-such-reservation": 2, "ledger cancel no-such-job": 2})
    assert (tmp_path / "starter.toml").is_file()


def test_a_training_config_s_mistakes_are_refused_before_torch_or_ray_load(tmp_path):
    """A misspelt key, a value out of range and a value of the wrong type: each exits 2 with torch and Ray unloaded."""
    good = 'model = "gdp_cnn"\ndataset = "mnist"\nbatch_size = 250\nsteps = 200\nnoise_multiplier = 1.1\n'
    mistakes = {"misspelt.toml": good.replace("steps", "stepz"), "range.toml": good.replace("250", "0"),
                "type.toml": good + 'workers = "two"\n'}
    commands = []
    for name, text in mistakes.items():
        (tmp_path / name).write_text(text)
        commands.append(["train", "--config", str(tmp_path / name)])
    report = run_commands(tmp_path, commands, DPFLEET_HOME=str(tmp_path / "home"))
    assert_light(report, {" ".join(command): 2 for command in commands})


def test_a_model_that_does_not_fit_the_data_is_refused_by_the_dry_run_before_ray_loads(tmp_path):
    """`dpfleet train` checks the model on made-up MNIST examples before it imports the trainer: the refusal
    (exit 2) loads torch only, no Ray, torchvision, torchmetrics or accountant, and never asks the ledger."""
    (tmp_path / "misfit_model.py").write_text("from torch import nn\n\n\ndef build():\n"
                                              "    return nn.Sequential(nn.Flatten(), nn.Linear(100, 10))\n")
    config = tmp_path / "misfit.toml"
    config.write_text('model = "misfit_model:build"\ndataset = "mnist"\nbatch_size = 10\nsteps = 2\n'
                      f'noise_multiplier = 1.0\ndata_root = "{tmp_path / "no-data"}"\n'
                      f'run_dir = "{tmp_path / "run"}"\n')
    command = ["train", "--config", str(config)]
    report = run_commands(tmp_path, [command], DPFLEET_HOME=str(tmp_path / "home"))
    assert_light(report, {" ".join(command): 2}, ("ray", "torchvision") + METRICS_LIBRARY + ACCOUNTING_LIBRARIES)
    assert "torch" in report[0]["loaded"]
    assert not (tmp_path / "home").exists() and not (tmp_path / "no-data").exists()


def test_a_job_its_budget_cannot_admit_is_refused_before_ray_loads(tmp_path):
    """`dpfleet train` asks the ledger whether the plan fits before it imports the trainer: a job too dear for its
    dataset's budget is refused (exit 3) in the reservation's words, without Ray, and nothing is reserved."""
    config = tmp_path / "dear.toml"
    config.write_text('dataset = "mnist"\nbatch_size = 250\nsteps = 200\nnoise_multiplier = 0.8\n'
                      f'dataset_budget_epsilon = 1.0\ndata_root = "{tmp_path / "no-data"}"\n'
                      f'run_dir = "{tmp_path / "run"}"\n')
    command = ["train", "--config", str(config)]
    report_path = tmp_path / "report.json"
    completed = subprocess.run([*driver(report_path), *command], cwd=REPOSITORY, capture_output=True, text=True,
                               timeout=300, env={**os.environ, "DPFLEET_HOME": str(tmp_path / "home")})
    assert_light(json.loads(report_path.read_text()), {" ".join(command): 3},
                 ("ray", "torchvision") + METRICS_LIBRARY)
    assert "the ledger refused to start the job: dataset 'mnist' has ε 1" in completed.stderr
    with open_embedded_ledger(tmp_path / "home" / "ledger.db") as ledger:
        status = ledger.get_budget("mnist")
    assert status.jobs == () and status.spent_epsilon_filter == 0.0 and status.reserved_epsilon == 0.0


def test_the_ledger_server_and_its_clients_load_no_torch_or_ray(tmp_path):
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN)
    serve_report = tmp_path / "serve" / "report.json"
    serve_report.parent.mkdir()
    process, address = start_serve_process(tmp_path / "served.db", token_file, dpfleet=driver(serve_report))
    try:
        remote = ["--ledger", address, "--token", ADMIN_TOKEN]
        report = run_commands(tmp_path, [
            ["ledger", "tenant", "create", "acme", *remote],
            ["ledger", "dataset", "create", "acme/mnist", "--epsilon", "2", "--delta", "1e-5", *remote],
            ["ledger", "status", "--json", *remote],
            ["ledger", "history", *remote],
            ["ledger", "jobs", *remote],
        ])
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    assert_light(report, {}, HEAVY + ACCOUNTING_LIBRARIES)
    (served,) = json.loads(serve_report.read_text())
    assert served["argv"][:2] == ["ledger", "serve"]
    assert_light([served], {})


# Reads the sizes and user counts a plan needs, by the driver's code paths, then reports the loaded packages.
PLANNING_READS = f"""
import json, sys
import orchestrator.cli.ledger_fits, orchestrator.ledger_session, orchestrator.planning
from workers import sources, users

table = {{"format": "parquet", "train": sys.argv[1] + "/train.parquet", "test": sys.argv[1] + "/test.parquet",
         "shape": [4], "features": "features"}}
index = users.user_index(users.UserSpec("user", None), table, sources.source_size(table, "train"))
sizes = [sources.source_size("mnist", "train"), sources.source_size(table, "test"), index.user_count]
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r}))
print(json.dumps({{"sizes": sizes, "loaded": loaded}}))
"""


def test_planning_and_the_data_sizes_and_user_counts_it_reads_load_no_torch_or_ray(tmp_path):
    """A built-in's known size, a Parquet split's row count and its user ids are read without torch or Ray."""
    write_parquet_splits(tmp_path)
    completed = subprocess.run([sys.executable, "-c", PLANNING_READS, str(tmp_path)], cwd=REPOSITORY,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == {"sizes": [60000, 50, 40], "loaded": []}


def write_parquet_splits(directory: Path) -> None:
    """A small Parquet dataset, train (400 rows) and test (50 rows): 4 features, a binary label, 40 users."""
    for split, rows in (("train", 400), ("test", 50)):
        pq.write_table(pa.table({"features": np.full((rows, 4), 0.5, dtype=np.float32).tolist(),
                                 "label": np.arange(rows) % 2, "user": np.arange(rows) % 40}),
                       directory / f"{split}.parquet")


def test_ledger_fits_checks_and_plans_an_mnist_and_a_parquet_config_without_torch_or_ray(tmp_path):
    """`ledger fits` loads the config (its model, engine, loss and metrics names checked) and plans it, light."""
    write_parquet_splits(tmp_path)
    mnist = tmp_path / "mnist.toml"
    mnist.write_text('model = "gdp_cnn"\ndataset = "mnist"\nbatch_size = 250\nsteps = 200\nnoise_multiplier = 1.1\n'
                     'engine = "vmap"\nloss = "cross_entropy"\nmetrics = ["accuracy", "auroc"]\n')
    table = tmp_path / "table.toml"
    table.write_text('model = "lenet5"\nbatch_size = 20\nsteps = 10\nnoise_multiplier = 1.0\nloss = "mse"\n'
                     f'[dataset]\nformat = "parquet"\ntrain = "{tmp_path}/train.parquet"\n'
                     f'test = "{tmp_path}/test.parquet"\nfeatures = "features"\nshape = [4]\nname = "table"\n')
    commands = [
        ["ledger", "dataset", "create", "mnist", "--epsilon", "10", "--delta", "1e-5"],
        ["ledger", "fits", "--config", str(mnist)],
        ["ledger", "dataset", "create", "table", "--epsilon", "10", "--delta", "1e-5"],
        ["ledger", "fits", "--config", str(table), "--json"],
    ]
    report = run_commands(tmp_path, commands, DPFLEET_HOME=str(tmp_path / "home"))
    assert [entry["argv"] for entry in report] == commands
    assert_light(report, {})
