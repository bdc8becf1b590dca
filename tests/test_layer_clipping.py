"""Per-layer clipping: every parameter group stays within its own norm; noise uses the total sensitivity."""

import math

import pytest
import torch

from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.trainer import Trainer
from reference import per_example_gradients_by_loop, relative_error
from workers.clipping import LayerClipNorms
from workers.engines import clipped_sum
from workers.models import build_model, flat_parameters

GROUPS = LayerClipNorms((("0", 0.02), ("3", 0.05), ("7", 0.03), ("9", 0.01)))


def group_slices(model, groups):
    """For each group, the positions of its parameters in the flat layout."""
    slices, offset = {index: [] for index in range(len(groups.groups))}, 0
    for name, parameter in model.named_parameters():
        slices[groups.group_of(name)].append(torch.arange(offset, offset + parameter.numel()))
        offset += parameter.numel()
    return {index: torch.cat(parts) for index, parts in slices.items()}


@pytest.mark.parametrize("engine", ["fast", "vmap"])
def test_each_group_stays_within_its_own_norm(engine):
    torch.manual_seed(2)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    inputs, labels = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    slices = group_slices(model, GROUPS)
    for example in range(6):
        single = clipped_sum(engine, model, weights, inputs[example : example + 1], labels[example : example + 1],
                             GROUPS, max_physical_batch=4)
        for index, (_, norm) in enumerate(GROUPS.groups):
            assert single[slices[index]].norm() <= norm * (1 + 1e-5)
        assert single.norm() <= GROUPS.total_norm * (1 + 1e-5)


@pytest.mark.parametrize("engine", ["fast", "vmap"])
def test_per_layer_sum_matches_a_plain_loop(engine):
    torch.manual_seed(3)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    inputs, labels = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    gradients = per_example_gradients_by_loop(model, weights, inputs, labels)
    expected = torch.zeros(gradients.shape[1], dtype=torch.float64)
    for index, positions in group_slices(model, GROUPS).items():
        part = gradients[:, positions]
        scale = torch.clamp(GROUPS.groups[index][1] / part.norm(dim=1, keepdim=True), max=1.0)
        expected[positions] = (part * scale).sum(0)
    actual = clipped_sum(engine, model, weights, inputs, labels, GROUPS, max_physical_batch=4)
    assert relative_error(actual, expected) < 1e-5


def test_total_sensitivity_is_the_root_of_the_squared_group_norms():
    assert GROUPS.total_norm == pytest.approx(math.sqrt(0.02**2 + 0.05**2 + 0.03**2 + 0.01**2))
    assert GROUPS.group_of("3.weight") == 1 and GROUPS.group_of("30.weight") is None


def test_noise_is_scaled_to_the_total_sensitivity_and_every_parameter_needs_a_group(tmp_path):
    config = build_config(dict(steps=2, batch_size=10, train_subset=100, noise_multiplier=1.2,
                               layer_clip_norms={"0": 0.3, "3": 0.4, "7": 1.2, "9": 0.1}, run_dir=str(tmp_path)))
    trainer = Trainer(config, show_progress=False)
    assert trainer.record.clip_norm == pytest.approx(math.sqrt(0.09 + 0.16 + 1.44 + 0.01))
    missing = build_config(dict(steps=2, batch_size=10, train_subset=100, noise_multiplier=1.2,
                                layer_clip_norms={"0": 0.3, "3": 0.4}, run_dir=str(tmp_path)))
    with pytest.raises(UsageError, match="no clip norm to 7.weight, 7.bias, 9.weight, 9.bias"):
        Trainer(missing, show_progress=False)
    with pytest.raises(UsageError, match="cannot be combined"):
        build_config(dict(steps=2, noise_multiplier=1.0, microbatch_size=2, layer_clip_norms={"0": 1.0}))
