"""Model registry, flat parameter vectors, and the batch-norm validator."""

import os

import numpy as np
import pytest
import torch
from torch import nn

from workers.models import (
    MODEL_NAMES,
    build_model,
    bind_flat_views,
    flat_parameters,
    load_flat_parameters,
    parameter_count,
)
from workers.validation import UnsupportedModuleError, check_model, group_count, replace_batchnorm


def tiny_factory():
    """A user model factory, named in tests as '<this module>:tiny_factory'."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def not_a_model_factory():
    return "not a module"


def batchnorm_model():
    return nn.Sequential(
        nn.Conv2d(1, 48, 3),
        nn.BatchNorm2d(48),
        nn.ReLU(),
        nn.Flatten(),
        nn.Sequential(nn.Linear(48 * 26 * 26, 6), nn.BatchNorm1d(6, affine=False)),
        nn.Linear(6, 10),
    )


def test_registry_holds_the_seed_models_and_the_scatternets():
    assert set(MODEL_NAMES) == {"gdp_cnn", "opacus_cnn", "lenet5", "scatternet_linear", "scatternet_cnn",
                                "scatternet_linear_32", "scatternet_cnn_32"}


# Counts worked out from the layer shapes: conv 1->16 k8 (1040), conv 16->32 k4
# (8224), fc 512->32 (16416), fc 32->10 (330); LeNet5 has bias-free convs
# (150 + 2400), fc 400->120 (48120), 120->84 (10164), 84->10 (850).
@pytest.mark.parametrize(
    ("model_name", "expected_count"), [("gdp_cnn", 26010), ("opacus_cnn", 26010), ("lenet5", 61684)]
)
def test_builtin_models_map_mnist_batches_to_ten_logits(model_name, expected_count):
    model = build_model(model_name)
    check_model(model)
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)
    assert parameter_count(model) == expected_count


def test_gdp_cnn_first_convolution_matches_tensorflow_same_padding():
    # TF 'same' with stride 2 gives ceil(28 / 2) = 14 rows and columns.
    first_conv = build_model("gdp_cnn")[0]
    assert first_conv(torch.rand(1, 1, 28, 28)).shape == (1, 16, 14, 14)


def test_gdp_and_opacus_cnns_differ_only_in_activation():
    gdp_layers = [type(layer) for layer in build_model("gdp_cnn")]
    opacus_layers = [type(layer) for layer in build_model("opacus_cnn")]
    assert [nn.ReLU if t is nn.Tanh else t for t in gdp_layers] == opacus_layers


def test_flat_parameters_round_trip():
    torch.manual_seed(0)
    model = build_model("lenet5")
    flat = flat_parameters(model)
    assert flat.dtype == torch.float32 and flat.shape == (parameter_count(model),)
    # Order is named_parameters() order: the first block is the first conv's weight.
    first_name, first = next(iter(model.named_parameters()))
    assert torch.equal(flat[: first.numel()], first.detach().reshape(-1))

    new_weights = np.arange(flat.numel(), dtype=np.float32)
    load_flat_parameters(model, new_weights)
    assert torch.equal(flat_parameters(model), torch.from_numpy(new_weights))
    assert model.get_parameter(first_name).flatten()[:3].tolist() == [0.0, 1.0, 2.0]


def test_flat_parameters_skip_frozen_parameters():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    assert parameter_count(model) == 3 + 3 + 1
    load_flat_parameters(model, torch.ones(7))
    assert torch.equal(model[0].bias.detach(), torch.ones(3))


def test_flat_views_hold_the_weights_and_take_the_gradient_without_copies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    before = flat_parameters(model).clone()
    weights, gradient = bind_flat_views(model)
    assert torch.equal(weights, before) and weights.numel() == gradient.numel() == 3 + 3 + 1
    gradient.copy_(torch.arange(7.0))
    assert torch.equal(model[0].bias.grad, torch.arange(3.0)) and torch.equal(model[1].bias.grad, torch.tensor([6.0]))
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    # The optimizer's in-place update shows in the flat buffer, and loading a state dict keeps the views.
    assert torch.equal(weights, before - 0.5 * torch.arange(7.0))
    model.load_state_dict(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)).state_dict())
    assert torch.equal(weights, flat_parameters(model))
    with pytest.raises(ValueError, match=r"0.bias \(torch.float64\)"):
        bind_flat_views(nn.Sequential(nn.Linear(2, 3)).double())


def test_load_flat_parameters_refuses_wrong_length():
    model = build_model("opacus_cnn")
    with pytest.raises(ValueError, match="must be 1-D with 26010 entries"):
        load_flat_parameters(model, torch.zeros(26009))


def test_user_factory_spec_builds_the_model():
    model = build_model(f"{__name__}:tiny_factory")
    assert isinstance(model, nn.Sequential)
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("spec", ["resnet", "workers.models:no_such_factory", "a:b:c", ":f"])
def test_bad_model_spec_names_valid_choices(spec):
    with pytest.raises(ValueError) as error:
        build_model(spec)
    message = str(error.value)
    assert all(name in message for name in MODEL_NAMES)
    assert "package.module:function" in message


def test_a_spec_whose_module_does_not_import_names_where_python_looked_and_the_fix():
    with pytest.raises(ValueError) as error:
        build_model("no_such_package_for_dpfleet.models:factory")
    message = str(error.value)
    assert message.startswith("model 'no_such_package_for_dpfleet.models:factory': module "
                              "'no_such_package_for_dpfleet.models' cannot be imported: Python looked for "
                              f"no_such_package_for_dpfleet{os.sep}models.py in ")
    assert message.endswith(f"run from the folder that holds no_such_package_for_dpfleet{os.sep}models.py, or set "
                            "PYTHONPATH to that folder")
    assert not any(name in message for name in MODEL_NAMES), "a built-in is not the fix for a module off the path"


def test_factory_returning_a_non_module_is_refused():
    with pytest.raises(ValueError, match="returned str, not a torch.nn.Module"):
        build_model(f"{__name__}:not_a_model_factory")


def test_check_model_names_every_batchnorm_and_the_fix():
    with pytest.raises(UnsupportedModuleError) as error:
        check_model(batchnorm_model())
    message = str(error.value)
    assert "1 (BatchNorm2d)" in message
    assert "4.1 (BatchNorm1d)" in message
    assert "GroupNorm" in message and "replace_batchnorm" in message
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize(
    "norm", [nn.BatchNorm3d(4), nn.LazyBatchNorm2d(), nn.SyncBatchNorm(4)], ids=lambda m: type(m).__name__
)
def test_check_model_refuses_every_batchnorm_flavour(norm):
    with pytest.raises(UnsupportedModuleError, match=type(norm).__name__):
        check_model(nn.Sequential(nn.Identity(), norm))


def test_replace_batchnorm_rewrites_to_groupnorm_and_passes_the_check():
    model = replace_batchnorm(batchnorm_model())
    check_model(model)
    assert isinstance(model[1], nn.GroupNorm)
    assert (model[1].num_groups, model[1].num_channels, model[1].affine) == (24, 48, True)
    assert isinstance(model[4][1], nn.GroupNorm)
    assert (model[4][1].num_groups, model[4][1].num_channels, model[4][1].affine) == (6, 6, False)
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)


def test_replace_batchnorm_on_a_bare_batchnorm_returns_a_groupnorm():
    replacement = replace_batchnorm(nn.BatchNorm2d(64))
    assert isinstance(replacement, nn.GroupNorm) and replacement.num_groups == 32


def test_group_count_is_the_largest_divisor_up_to_32():
    assert [group_count(c) for c in (1, 6, 32, 48, 64, 100)] == [1, 6, 32, 24, 32, 25]
