"""The one door out (orchestrator/release.py): every mode's every output is declared, and nothing undeclared leaves.

One in-process run of each mode (driver path, collective, silos, secure
aggregation, planned batches, correlated noise, user level, audit) is
observed at the boundary: every log line it printed must match a declared
template, every key of every file it wrote must be declared for that file and
not run-private. The test prints what each mode released, by name. A static
check keeps prints from going around the door, and an attacker reads
consecutive checkpoints and the summary for anything that tracks the realised
batch sizes.
"""

import ast
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from orchestrator import release
from orchestrator.audit import MIN_CANARIES, run_audit
from orchestrator.checkpoint import read_checkpoint
from orchestrator.config import build_config, documented_keys
from orchestrator.fleet import gradient_worker
from orchestrator.trainer import Trainer
from workers.sources import open_source

ROOT = Path(__file__).resolve().parent.parent
# The modules a run's outputs come from; orchestrator/cli/ prints through them, and its other commands are not runs.
RUN_MODULES = [path for path in (ROOT / "orchestrator").glob("*.py") if path.name != "release.py"] + [
    ROOT / "orchestrator" / "cli" / "train.py"]


def tiny(tmp_path, name, **overrides):
    values = dict(dataset="mnist", model="bench.mlp:mlp_tiny", workers=1, steps=2, batch_size=40, train_subset=400,
                  test_subset=50, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.05,
                  run_dir=str(tmp_path / name), max_physical_batch=64)
    values.update(overrides)
    return build_config({key: value for key, value in values.items() if value is not None})


def parquet_spec(tmp_path):
    images, labels = open_source("mnist", "train").read(np.arange(400))
    folder = tmp_path / "parquet"
    folder.mkdir(exist_ok=True)
    element = pa.field("element", pa.float32(), nullable=False)
    pq.write_table(pa.table({"features": pa.FixedSizeListArray.from_arrays(
        pa.array(images.reshape(400, -1).numpy().ravel()), type=pa.list_(element, 784)), "label": labels.numpy()}),
        folder / "part-0.parquet")
    return {"format": "parquet", "train": str(folder), "test": str(folder), "features": "features",
            "shape": [1, 28, 28]}


SILOS = [{"dataset": "mnist", "part": part, "parts": 150} for part in range(2)]
# The driver path runs in the attacker's test below, with a checkpoint a step.
MODES = {
    "collective": lambda tmp_path: dict(workers=2, aggregation="collective"),
    "silos": lambda tmp_path: dict(shards=SILOS, train_subset=None, workers=None),
    "secure aggregation": lambda tmp_path: dict(shards=SILOS, train_subset=None, workers=None,
                                                secure_aggregation=True, mask_share_threshold=2),
    # Planned batches without the key: a Parquet table at example level takes them by default.
    "planned batches": lambda tmp_path: dict(dataset=parquet_spec(tmp_path), train_subset=None, test_subset=None),
    "correlated noise": lambda tmp_path: dict(mechanism="band-mf", sampler="cyclic-poisson", band_width=2),
    # On Parquet, whose rows it reads one by one: the log says why.
    "user level": lambda tmp_path: dict(dataset=parquet_spec(tmp_path), train_subset=None, test_subset=None,
                                        privacy_unit="user", synthetic_users=40, batch_size=8),
}


def written_keys(run_dir: Path) -> dict[str, set[str]]:
    """Every key of every file a run wrote, by the artifact it is declared under."""
    keys: dict[str, set[str]] = {}
    for path in run_dir.iterdir():
        if path.name in ("config.json", "summary.json", "audit.json"):
            keys.setdefault(path.name, set()).update(json.loads(path.read_text()))
        elif path.name == "metrics.jsonl":
            for row in path.read_text().splitlines():
                keys.setdefault(path.name, set()).update(json.loads(row))
        elif path.suffix == ".pt":
            keys.setdefault("checkpoint", set()).update(read_checkpoint(path))
    return keys


