"""No model or input makes one example count for more than C: the fast engine's check, and non-finite gradients.

The fast engine checks its layer rules once per model and example schema, on
synthetic examples, against autograd and falls back to the vmap engine, with
a warning naming the parameter, when a rule cannot see a parameter's whole
gradient. An example whose gradient
holds a NaN or inf contributes exactly zero, in every engine, with per-layer
clipping and with microbatches.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from reference import relative_error
from workers.actor import GradientWorker
from workers.clipping import LayerClipNorms
from workers.engines import (ENGINES, VMAP_FALLBACK_GRADIENT_ELEMENTS, check_rules, clipped_sum, engine_plan,
                             fallback_physical_batch, fast_clipped_sum)
from workers.layer_rules import instantiated, register_rule
from workers.models import build_model, flat_parameters
from workers.vmap_engine import microbatch_clipped_sum, per_example_clipped_sum


class FunctionallyTiedLanguageModel(nn.Module):
    """A bag-of-tokens language model whose output layer is the embedding matrix, used directly in forward."""

    def __init__(self, vocabulary: int = 20, width: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.mix = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embedding(tokens))).mean(1)
        return hidden @ self.embedding.weight.T


class HalvedLinear(nn.Linear):
    """A Linear whose (deliberately wrong) registered rule sees half of its weight gradient."""


@register_rule(HalvedLinear)
def halved_linear_rule(layer, params, calls, batch_size):
    """Half of each example's weight gradient: a rule that under-counts, for the check to catch."""
    inputs, output_grads = calls[0].input, calls[0].output_grad
    result = {"weight": instantiated(0.5 * torch.einsum("bo,bi->boi", output_grads, inputs))}
    if "bias" in params:
        result["bias"] = instantiated(output_grads)
    return result


def contribution_norms(engine, model, weights, inputs, labels, clip_norm):
    """Each example's own contribution to the clipped sum: the sum with it minus the sum without it."""
    full = clipped_sum(engine, model, weights, inputs, labels, clip_norm, 4).double()
    norms = []
    for index in range(len(labels)):
        keep = torch.arange(len(labels)) != index
        norms.append((full - clipped_sum(engine, model, weights, inputs[keep], labels[keep], clip_norm, 4)).norm())
    return torch.stack(norms)


def test_a_functionally_tied_weight_sends_the_model_to_the_vmap_engine_with_its_name():
    torch.manual_seed(0)
    model = FunctionallyTiedLanguageModel()
    tokens, labels = torch.randint(0, 20, (6, 5)), torch.randint(0, 20, (6,))
    weights = flat_parameters(model)
    with pytest.warns(UserWarning, match=r"uses embedding\.weight \(by \.T\) outside the layer that owns it"):
        actual = fast_clipped_sum(model, weights, tokens, labels, 0.05, 4)
    assert torch.equal(actual, per_example_clipped_sum(model, weights, tokens, labels, 0.05, 4))
    assert engine_plan(model).describe() == [
        f"{title}: vmap (fallback: the model's forward uses embedding.weight (by .T) outside the layer that owns it)"
        for title in ("embedding (Embedding)", "mix (Linear)")
    ]
    assert (contribution_norms("fast", model, weights, tokens, labels, 0.05) <= 0.05 * (1 + 1e-6)).all()


def test_the_vmap_fallback_takes_fewer_examples_at_a_time_for_a_large_model():
    assert fallback_physical_batch(128, 26_000) == 128
    assert fallback_physical_batch(128, 750_000) == VMAP_FALLBACK_GRADIENT_ELEMENTS // 750_000 < 128
    assert fallback_physical_batch(128, 10 * VMAP_FALLBACK_GRADIENT_ELEMENTS) == 1


def test_a_rule_that_under_counts_is_caught_by_the_comparison_with_autograd():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), HalvedLinear(5, 3))
    inputs, labels = torch.randn(8, 6), torch.randint(0, 3, (8,))
    plan = check_rules(model, flat_parameters(model), inputs[:4], labels[:4], F.cross_entropy)
    assert plan.fallback == "the layer rules do not reproduce autograd's per-example gradient of 2.weight"
    with pytest.warns(UserWarning, match="per-example gradient of 2.weight"):
        actual = fast_clipped_sum(model, flat_parameters(model), inputs, labels, 0.1, 4)
    expected = per_example_clipped_sum(model, flat_parameters(model), inputs, labels, 0.1, 4)
    assert torch.equal(actual, expected)


def test_models_the_rules_serve_pass_the_check_and_the_plan_names_each_layers_path():
    torch.manual_seed(2)
    # Dropout draws random masks: the check replays the generator so both of its passes see the same ones.
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Dropout(0.3), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    inputs, labels = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    before = torch.get_rng_state()
    plan = check_rules(model, flat_parameters(model), inputs, labels, F.cross_entropy)
    assert torch.equal(torch.get_rng_state(), before)
    assert plan.fallback is None
    assert plan.describe() == ["0 (Conv2d): fast (per-example)", "3 (Linear): fast (ghost)"]


