"""`dpfleet export`: the released model alone, loadable by plain torch and safetensors, with a card true to the run."""

import hashlib
import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from accounting.accountants import get_accountant
from accounting.events import SampledGaussian
from orchestrator import __version__
from orchestrator.checkpoint import checkpoint_files, latest_checkpoint
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.export import card_path, released_tensors
from orchestrator.trainer import Trainer
from test_faults import CrashAfterCheckpoint, DriverCrash
from workers.data import load_split
from workers.models import build_model, load_flat_parameters

TEST_EXAMPLES = 200
# Run with `python -I`, dpfleet's packages refused: a user with torch and safetensors alone rebuilds gdp_cnn.
PLAIN_TORCH_USER = """
import json
import sys

DPFLEET = ("orchestrator", "workers", "accounting")


class NoDpfleet:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in DPFLEET:
            raise ImportError(f"{name} is part of dpfleet, which this user does not have")
        return None


sys.meta_path.insert(0, NoDpfleet())
import torch
from torch import nn
from safetensors.torch import load_file, save_file

weights_path, inputs_path, logits_path = sys.argv[1:]
model = nn.Sequential(
    nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, stride=1),
    nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, stride=1),
    nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
)
model.load_state_dict(load_file(weights_path))
model.eval()
with torch.no_grad():
    logits = model(load_file(inputs_path)["inputs"])
save_file({"logits": logits}, logits_path)
print(json.dumps(sorted(name for name in sys.modules if name.partition(".")[0] in DPFLEET)))
"""


def run_config(run_dir, **overrides):
    values = dict(
        dataset="mnist", model="gdp_cnn", workers=1, steps=4, batch_size=30, train_subset=600,
        test_subset=TEST_EXAMPLES, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.5, seed=21,
        run_dir=str(run_dir), max_physical_batch=64,
    )
    values.update(overrides)
    return build_config(values)


