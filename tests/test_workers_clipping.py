"""Per-example clipped gradient sums against a plain per-example autograd loop."""

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from workers.clipping import FLOAT32_PRECISION_SETTINGS, clip_factors, ieee_float32
from workers.engines import clipped_sum
from workers.vmap_engine import microbatch_clipped_sum, per_example_clipped_sum
from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.models import MODEL_NAMES, build_model, flat_parameters, input_shape


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_clipped_sum_matches_per_example_loop(model_name):
    torch.manual_seed(1234)
    model = build_model(model_name)
    inputs = torch.rand(20, *input_shape(model_name))
    labels = torch.randint(0, 10, (20,))
    flat_weights = flat_parameters(model)
    gradients = per_example_gradients_by_loop(model, flat_weights, inputs, labels)
    # The median norm makes about half of the examples clip and half pass through.
    clip_norm = gradients.norm(dim=1).median().item()

    clipped_sum = per_example_clipped_sum(model, flat_weights, inputs, labels, clip_norm, max_physical_batch=7)

    assert clipped_sum.dtype == torch.float32 and clipped_sum.shape == flat_weights.shape
    assert relative_error(clipped_sum, clipped_sum_by_loop(gradients, clip_norm)) < 1e-5


def test_chunk_size_does_not_change_the_sum():
    torch.manual_seed(7)
    model = build_model("opacus_cnn")
    inputs, labels = torch.rand(9, 1, 28, 28), torch.randint(0, 10, (9,))
    flat_weights = flat_parameters(model)
    one_at_a_time = per_example_clipped_sum(model, flat_weights, inputs, labels, 0.5, max_physical_batch=1)
    all_at_once = per_example_clipped_sum(model, flat_weights, inputs, labels, 0.5, max_physical_batch=100)
    torch.testing.assert_close(one_at_a_time, all_at_once, rtol=1e-5, atol=1e-7)


def test_uses_given_weights_and_leaves_model_untouched():
    torch.manual_seed(3)
    model = build_model("gdp_cnn")
    before = flat_parameters(model).clone()
    other_weights = torch.randn_like(before) * 0.05
    inputs, labels = torch.rand(5, 1, 28, 28), torch.randint(0, 10, (5,))

    clipped_sum = per_example_clipped_sum(model, other_weights, inputs, labels, 1e6, max_physical_batch=5)

    expected = per_example_gradients_by_loop(model, other_weights, inputs, labels).sum(dim=0)
    assert relative_error(clipped_sum, expected) < 1e-5
    assert torch.equal(flat_parameters(model), before)
    assert all(p.grad is None for p in model.parameters())


def test_empty_input_gives_zeros_of_parameter_length():
    model = build_model("lenet5")
    flat_weights = flat_parameters(model)
    clipped_sum = per_example_clipped_sum(
        model, flat_weights, torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.int64), 1.0, 4
    )
    assert clipped_sum.dtype == torch.float32
    assert torch.equal(clipped_sum, torch.zeros_like(flat_weights))


@pytest.mark.parametrize(
    ("clip_norm", "max_physical_batch", "message"),
    [
        (0.0, 4, "clip_norm must be a finite number > 0"),
        (-1.0, 4, "clip_norm must be a finite number > 0"),
        (float("inf"), 4, "clip_norm must be a finite number > 0"),
        (1.0, 0, "max_physical_batch must be an integer >= 1"),
        (1.0, 2.5, "max_physical_batch must be an integer >= 1"),
    ],
)
def test_invalid_arguments_are_refused(clip_norm, max_physical_batch, message):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=message):
        per_example_clipped_sum(
            model,
            flat_parameters(model),
            torch.zeros(1, 3),
            torch.zeros(1, dtype=torch.int64),
            clip_norm,
            max_physical_batch,
        )


def test_wrong_weight_length_is_refused():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="flat_weights must be 1-D with 8 entries"):
        per_example_clipped_sum(model, torch.zeros(7), torch.zeros(1, 3), torch.zeros(1, dtype=torch.int64), 1.0, 1)


def test_clip_factors():
    factors = clip_factors(torch.tensor([0.0, 0.5, 2.0, 8.0]), clip_norm=2.0)
    torch.testing.assert_close(factors, torch.tensor([1.0, 1.0, 1.0, 0.25]))


@settings(max_examples=60, deadline=None)
@given(
    inputs=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.just(3)),
        elements=st.floats(-100, 100, width=32),
    ),
    label_seed=st.integers(0, 2**16),
    clip_norm=st.floats(1e-3, 1e2),
)
def test_every_contribution_is_bounded_by_clip_norm(inputs, label_seed, clip_norm):
    torch.manual_seed(label_seed)
    model = nn.Linear(3, 2)
    flat_weights = flat_parameters(model)
    inputs = torch.from_numpy(inputs)
    labels = torch.randint(0, 2, (inputs.shape[0],))
    bound = clip_norm * (1 + 1e-6)

    contributions = [
        per_example_clipped_sum(model, flat_weights, inputs[i : i + 1], labels[i : i + 1], clip_norm, 1)
        for i in range(inputs.shape[0])
    ]
    # float32 like the code under test: with saturated softmax a float64
    # reference differs by float32 rounding, which is not what this checks.
    unclipped = per_example_gradients_by_loop(model, flat_weights, inputs, labels, torch.float32)
    for contribution, gradient in zip(contributions, unclipped, strict=True):
        assert contribution.norm().item() <= bound
        if gradient.norm() <= clip_norm * (1 - 1e-4):
            # A gradient already inside the ball passes through unchanged.
            torch.testing.assert_close(contribution, gradient)
    total = per_example_clipped_sum(model, flat_weights, inputs, labels, clip_norm, 4)
    assert total.norm().item() <= inputs.shape[0] * bound


