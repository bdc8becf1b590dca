"""The fast (book-keeping) engine against the vmap engine: same clipped sums and per-parameter norms.

Every comparison clips at the median per-example norm of the vmap engine, so
some examples are scaled down and some pass through unchanged; both engines
run in float32 and must agree to 1e-5 relative.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bench.throughput import TextClassifier, resnet18_gn
from reference import relative_error
from workers.actor import GradientWorker
from workers.engines import ENGINES, _units, clipped_sum, engine_plan, fast_clipped_sum
from workers.layer_rules import attention_rule, instantiation_is_cheaper, vmap_rule
from workers.vmap_engine import per_example_clipped_sum
from workers.features import compute_features, feature_map
from workers.models import MODEL_NAMES, build_model, flat_parameters, input_shape
from workers.tasks import build_loss

TOLERANCE = 1e-5

# torch.func has no batching rule for CPU flash attention and says so; the result is right, only slower.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def total_norms(norms: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([values.double() ** 2 for values in norms.values()]).sum(0).sqrt()


def assert_engines_agree(model, inputs, labels, max_physical_batch=5, loss_fn=F.cross_entropy):
    """Clip at the median norm; compare sums and per-parameter norms of the two engines. Returns the fast sum."""
    flat_weights = flat_parameters(model)
    _, unclipped_norms = per_example_clipped_sum(model, flat_weights, inputs, labels, 1e9, 64, loss_fn, True)
    norms = total_norms(unclipped_norms)
    clip_norm = norms.median().item()
    assert (norms > clip_norm).any() and (norms <= clip_norm).any()

    expected, expected_norms = per_example_clipped_sum(
        model, flat_weights, inputs, labels, clip_norm, 64, loss_fn, return_norms=True
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fast clipping engine")  # no whole-model fallback
        actual, actual_norms = fast_clipped_sum(
            model, flat_weights, inputs, labels, clip_norm, max_physical_batch, loss_fn, return_norms=True
        )

    assert actual.dtype == torch.float32 and actual.shape == flat_weights.shape and not actual.requires_grad
    assert relative_error(actual, expected.double()) < TOLERANCE
    assert list(actual_norms) == list(expected_norms)
    for name, values in expected_norms.items():
        assert values.shape == (len(labels),)
        if values.any():
            assert relative_error(actual_norms[name], values.double()) < TOLERANCE, name
        else:  # a parameter the loss does not depend on
            assert not actual_norms[name].any(), name
    return actual


def rules_of(model):
    return {type(unit.layer).__name__: unit.rule for unit in _units(model)}


# --- the bench models


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_registry_models(model_name):
    torch.manual_seed(11)
    inputs = torch.rand(12, *input_shape(model_name))
    # A ScatterNet's workers run the engines on its head, over the fixed features.
    features, model = feature_map(build_model(model_name))
    if features is not None:
        inputs = compute_features(features, inputs)
    assert_engines_agree(model, inputs, torch.randint(0, 10, (12,)))


def test_resnet18_with_group_norm():
    torch.manual_seed(12)
    model = resnet18_gn()
    assert_engines_agree(model, torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)), max_physical_batch=3)


def test_transformer_text_classifier():
    torch.manual_seed(13)
    model = TextClassifier(vocab_size=40, sequence_length=8, width=16, heads=2)
    assert rules_of(model)["MultiheadAttention"] is attention_rule
    assert_engines_agree(model, torch.randint(0, 40, (8, 8)), torch.randint(0, 4, (8,)))


def test_attention_gradients_are_batched_on_the_math_kernel_not_looped_over_examples():
    """The fused attention kernels have no vmap batching rule: torch.func would call them once per example."""
    torch.manual_seed(13)
    model = TextClassifier(vocab_size=40, sequence_length=8, width=16, heads=2)
    inputs, labels = torch.randint(0, 40, (8, 8)), torch.randint(0, 4, (8,))
    fast_clipped_sum(model, flat_parameters(model), inputs, labels, 1.0, 8)  # the first call checks the rules
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fast_clipped_sum(model, flat_parameters(model), inputs, labels, 1.0, 8)
    fused_calls = {event.key: event.count for event in profile.key_averages()
                   if "flash_attention" in event.key or "efficient_attention" in event.key}
    # The model's own forward and backward pass: once per layer (2 layers), not once per example (8).
    assert all(count <= 2 for count in fused_calls.values()), fused_calls


# --- one tiny model per layer type


def test_linear():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3))
    assert_engines_agree(model, torch.randn(10, 3, 4), torch.randint(0, 3, (10,)))


class SequenceModel(nn.Module):
    def __init__(self, positions, in_features, out_features):
        super().__init__()
        self.sequence = nn.Linear(in_features, out_features)
        self.head = nn.Linear(positions * out_features, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.sequence(x)).flatten(1))


@pytest.mark.parametrize(
    ("positions", "in_features", "out_features", "instantiated"),
    [(16, 5, 4, True), (2, 6, 8, False), (2, 6, 3, False)],
)
def test_linear_on_sequences_both_paths(positions, in_features, out_features, instantiated):
    assert instantiation_is_cheaper(positions, in_features, out_features) is instantiated
    torch.manual_seed(2)
    model = SequenceModel(positions, in_features, out_features)
    assert_engines_agree(model, torch.randn(10, positions, in_features), torch.randint(0, 3, (10,)))


CONVOLUTIONS = {
    "plain": dict(in_channels=3, out_channels=4, kernel_size=3, padding=1),
    "stride_padding_dilation_groups": dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=2,
                                           dilation=2, groups=2),
    "rectangular_same": dict(in_channels=2, out_channels=4, kernel_size=(3, 2), padding="same", dilation=(1, 2)),
    "depthwise_reflect": dict(in_channels=3, out_channels=3, kernel_size=3, padding=1, groups=3,
                              padding_mode="reflect"),
    "one_channel_no_bias": dict(in_channels=1, out_channels=8, kernel_size=5, stride=2, bias=False),
    "ghost_circular": dict(in_channels=4, out_channels=16, kernel_size=3, stride=2, padding=1,
                           padding_mode="circular"),
}


@pytest.mark.parametrize("name", CONVOLUTIONS)
def test_conv2d(name):
    torch.manual_seed(3)
    convolution = nn.Conv2d(**CONVOLUTIONS[name])
    model = nn.Sequential(convolution, nn.Tanh(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(4 * convolution.out_channels, 3))
    assert_engines_agree(model, torch.randn(10, convolution.in_channels, 7, 7), torch.randint(0, 3, (10,)))


def test_conv2d_paths_follow_the_cost_rule():
    # gdp_cnn: conv1 sees 196 positions of 64 inputs with 16 outputs, conv2 25 of 256 with 32.
    assert instantiation_is_cheaper(196, 64, 16) and instantiation_is_cheaper(25, 256, 32)
    # The ghost-circular case above: 4 positions, 36 inputs, 16 outputs (more outputs than 2 T).
    assert not instantiation_is_cheaper(4, 36, 16)
    # ResNet-18 layer3 at 32x32 input: 4 positions of 2304 inputs, 256 outputs: ghost norm.
    assert not instantiation_is_cheaper(4, 2304, 256)
    # Dense layers (one position) always take the ghost norm ||a|| ||g||.
    assert not instantiation_is_cheaper(1, 512, 32)


@pytest.mark.parametrize("token_shape", [(7,), ()])
def test_embedding_with_padding_and_repeated_tokens(token_shape):
    torch.manual_seed(4)

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(6, 5, padding_idx=0)
            self.head = nn.Linear(5, 3)

        def forward(self, tokens):
            embedded = self.embedding(tokens)
            return self.head(embedded.mean(1) if embedded.dim() == 3 else embedded)

    tokens = torch.randint(0, 6, (10, *token_shape))  # few ids: repeats and padding in most rows
    assert_engines_agree(Bag(), tokens, torch.randint(0, 3, (10,)))


def test_group_norm():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(2, 6, 3), nn.GroupNorm(3, 6), nn.ReLU(inplace=True), nn.Flatten(),
                          nn.Linear(6 * 25, 3))
    assert_engines_agree(model, torch.randn(10, 2, 7, 7), torch.randint(0, 3, (10,)))


@pytest.mark.parametrize("normalized_shape", [(5,), (4, 5)])
def test_layer_norm(normalized_shape):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(normalized_shape), nn.Tanh(), nn.Flatten(),
                          nn.Linear(20, 3))
    assert_engines_agree(model, torch.randn(10, 4, 5), torch.randint(0, 3, (10,)))


class Affine(nn.Module):
    """A layer type the engine has no rule for: elementwise scale and shift."""

    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.scale + self.shift


def test_unknown_layers_fall_back_to_vmap_per_layer():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 4), Affine(4), nn.PReLU(), nn.Linear(4, 3))
    rules = rules_of(model)
    assert rules["Affine"] is vmap_rule and rules["PReLU"] is vmap_rule
    assert_engines_agree(model, torch.randn(10, 6), torch.randint(0, 3, (10,)))


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_with_key_padding(batch_first):
    torch.manual_seed(8)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            padding = x[..., 0] > 1.2  # per example, some keys masked
            padding[:, 0] = False
            sequence = x if batch_first else x.transpose(0, 1)
            attended, _ = self.attention(sequence, sequence, sequence, key_padding_mask=padding)
            return self.head((attended if batch_first else attended.transpose(0, 1)).mean(1))

    # A sequence as long as the batch would make a wrong batch dimension go unnoticed.
    assert_engines_agree(Attention(), torch.randn(6, 6, 8), torch.randint(0, 3, (6,)))


def test_layer_called_twice_and_frozen_and_unused_parameters():
    torch.manual_seed(9)

    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(5, 5)
            self.frozen = nn.Linear(5, 5)
            self.frozen.weight.requires_grad_(False)
            self.unused = nn.Linear(5, 5)
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(self.frozen(x))))))

    assert_engines_agree(Reuse(), torch.randn(10, 5), torch.randint(0, 3, (10,)))


def test_other_losses_go_through_vmap_one_example_at_a_time():
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))

    def squared_log_loss(logits, labels):
        return F.cross_entropy(logits, labels) ** 2

    assert_engines_agree(model, torch.randn(10, 6), torch.randint(0, 3, (10,)), loss_fn=squared_log_loss)


# --- models the per-layer view cannot serve run on the vmap engine whole, with a warning


def test_a_tied_embedding_and_output_layer_run_on_book_keeping_rules():
    torch.manual_seed(14)
    embedding = nn.Embedding(7, 5, padding_idx=0)
    head = nn.Linear(5, 7, bias=False)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Linear(5, 5), nn.Tanh(), head)
    assert_engines_agree(model, torch.randint(0, 7, (6, 4)), torch.randint(0, 7, (6, 4)),
                         loss_fn=build_loss("token_cross_entropy"))
    assert engine_plan(model).fallback is None
    assert dict(engine_plan(model).layers)["3 (Linear)"] == "fast (ghost)"


def test_other_tied_parameters_use_the_vmap_engine_with_a_warning():
    torch.manual_seed(14)
    first, second = nn.Linear(7, 7), nn.Linear(7, 7)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second)
    inputs, labels = torch.randn(6, 7), torch.randint(0, 7, (6,))
    weights = flat_parameters(model)
    with pytest.warns(UserWarning, match="0.weight = 2.weight is tied to several modules"):
        actual = fast_clipped_sum(model, weights, inputs, labels, 0.5, 4)
    assert torch.equal(actual, per_example_clipped_sum(model, weights, inputs, labels, 0.5, 4))


def test_input_changed_in_place_after_its_layer_is_not_used_silently():
    class Overwrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 3)

        def forward(self, x):
            hidden = self.first(x) + 1.0
            out = self.second(hidden)
            # Changes what second saw, after it ran. Plain autograd refuses this (second's
            # weight gradient needs hidden); the fast engine's backward pass does not need it.
            hidden.mul_(2.0)
            return out + hidden.sum(1, keepdim=True)

    model = Overwrite()
    with pytest.warns(UserWarning, match="changed in place"), pytest.raises(RuntimeError, match="inplace"):
        fast_clipped_sum(model, flat_parameters(model), torch.randn(5, 4), torch.randint(0, 3, (5,)), 1.0, 5)


# --- the contract


def test_empty_input_gives_zeros_and_no_norms():
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    summed, norms = fast_clipped_sum(
        model, weights, torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.int64), 1.0, 8, return_norms=True
    )
    assert summed.dtype == torch.float32 and summed.shape == weights.shape and not summed.any()
    assert all(values.shape == (0,) for values in norms.values())


def test_model_parameters_gradients_and_hooks_are_left_as_found():
    torch.manual_seed(15)
    model = build_model("lenet5")
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 3.0)
    before = flat_parameters(model).clone()
    other_weights = torch.randn_like(before) * 0.05
    inputs, labels = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))

    summed = fast_clipped_sum(model, other_weights, inputs, labels, 1e6, 4)

    assert relative_error(summed, per_example_clipped_sum(model, other_weights, inputs, labels, 1e6, 6).double()) < (
        TOLERANCE
    )
    assert torch.equal(flat_parameters(model), before)
    assert all(torch.equal(parameter.grad, torch.full_like(parameter, 3.0)) for parameter in model.parameters())
    assert all(not module._forward_hooks for module in model.modules())


def test_each_chunk_is_clipped_on_its_own_examples():
    torch.manual_seed(16)
    model = build_model("gdp_cnn")
    weights = flat_parameters(model)
    inputs, labels = torch.rand(9, 1, 28, 28), torch.randint(0, 10, (9,))
    one_at_a_time = fast_clipped_sum(model, weights, inputs, labels, 0.05, 1)
    all_at_once = fast_clipped_sum(model, weights, inputs, labels, 0.05, 100)
    torch.testing.assert_close(one_at_a_time, all_at_once, rtol=1e-5, atol=1e-7)


@settings(max_examples=15, deadline=None)
@given(
    clip_norm=st.floats(min_value=1e-3, max_value=10.0),
    examples=st.integers(min_value=1, max_value=6),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_sum_of_clipped_gradients_is_bounded_by_count_times_clip_norm(clip_norm, examples, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 4))
    inputs = torch.randn(examples, 1, 6, 6) * 5
    labels = torch.randint(0, 4, (examples,))
    summed, norms = fast_clipped_sum(model, flat_parameters(model), inputs, labels, clip_norm, 4, return_norms=True)
    assert summed.norm().item() <= examples * clip_norm * (1 + 1e-5)
    clipped = torch.clamp(clip_norm / total_norms(norms), max=1.0) * total_norms(norms)
    assert torch.all(clipped <= clip_norm * (1 + 1e-6))


# --- the dispatcher and the worker


def test_dispatcher_runs_each_engine_and_names_the_valid_ones():
    torch.manual_seed(17)
    model = build_model("opacus_cnn")
    weights = flat_parameters(model)
    inputs, labels = torch.rand(5, 1, 28, 28), torch.randint(0, 10, (5,))
    sums = {engine: clipped_sum(engine, model, weights, inputs, labels, 0.1, 5) for engine in ENGINES}
    assert torch.equal(sums["vmap"], per_example_clipped_sum(model, weights, inputs, labels, 0.1, 5))
    assert relative_error(sums["fast"], sums["vmap"].double()) < TOLERANCE
    with pytest.raises(ValueError, match="engine must be one of 'fast', 'vmap' \\(got 'ghost'\\)"):
        clipped_sum("ghost", model, weights, inputs, labels, 0.1, 5)


def test_worker_takes_read_only_weights_without_copy_warnings_and_engines_agree():
    workers = {engine: GradientWorker("gdp_cnn", "mnist", 200, 64, engine=engine) for engine in ENGINES}
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    weights.flags.writeable = False  # as Ray's object store hands them out
    indices = np.arange(0, 200, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sums = {engine: worker.clipped_grad_sum(weights, indices, 0.1) for engine, worker in workers.items()}
    assert all(summed.dtype == np.float32 and summed.shape == weights.shape for summed in sums.values())
    assert relative_error(torch.from_numpy(sums["fast"]), torch.from_numpy(sums["vmap"]).double()) < TOLERANCE
    with pytest.raises(ValueError, match="engine must be one of"):
        GradientWorker("gdp_cnn", "mnist", 200, 64, engine="opacus")
