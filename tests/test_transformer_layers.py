"""The fast engine's rules for Hugging Face transformers' layers, recognised by name without importing transformers.

GPT-2's Conv1D is the Linear rule on a transposed weight; LlamaRMSNorm and its
kin are matched by class name and form, conservatively, and the rule check
catches a layer of that name and form whose forward computes something else.
The zoo (``tests/test_layer_zoo.py``) holds these layers, and tiny GPT-2 and
Llama models, to the per-example loop and the bound.
"""

import subprocess
import sys

import pytest
import torch
from torch import Tensor, nn

from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.engines import clipped_sum, engine_plan
from workers.layer_rules import instantiation_is_cheaper, rule_for
from workers.models import flat_parameters
from workers.transformer_rules import conv1d_rule, llama_rms_norm_rule

TOLERANCE = 1e-5  # relative error of a float32 engine against the float64 loop
BOUND_SLACK = 1e-6  # float32 rounding allowed on top of C for one example's contribution
WIDTH, LENGTH, CLASSES = 6, 4, 3

pytestmark = pytest.mark.filterwarnings("ignore:fast clipping engine")


class OnSequences(nn.Module):
    """A layer on [B, T, d] sequences, tanh, the mean over positions, a linear classifier."""

    def __init__(self, layer: nn.Module, width: int):
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(width, CLASSES)

    def forward(self, sequence: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(sequence)).mean(1))


@pytest.mark.parametrize(
    ("positions", "in_features", "out_features", "instantiated"),
    [(16, 5, 4, True), (2, 6, 8, False)],
)
def test_conv1d_is_the_linear_rule_on_the_transposed_weight_on_both_paths(positions, in_features, out_features,
                                                                          instantiated):
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D(out_features, in_features)
    assert instantiation_is_cheaper(positions, in_features, out_features) is instantiated
    torch.manual_seed(3)
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        conv1d.weight.copy_(linear.weight.T)
        conv1d.bias.copy_(linear.bias)
    inputs, labels = torch.randn(8, positions, in_features), torch.randint(0, CLASSES, (8,))
    results = {}
    for name, layer in (("conv1d", conv1d), ("linear", linear)):
        torch.manual_seed(4)
        model = OnSequences(layer, out_features)
        results[name] = clipped_sum("fast", model, flat_parameters(model), inputs, labels, 0.05, 5,
                                    return_norms=True)
        assert engine_plan(model).layers[0][1] == ("fast (per-example)" if instantiated else "fast (ghost)")
    (conv_sum, conv_norms), (linear_sum, linear_norms) = results["conv1d"], results["linear"]
    assert torch.allclose(conv_norms["layer.weight"], linear_norms["layer.weight"], rtol=1e-6)
    weights = out_features * in_features
    assert torch.allclose(conv_sum[:weights].view(in_features, out_features).T,
                          linear_sum[:weights].view(out_features, in_features), rtol=1e-5, atol=1e-7)
    assert torch.allclose(conv_sum[weights:], linear_sum[weights:], rtol=1e-5, atol=1e-7)


def test_transformers_layers_are_recognised_by_module_and_name_only():
    conv1d_type = pytest.importorskip("transformers.pytorch_utils").Conv1D
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    assert rule_for(conv1d_type(4, 3)) is conv1d_rule
    assert rule_for(llama.LlamaRMSNorm(4)) is llama_rms_norm_rule

    class Conv1D(conv1d_type):
        """Same name, another module: a subclass may compute anything, so it takes the vmap fallback."""

    assert rule_for(Conv1D(4, 3)) is None


class GemmaStyleRMSNorm(nn.Module):
    """(1 + weight) * x_hat with ``eps``: not LlamaRMSNorm's form."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = 1e-6

    def forward(self, x: Tensor) -> Tensor:
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class BiasedRMSNorm(GemmaStyleRMSNorm):
    """LlamaRMSNorm's attributes plus a bias."""

    def __init__(self, width: int):
        super().__init__(width)
        self.variance_epsilon = 1e-6
        self.bias = nn.Parameter(torch.zeros(width))


def test_rms_norms_of_another_form_take_the_vmap_fallback():
    assert rule_for(GemmaStyleRMSNorm(4)) is None
    assert rule_for(BiasedRMSNorm(4)) is None


class MisleadingRMSNorm(nn.Module):
    """LlamaRMSNorm's name and attributes, but it divides by the mean absolute value, not the root mean square."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.variance_epsilon = 1e-6

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.variance_epsilon)


def test_a_layer_that_only_looks_like_llama_rms_norm_is_caught_by_the_rule_check():
    # The rule matches by name and form; were it trusted, it would take the wrong per-example gradients.
    torch.manual_seed(6)
    model = OnSequences(nn.Sequential(nn.Linear(WIDTH, WIDTH), MisleadingRMSNorm(WIDTH)), WIDTH)
    assert rule_for(model.layer[1]) is llama_rms_norm_rule
    inputs, labels = torch.randn(6, LENGTH, WIDTH), torch.randint(0, CLASSES, (6,))
    weights = flat_parameters(model)
    gradients = per_example_gradients_by_loop(model, weights, inputs, labels)
    clip_norm = gradients.norm(dim=1).median().item()
    actual = clipped_sum("fast", model, weights, inputs, labels, clip_norm, 4)
    plan = engine_plan(model)
    assert plan.fallback is not None and "layer.1.weight" in plan.fallback
    assert relative_error(actual, clipped_sum_by_loop(gradients, clip_norm)) <= TOLERANCE
    for example in range(len(labels)):
        alone = clipped_sum("fast", model, weights, inputs[example : example + 1], labels[example : example + 1],
                            clip_norm, 4)
        assert alone.double().norm().item() <= clip_norm * (1 + BOUND_SLACK)


@pytest.mark.parametrize("transformers_present", [True, False])
def test_the_rules_register_without_importing_transformers(transformers_present):
    """Importing the engines loads no transformers, and without it (an import that fails) they load and run."""
    hide = "" if transformers_present else "sys.modules['transformers'] = None\n"
    script = (
        "import sys\n" + hide +
        "import torch\n"
        "from workers.engines import clipped_sum\n"
        "assert 'transformers' not in sys.modules or sys.modules['transformers'] is None\n"
        "model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.RMSNorm(4), torch.nn.Linear(4, 2))\n"
        "weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])\n"
        "total = clipped_sum('fast', model, weights, torch.randn(3, 3), torch.tensor([0, 1, 0]), 1.0, 3)\n"
        "assert total.norm().item() <= 3 * (1 + 1e-6)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