def test_ieee_float32_switches_tf32_off_and_restores_the_settings_even_on_error():
    before = [setting.fp32_precision for setting in FLOAT32_PRECISION_SETTINGS]
    with pytest.raises(RuntimeError, match="inside"):
        with ieee_float32():
            assert [setting.fp32_precision for setting in FLOAT32_PRECISION_SETTINGS] == ["ieee"] * 3
            raise RuntimeError("inside")
    assert [setting.fp32_precision for setting in FLOAT32_PRECISION_SETTINGS] == before


@pytest.mark.parametrize("engine", ["fast", "vmap", "microbatches"])
def test_every_clipping_engine_computes_in_ieee_float32(engine):
    """What the loss sees while an engine runs: TF32 is off for convolutions and matrix products."""
    seen = []

    def recording_loss(logits, labels):
        seen.append((torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision))
        return torch.nn.functional.cross_entropy(logits, labels)

    model = build_model("gdp_cnn")
    inputs, labels = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    before = [setting.fp32_precision for setting in FLOAT32_PRECISION_SETTINGS]
    if engine == "microbatches":
        microbatch_clipped_sum(model, flat_parameters(model), inputs, labels, torch.tensor([0, 0, 1, 1]), 1.0,
                               recording_loss)
    else:
        clipped_sum(engine, model, flat_parameters(model), inputs, labels, 1.0, 4, recording_loss)

    assert seen and set(seen) == {("ieee", "ieee")}
    assert [setting.fp32_precision for setting in FLOAT32_PRECISION_SETTINGS] == before


BF16_MODEL = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("engine", ["vmap", "fast"])
@settings(max_examples=40, deadline=None)
@given(
    inputs=hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.just(3)), elements=st.floats(-100, 100, width=32)),
    label_seed=st.integers(0, 2**16),
    clip_norm=st.floats(1e-3, 1e2),
)
def test_bf16_contributions_are_bounded_by_clip_norm_as_in_float32(engine, inputs, label_seed, clip_norm):
    # Forward and backward in bfloat16; the vmap engine casts each example's gradient, the fast engine each layer's
    # recorded input and output gradient, to float32 before the norm and the clip, so the contribution and its
    # factor come from the same float32 tensors and the bound holds to float32 rounding.
    # One model for all examples, so that the fast engine checks its rules once; the weights are drawn anew.
    model = BF16_MODEL
    torch.manual_seed(label_seed)
    flat_weights = torch.randn(flat_parameters(model).shape)
    inputs = torch.from_numpy(inputs)
    labels = torch.randint(0, 2, (inputs.shape[0],))
    bound = clip_norm * (1 + 1e-6)
    for i in range(inputs.shape[0]):
        contribution = clipped_sum(engine, model, flat_weights, inputs[i : i + 1], labels[i : i + 1], clip_norm, 1,
                                   precision="bf16")
        assert contribution.dtype == torch.float32 and contribution.norm().item() <= bound
    total = clipped_sum(engine, model, flat_weights, inputs, labels, clip_norm, 4, precision="bf16")
    assert total.norm().item() <= inputs.shape[0] * bound


@pytest.mark.parametrize("engine", ["vmap", "fast"])
def test_bf16_clipped_sum_is_the_float32_loops_to_bfloat16_rounding_and_computes_in_bfloat16(engine):
    torch.manual_seed(5)
    model = build_model("gdp_cnn")
    inputs, labels = torch.rand(12, 1, 28, 28), torch.randint(0, 10, (12,))
    flat_weights = flat_parameters(model)
    gradients = per_example_gradients_by_loop(model, flat_weights, inputs, labels, torch.float32)
    clip_norm = gradients.norm(dim=1).median().item()
    in_bf16 = clipped_sum(engine, model, flat_weights, inputs, labels, clip_norm, 5, precision="bf16")
    assert in_bf16.dtype == torch.float32
    # bfloat16 keeps 8 significant bits: about 0.4% per product, 6.8% over this CNN's sum for either engine
    # (measured on the CPU).
    assert relative_error(in_bf16, clipped_sum_by_loop(gradients, clip_norm)) < 0.1
    assert not torch.equal(in_bf16, clipped_sum(engine, model, flat_weights, inputs, labels, clip_norm, 5))


@pytest.mark.parametrize("engine", ["vmap", "fast"])
def test_an_unknown_precision_is_refused_by_both_engines(engine):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="precision must be one of 'fp32', 'bf16' \\(got 'fp16'\\)"):
        clipped_sum(engine, model, flat_parameters(model), torch.rand(2, 3), torch.tensor([0, 1]), 1.0, 2,
                    precision="fp16")