@pytest.fixture(scope="module")
def finished_run(local_ray, tmp_path_factory):
    """A finished 4-step run with parameter averaging: its directory, its summary, and its released model."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    trainer = Trainer(run_config(run_dir, ema_decay=0.5, checkpoint_every=2), show_progress=False)
    summary = trainer.run()
    released = build_model("gdp_cnn")
    released.load_state_dict(trainer.model.state_dict())
    load_flat_parameters(released, trainer.ema_weights)
    return run_dir, summary, released.eval()


def test_plain_torch_rebuilds_the_released_model_and_gets_the_runs_predictions(finished_run, tmp_path):
    run_dir, summary, released = finished_run
    weights = tmp_path / "gdp-cnn.safetensors"
    assert main(["export", str(run_dir), "--out", str(weights)]) == 0
    images, labels = load_split("mnist", "test")
    inputs = images[:TEST_EXAMPLES].contiguous()
    save_file({"inputs": inputs}, tmp_path / "inputs.safetensors")
    script = tmp_path / "plain_torch_user.py"
    script.write_text(PLAIN_TORCH_USER)
    user = subprocess.run(
        [sys.executable, "-I", str(script), str(weights), str(tmp_path / "inputs.safetensors"),
         str(tmp_path / "logits.safetensors")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert user.returncode == 0, user.stderr[-3000:]
    assert json.loads(user.stdout.splitlines()[-1]) == []
    logits = load_file(tmp_path / "logits.safetensors")["logits"]
    with torch.no_grad():
        torch.testing.assert_close(logits, released(inputs))
    # The model the run evaluated (the moving average), not the last training weights.
    assert F.cross_entropy(logits, labels[:TEST_EXAMPLES]).item() == pytest.approx(summary["test_loss"], rel=1e-5)


def test_the_file_holds_the_models_tensors_and_nothing_else(finished_run, tmp_path):
    run_dir, _, released = finished_run
    weights = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(weights)]) == 0
    data = weights.read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size])
    assert header.pop("__metadata__") == {"format": "pt"}
    expected = released.state_dict()
    assert set(header) == set(expected) == {f"{layer}.{kind}" for layer in (0, 3, 7, 9) for kind in ("weight", "bias")}
    # Every byte after the header belongs to one of those tensors: nothing of the checkpoint rides along.
    assert len(data) == 8 + header_size + sum(tensor.numel() * tensor.element_size() for tensor in expected.values())
    exported = load_file(weights)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    _, state = latest_checkpoint(run_dir)
    # The averaged parameters, not the trained ones the checkpoint's model entry holds.
    assert not torch.equal(exported["9.weight"], state["model"]["9.weight"])


def test_the_model_card_gives_the_runs_guarantee_and_how_to_rebuild_the_model(finished_run, tmp_path, capsys):
    run_dir, summary, _ = finished_run
    weights = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(weights)]) == 0
    assert card_path(weights) == tmp_path / "model.model-card.json"
    printed = capsys.readouterr().out
    assert str(card_path(weights)) in printed and "\nwarning: seeded run" in printed
    card = json.loads(card_path(weights).read_text())
    privacy = card["privacy"]
    for key in ("epsilon", "epsilon_label", "epsilon_rigorous", "delta", "accountant", "steps", "noise_multiplier",
                "sampling_rate", "clip_norm", "final_clip_norm", "events"):
        assert privacy[key] == summary[key], key
    assert privacy["epsilon"] == get_accountant("pld").epsilon(SampledGaussian(30 / 600, 1.0, 4), 1e-5)
    assert privacy["privacy_unit"] == "example" and privacy["planned_steps"] == 4
    assert privacy["finished"] is True and privacy["seeded"] is True
    assert any("tests only, not private" in warning for warning in card["warnings"])
    assert card["model"] == {
        "spec": "gdp_cnn", "builtin": True, "module_folder": None, "input_columns": None, "input_shape": [1, 28, 28],
        "input_dtype": "float32", "output_shape": [10], "task": "multiclass", "loss": "cross_entropy", "classes": 10,
    }
    assert card["dataset"] == "mnist" and card["dpfleet_version"] == __version__
    assert card["weights"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert card["weights"]["file"] == "model.safetensors" and card["weights"]["ema_decay"] == 0.5
    assert card["test_metrics"] == {"test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"]}


def test_a_run_whose_final_checkpoint_is_torn_is_refused_as_unfinished(finished_run, tmp_path, capsys):
    run_dir, _, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    newest = checkpoint_files(copy)[-1]
    newest.write_bytes(newest.read_bytes()[:-100])
    assert main(["export", str(copy), "--out", str(tmp_path / "model.safetensors")]) == 2
    assert "unfinished" in capsys.readouterr().err and not (tmp_path / "model.safetensors").exists()


class CrashAfterStepTwo(CrashAfterCheckpoint):
    crash_at = 2


def test_an_unfinished_run_exports_only_when_asked_and_its_card_says_partial(local_ray, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(DriverCrash):
        CrashAfterStepTwo(run_config(run_dir, checkpoint_every=2, seed=None), show_progress=False).run()
    weights = tmp_path / "partial.safetensors"
    assert main(["export", str(run_dir), "--out", str(weights)]) == 2
    error = capsys.readouterr().err
    assert "unfinished" in error and "--last-checkpoint" in error and not weights.exists()
    assert main(["export", str(run_dir), "--out", str(weights), "--last-checkpoint", "--json"]) == 0
    card = json.loads(card_path(weights).read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == card
    privacy = card["privacy"]
    assert privacy["finished"] is False and privacy["steps"] == 2 and privacy["planned_steps"] == 4
    assert privacy["epsilon"] == get_accountant("pld").epsilon(SampledGaussian(30 / 600, 1.0, 2), 1e-5)
    assert privacy["sampling_rate"] == 30 / 600 and privacy["noise_multiplier"] == 1.0
    assert privacy["seeded"] is False
    assert [warning.startswith("partial run") for warning in card["warnings"]] == [True]
    _, state = latest_checkpoint(run_dir)
    exported = load_file(weights)
    assert set(exported) == set(state["model"])
    for name, tensor in state["model"].items():
        assert torch.equal(exported[name], tensor), name


def test_out_must_name_a_safetensors_file(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "model.pt")]) == 2
    assert "--out must name a file ending in .safetensors" in capsys.readouterr().err


class Standardise(nn.Module):
    """A fixed input scaling held in buffers: state that is not a parameter and never learns."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor(0.1307))
        self.register_buffer("std", torch.tensor(0.3081))

    def forward(self, inputs):
        return (inputs - self.mean) / self.std


def test_buffers_and_tied_weights_load_strictly_from_the_exported_tensors():
    torch.manual_seed(3)
    encoder, decoder = nn.Linear(8, 8), nn.Linear(8, 8)
    decoder.weight = encoder.weight
    model = nn.Sequential(Standardise(), encoder, nn.Tanh(), decoder)
    payload = safetensors_bytes(released_tensors(model), metadata={"format": "pt"})
    tensors = safetensors_load(payload)
    assert set(tensors) == {"0.mean", "0.std", "1.weight", "1.bias", "3.weight", "3.bias"}
    rebuilt_encoder, rebuilt_decoder = nn.Linear(8, 8), nn.Linear(8, 8)
    rebuilt_decoder.weight = rebuilt_encoder.weight
    rebuilt = nn.Sequential(Standardise(), rebuilt_encoder, nn.Tanh(), rebuilt_decoder)
    with torch.no_grad():
        rebuilt[0].mean.fill_(0.0)
    rebuilt.load_state_dict(tensors)
    inputs = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(inputs), model(inputs))
    assert rebuilt[3].weight is rebuilt[1].weight