def assert_declared(run_dir: Path, log: str, mode: str) -> None:
    assert release.undeclared_lines(log) == [], mode
    for artifact, keys in written_keys(run_dir).items():
        for key in keys:
            declared = release.field(artifact, key)
            assert declared is not None, (mode, artifact, key)
            assert declared.kind is not release.Kind.PRIVATE, (mode, artifact, key)
    assert set(json.loads((run_dir / "config.json").read_text())) <= {key.name for key in documented_keys()} | {
        "run_dir"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_output_of_each_mode_is_declared_at_the_boundary(local_ray, tmp_path, mode):
    # No pooled worker: the silo modes need both of the shared Ray's CPUs for their own workers.
    config = tiny(tmp_path, mode, **MODES[mode](tmp_path))
    log = io.StringIO()
    with release.observe() as seen:
        trainer = Trainer(config, show_progress=False, out=log)
        trainer.run()
    assert_released(config, log, seen, mode)
    assert (trainer.planned_steps == "auto") == (mode == "planned batches")


def assert_released(config, log: io.StringIO, seen: list, mode: str) -> None:
    """`mode`'s run printed and wrote declared outputs only; what it released is printed by name."""
    assert_declared(Path(config.run_dir), log.getvalue(), mode)
    names = sorted({f"{artifact}:{name}" for artifact, name in seen if artifact != "config.json"})
    print(f"{mode}: config.json (documented config keys), {', '.join(names)}")
    assert {("log", "run_start"), ("log", "epoch"), ("summary.json", "epsilon"), ("metrics.jsonl", "epsilon")} <= set(
        seen)
    expected = {"collective": ("log", "collective_start"), "silos": ("log", "shard_start"),
                "secure aggregation": ("log", "secure_aggregation"), "user level": ("log", "parquet_row_by_row")
                }.get(mode)
    assert expected is None or expected in seen
    if mode == "user level":
        assert ('reading Parquet rows one by one (slow for large tables): privacy_unit = "user" cannot use planned '
                "batches\n") in log.getvalue()


def test_the_audits_outputs_are_declared(local_ray, worker_pool, tmp_path):
    config = tiny(tmp_path, "audit", batch_size=100, train_subset=200, seed=3)
    log = io.StringIO()
    with release.observe() as seen:
        run_audit(config, canaries=MIN_CANARIES, out=log)
    assert_declared(Path(config.run_dir), log.getvalue(), "audit")
    assert ("log", "audit_canaries") in seen and ("audit.json", "epsilon_upper") in seen


def test_ray_records_no_call_of_the_actors_on_a_steps_path(tmp_path):
    """Ray's state API and timeline would give every step's call times (which follow the batch sizes) to the
    cluster's other jobs: the gradient workers, the silos' workers and the node reducers record none."""
    started = {}

    class Recorded:
        @staticmethod
        def options(**options):
            started.update(options)
            return SimpleNamespace(remote=lambda *arguments, **keywords: None)

    gradient_worker(tiny(tmp_path, "options"), Recorded)
    assert started["enable_task_events"] is False
    for path in ("aggregation.py", "shard_fleet.py", "fleet.py"):
        assert "**release.UNRECORDED_BY_RAY" in (ROOT / "orchestrator" / path).read_text(), path


# --- the door itself ------------------------------------------------------------------------------------------


def test_an_undeclared_or_private_output_cannot_leave():
    with pytest.raises(release.UndeclaredOutput, match="not declared"):
        release.line("batch_sizes", sizes=[3, 4])
    with pytest.raises(release.UndeclaredOutput, match="not declared"):
        release.record("summary.json", {"epsilon": 1.0, "realised_batch_sizes": [3, 4]})
    with pytest.raises(release.UndeclaredOutput, match="run-private"):
        release.record("summary.json", {"driver_bytes_per_step": 4096.0})
    with pytest.raises(release.UndeclaredOutput, match="run-private"):
        release.record("checkpoint", {"step": 3, "step_times": {}})
    with pytest.raises(release.UndeclaredOutput, match="owner-only"):
        release.record("metrics.jsonl", {"epoch": 1, "train_loss_non_private": 0.3})
    with pytest.raises(release.UndeclaredOutput, match="owner-only"):
        release.line("lenient_drops", detail="3 of 400 train rows")
    assert release.line("lenient_drops", shown=True, detail="3 of 400") == 'check_data = "lenient" dropped 3 of 400'
    # A library's line is matched, never printed through the run's door.
    with pytest.raises(release.UndeclaredOutput, match="not declared"):
        release.line("ray_started", time="", line=1, rest="")


def test_no_declared_template_matches_any_line():
    for declared in release.LINES:
        literal = "".join(part for part, *_ in __import__("string").Formatter().parse(declared.template))
        assert len(literal) >= 8 or declared.row_labels, declared.name
    assert release.undeclared_lines("0 2 3 5 8\nrows 18 and 19 fail label < 9") == [
        "0 2 3 5 8", "rows 18 and 19 fail label < 9"]


def test_the_docs_list_every_declared_output_with_its_class():
    text = (ROOT / "docs" / "outputs.md").read_text()
    assert release.declaration_table() in text
    assert "(outputs.md)" in (ROOT / "docs" / "threat-model.md").read_text()


def _say_arguments(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in ("say", "print") and node.args:
                yield node


def test_no_run_module_prints_a_line_around_the_door():
    """Every say() and print() of a run's modules is handed a declared line, never text made on the spot."""
    calls, found = 0, []
    for path in RUN_MODULES:
        for call in _say_arguments(ast.parse(path.read_text())):
            calls += 1
            if isinstance(call.args[0], (ast.JoinedStr, ast.Constant, ast.BinOp)):
                found.append(f"{path.name}:{call.lineno}")
    assert calls > 20  # the modules were read
    assert found == []


# --- the attacker: realised batch sizes from what a run wrote -------------------------------------------------


class RecordedSizes(Trainer):
    """A run that keeps, in the test's memory, each step's realised batch size and the numbers of each checkpoint
    file it wrote, read back from disk as its operator would."""

    def _draw_sample(self, step):
        indices, group_ids = super()._draw_sample(step)
        self.sizes = getattr(self, "sizes", {})
        self.sizes[step] = len(indices)
        return indices, group_ids

    def _save_checkpoint(self):
        super()._save_checkpoint()
        newest = max(Path(self.config.run_dir).glob("checkpoint-*.pt"), key=lambda path: path.stat().st_mtime_ns)
        self.written = getattr(self, "written", []) + [dict(numbers(
            {key: value for key, value in read_checkpoint(newest).items() if not isinstance(value, torch.Tensor)}))]


def numbers(value, path=""):
    """Every number in a checkpoint's or a summary's fields that is not a tensor, by its path."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, float(value)


def tracks(deltas: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether a field's moves between checkpoints follow the batch sizes of the steps between them."""
    if np.ptp(deltas) == 0 or np.ptp(sizes) == 0:
        return False
    return abs(np.corrcoef(deltas, sizes)[0, 1]) > 0.9


def test_consecutive_checkpoints_say_nothing_of_the_batch_sizes_between_them(local_ray, worker_pool, tmp_path):
    """An attacker with every checkpoint of a run (one a step) looks for a field whose moves follow the sizes."""
    config = tiny(tmp_path, "driver", steps=9, batch_size=60, checkpoint_every=1)
    trainer = RecordedSizes(config, show_progress=False, out=io.StringIO())
    with release.observe() as seen:
        trainer.run()
    assert_released(config, trainer.out, seen, "driver")
    written = trainer.written
    assert len(written) == 9
    sizes = np.array([trainer.sizes[step] for step in range(1, 9)], dtype=float)
    assert np.ptp(sizes) > 0  # Poisson batches: the sizes vary
    common = set.intersection(*(set(state) for state in written))
    assert "/step" in common  # the attacker read the files
    found = [path for path in sorted(common)
             if tracks(np.diff([state[path] for state in written]), sizes)]
    assert found == []


def test_the_attacker_finds_the_batch_sizes_in_the_driver_traffic_a_checkpoint_once_held():
    rng = np.random.default_rng(0)
    sizes = rng.poisson(40, 8).astype(float)
    # What step_times.driver_bytes held: the weights once a step and 8 bytes of index per sampled example.
    held = np.cumsum(4096 + 8 * sizes)
    assert tracks(np.diff(held), sizes[1:])