def test_the_worker_reports_each_layers_path_before_its_first_examples():
    worker = GradientWorker("gdp_cnn", "mnist", 64, max_physical_batch=16)
    expected = [
        "0 (Conv2d): fast (per-example)", "3 (Conv2d): fast (per-example)",
        "7 (Linear): fast (ghost)", "9 (Linear): fast (ghost)",
    ]
    assert worker.engine_report() == expected
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    worker.clipped_grad_sum(weights, np.arange(8), 0.1)
    assert worker.engine_report() == expected
    assert GradientWorker("gdp_cnn", "mnist", 64, 16, engine="vmap").engine_report() == [
        'every layer: vmap (engine = "vmap")'
    ]


def poisoned_batch(seed: int, poisoned: int, value: float):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand(10, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (10,), generator=generator)
    poisoned_inputs = inputs.clone()
    poisoned_inputs[poisoned, 0, 3, 4] = value
    keep = torch.arange(10) != poisoned
    return poisoned_inputs, labels, inputs[keep], labels[keep]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("poisoned", [1, 7])  # in the first chunk of 3 and in the last
def test_an_example_with_a_non_finite_gradient_contributes_exactly_zero(engine, value, poisoned):
    torch.manual_seed(3)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    inputs, labels, clean_inputs, clean_labels = poisoned_batch(4, poisoned, value)
    summed, norms = clipped_sum(engine, model, weights, inputs, labels, 0.1, 3, return_norms=True)
    expected = clipped_sum(engine, model, weights, clean_inputs, clean_labels, 0.1, 3)
    assert summed.isfinite().all()
    assert relative_error(summed, expected.double()) < 1e-6
    total_norms = torch.stack(list(norms.values())).pow(2).sum(0)
    assert total_norms.isfinite().tolist() == [index != poisoned for index in range(10)]


def test_the_fast_engine_zeroes_a_poisoned_example_once_its_plan_is_settled():
    torch.manual_seed(5)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    inputs, labels, clean_inputs, clean_labels = poisoned_batch(6, 2, float("nan"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fast clipping engine")
        fast_clipped_sum(model, weights, clean_inputs, clean_labels, 0.1, 4)  # settles the plan
        assert engine_plan(model).fallback is None
        summed = fast_clipped_sum(model, weights, inputs, labels, 0.1, 4)
    assert relative_error(summed, fast_clipped_sum(model, weights, clean_inputs, clean_labels, 0.1, 4).double()) < 1e-6


@pytest.mark.parametrize("engine", ENGINES)
def test_per_layer_clipping_zeroes_a_poisoned_example_in_every_group(engine):
    torch.manual_seed(7)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    norms = LayerClipNorms((("0", 0.05), ("3", 0.05), ("7", 0.05), ("9", 0.05)))
    inputs, labels, clean_inputs, clean_labels = poisoned_batch(8, 5, float("nan"))
    summed = clipped_sum(engine, model, weights, inputs, labels, norms, 4)
    assert relative_error(summed, clipped_sum(engine, model, weights, clean_inputs, clean_labels, norms, 4).double()) < 1e-6


def test_a_microbatch_leaves_out_only_its_poisoned_member():
    torch.manual_seed(9)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    inputs, labels, clean_inputs, clean_labels = poisoned_batch(10, 4, float("nan"))
    group_ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    summed, norms, zeroed = microbatch_clipped_sum(model, weights, inputs, labels, group_ids, 0.1, return_norms=True)
    keep = torch.arange(10) != 4
    expected = microbatch_clipped_sum(model, weights, clean_inputs, clean_labels, group_ids[keep], 0.1)
    assert relative_error(summed, expected.double()) < 1e-6
    assert zeroed == 1 and norms.isfinite().all() and norms.numel() == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_the_worker_counts_the_examples_it_left_out(engine):
    worker = GradientWorker("gdp_cnn", "mnist", 64, max_physical_batch=16, engine=engine)
    worker.source.inputs[[5, 9]] = float("nan")
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    with_counts = worker.clipped_grad_sum(weights, np.arange(12), 0.1, count_unclipped=True, count_zeroed=True)
    plain = worker.clipped_grad_sum(weights, np.array([0, 1, 2, 3, 4, 6, 7, 8, 10, 11]), 0.1)
    assert with_counts.shape == (weights.size + 2,)
    assert with_counts[-1] == 2
    np.testing.assert_allclose(with_counts[:-2], plain, rtol=0, atol=1e-6)
