"""The fast engine's rule check holds for every batch: models that mix examples, tensors that only look batched.

The check runs on synthetic examples of the data's schema, at least 2 of them,
so a first Poisson step of one example decides nothing. Each test plays the
attacker of the add/remove bound: the sum over a batch minus the sum without
example j must have norm <= C for every j, in every engine, or the engine
refuses the model. Tables shared by all examples ([T, D], ``arange(T)``
lookups) must not be read as T examples when a chunk holds exactly T.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.engines import (ENGINES, ExampleSchema, check_rules, clipped_sum, engine_plan, prepare_engine,
                             settle_plan, synthetic_examples)
from workers.layer_rules import register_rule
from workers.models import flat_parameters
from workers.validation import UnsupportedModuleError

TOLERANCE = 1e-5  # relative error of a float32 engine against the float64 loop
BOUND_SLACK = 1e-6  # float32 rounding allowed on top of C for one example's contribution
FEATURES, LENGTH, CLASSES, VOCAB, WIDTH = 6, 4, 3, 11, 6

pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop"),
    pytest.mark.filterwarnings("ignore:fast clipping engine"),
]


def largest_contribution(engine, model, inputs, labels, clip_norm, max_physical_batch):
    """max over j of ||S(B) - S(B without j)|| / C, each sum from the engine."""
    weights = flat_parameters(model)
    everyone = clipped_sum(engine, model, weights, inputs, labels, clip_norm, max_physical_batch).double()
    largest = 0.0
    for example in range(len(labels)):
        keep = torch.arange(len(labels)) != example
        without = clipped_sum(engine, model, weights, inputs[keep], labels[keep], clip_norm, max_physical_batch)
        largest = max(largest, (everyone - without.double()).norm().item() / clip_norm)
    return largest


# ---------------------------------------------------------------------------
# Models that mix examples, and one whose layers see the batch off dimension 0


class BatchCentring(nn.Module):
    """Parameter-free: each example minus the batch's mean."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0, keepdim=True)


class BatchSoftmax(nn.Module):
    """Parameter-free: a softmax over the examples of the batch."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(x, dim=0)


class MeanOverPositions(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


class SequenceFirst(nn.Module):
    """Runs ``inner`` on [T, B, F]: its layers see the batch along dimension 1, and nothing is mixed."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.transpose(0, 1)).transpose(0, 1)


FAMILIES = {
    "attention across dimension 0": lambda: nn.Sequential(
        nn.TransformerEncoderLayer(FEATURES, 2, 8, dropout=0.0, batch_first=False), MeanOverPositions(),
        nn.Linear(FEATURES, CLASSES)),
    "batch centring": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(LENGTH * FEATURES, 8), BatchCentring(), nn.Tanh(), nn.Linear(8, CLASSES)),
    "batch off dimension 0": lambda: nn.Sequential(
        SequenceFirst(nn.Sequential(nn.Linear(FEATURES, 8), nn.LayerNorm(8))), nn.Tanh(), MeanOverPositions(),
        nn.Linear(8, CLASSES)),
    "softmax across the batch": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(LENGTH * FEATURES, 8), BatchSoftmax(), nn.Linear(8, CLASSES)),
}
MIXING = {"attention across dimension 0": "0.self_attn (MultiheadAttention)", "batch centring": "2 (BatchCentring)",
          "softmax across the batch": "2 (BatchSoftmax)"}


# A sequence of one as well for attention: attention over dimension 1 then sees one "example" per step.
CASES = [(family, length) for family in FAMILIES
         for length in ((1, LENGTH) if family == "attention across dimension 0" else (LENGTH,))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("family", "length"), CASES)
def test_after_a_first_step_of_one_example_every_engine_refuses_or_keeps_the_bound(family, length, engine):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    inputs, labels = torch.randn(6, length, FEATURES), torch.randint(0, CLASSES, (6,))
    weights = flat_parameters(model)
    clip_norm = 2.0  # clips some examples of these models and not others
    try:
        clipped_sum(engine, model, weights, inputs[:1], labels[:1], clip_norm, 4)
        largest = largest_contribution(engine, model, inputs, labels, clip_norm, 4)
    except UnsupportedModuleError as refusal:
        assert engine == "fast" and family in MIXING
        assert f"{MIXING[family]} mixes examples within a batch" in str(refusal) and "Fix: " in str(refusal)
        return
    assert family not in MIXING or engine == "vmap", f"{engine} engine did not refuse a model that mixes examples"
    assert largest <= 1 + BOUND_SLACK, f"{engine} engine: one example moves the sum by {largest:.6f} C"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_worker_refuses_a_model_that_mixes_examples_before_any_step_in_every_engine(engine):
    schema = ExampleSchema((LENGTH, FEATURES), torch.float32, (), torch.int64)
    with pytest.raises(UnsupportedModuleError, match=r"^2 \(BatchSoftmax\) mixes examples within a batch"):
        prepare_engine(engine, FAMILIES["softmax across the batch"](), schema, F.cross_entropy)


def test_the_batch_off_dimension_0_runs_every_layer_on_vmap_and_says_why():
    torch.manual_seed(1)
    model = FAMILIES["batch off dimension 0"]()
    inputs, labels = synthetic_examples(model, ExampleSchema((LENGTH, FEATURES), torch.float32, (), torch.int64), 4)
    plan = check_rules(model, flat_parameters(model), inputs, labels, F.cross_entropy)
    assert plan.fallback == ("the layer rules do not reproduce autograd's per-example gradient of 0.inner.0.weight, "
                             "0.inner.0.bias, 0.inner.1.weight, 0.inner.1.bias")


def test_the_check_needs_two_examples_and_sees_none_of_the_data():
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="at least 2 examples"):
        check_rules(model, flat_parameters(model), torch.randn(1, 3), torch.zeros(1, dtype=torch.int64),
                    F.cross_entropy)
    schema = ExampleSchema((3,), torch.float32, (), torch.int64)
    inputs, labels = synthetic_examples(model, schema, 4)
    again, _ = synthetic_examples(model, schema, 4)
    assert torch.equal(inputs, again) and len({tuple(row.tolist()) for row in inputs}) == 4
    assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() < 2


def test_a_plan_is_settled_per_example_shape_and_rechecked_when_it_changes():
    torch.manual_seed(2)
    model = PositionalModel()
    weights = flat_parameters(model)
    for length in (8, 9):
        tokens = torch.randint(0, VOCAB, (3, length))
        clipped_sum("fast", model, weights, tokens, torch.randint(0, CLASSES, (3,)), 1.0, 2)
        assert engine_plan(model).fallback == (
            f"positions (Embedding) is applied to a tensor of shape ({length},) that is not computed from the batch "
            "(a table or constant shared by all examples)"
        )
    model = TableModel(8)
    plan = settle_plan(model, flat_parameters(model), ExampleSchema((8, FEATURES), torch.float32, (), torch.int64),
                       F.cross_entropy)
    assert plan.fallback is None and "mix (AddTable): vmap (fallback: no book-keeping rule for AddTable)" in \
        plan.describe()


# ---------------------------------------------------------------------------
# A rule that raises


class BrokenLinear(nn.Linear):
    """A Linear whose registered rule raises, as a rule with a bug would."""


@register_rule(BrokenLinear)
def broken_linear_rule(layer, params, calls, batch_size):
    """Raises: a rule with a bug."""
    raise RuntimeError("shape '[4, -1]' is invalid for input of size 9")


def test_a_rule_that_raises_hands_the_model_to_vmap_with_one_warning_naming_it():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), BrokenLinear(4, 3))
    inputs, labels = torch.randn(6, 5), torch.randint(0, 3, (6,))
    weights = flat_parameters(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = clipped_sum("fast", model, weights, inputs, labels, 0.1, 4)
        clipped_sum("fast", model, weights, inputs, labels, 0.1, 4)
    reason = "the rule for 2 (BrokenLinear) failed (RuntimeError: shape '[4, -1]' is invalid for input of size 9)"
    assert [str(warning.message) for warning in caught if "fast clipping engine" in str(warning.message)] == [
        f"fast clipping engine: {reason}; computing this model's clipped sum with the vmap engine"
    ]
    assert engine_plan(model).fallback == reason
    assert torch.equal(actual, clipped_sum("vmap", model, weights, inputs, labels, 0.1, 4))


# ---------------------------------------------------------------------------
# Tables shared by all examples


class AddTable(nn.Module):
    """A module with a parameter of its own (the per-module vmap rule) given a shared [T, D] table."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width))
        self.shift = nn.Parameter(torch.randn(width))

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        return x * self.scale + table * self.shift


class TableModel(nn.Module):
    """Features into width D, plus a positional [T, D] buffer through a module with parameters, then classes."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.front = nn.Linear(FEATURES, WIDTH)
        self.register_buffer("table", torch.randn(length, WIDTH))
        self.mix = AddTable(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.front(x), self.table)).mean(1))


class PositionalModel(nn.Module):
    """Token and position embeddings, the positions looked up with a 1-D ``arange(T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(16, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(torch.tanh(self.tokens(tokens) + positions).mean(1))


def clip_norm_between_middle_norms(gradients: Tensor) -> float:
    norms = gradients.norm(dim=1).sort().values
    return ((norms[len(norms) // 2 - 1] + norms[len(norms) // 2]) / 2).item()


@pytest.mark.parametrize("kind", ["table", "positions"])
@pytest.mark.parametrize("length", [8, 9])
def test_shared_tables_are_exact_and_bounded_for_every_chunk_size(kind, length):
    torch.manual_seed(length)
    examples = length + 2
    if kind == "table":
        model, inputs = TableModel(length), torch.randn(examples, length, FEATURES)
    else:
        model, inputs = PositionalModel(), torch.randint(0, VOCAB, (examples, length))
    labels = torch.randint(0, CLASSES, (examples,))
    gradients = per_example_gradients_by_loop(model, flat_parameters(model), inputs, labels)
    clip_norm = clip_norm_between_middle_norms(gradients)
    expected = clipped_sum_by_loop(gradients, clip_norm)
    for engine in ENGINES:
        # A chunk of exactly `length` examples is the one a shape-based guess reads the table as examples in.
        for max_physical_batch in range(1, length + 2):
            actual = clipped_sum(engine, model, flat_parameters(model), inputs, labels, clip_norm, max_physical_batch)
            error = relative_error(actual, expected)
            assert error <= TOLERANCE, f"{engine}, chunks of {max_physical_batch}: relative error {error:.3g}"
        largest = largest_contribution(engine, model, inputs, labels, clip_norm, length)
        assert largest <= 1 + BOUND_SLACK, f"{engine} engine: one example moves the sum by {largest:.6f} C"


# ---------------------------------------------------------------------------
# Random models of the supported layers


class RandomSequenceModel(nn.Module):
    """Tokens or features into width W, then layers drawn from the supported ones, with optional positions."""

    def __init__(self, tokens: bool, positions: str, kinds: list[str], length: int) -> None:
        super().__init__()
        self.front = nn.Embedding(VOCAB, WIDTH) if tokens else nn.Linear(FEATURES, WIDTH)
        self.positions = positions
        if positions == "lookup":
            self.position_embedding = nn.Embedding(length, WIDTH)
        elif positions == "table":
            self.register_buffer("table", torch.randn(length, WIDTH))
            self.mix = AddTable(WIDTH)
        layers = {
            "linear": lambda: nn.Linear(WIDTH, WIDTH),
            "layer_norm": lambda: nn.LayerNorm(WIDTH),
            "attention": lambda: nn.TransformerEncoderLayer(WIDTH, 2, WIDTH + 2, dropout=0.0, batch_first=True),
            "gru": lambda: nn.GRU(WIDTH, WIDTH, batch_first=True),
        }
        self.layers = nn.ModuleList([layers[kind]() for kind in kinds])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        sequence = self.front(x)
        if self.positions == "lookup":
            sequence = sequence + self.position_embedding(torch.arange(x.shape[1], device=x.device))
        elif self.positions == "table":
            sequence = self.mix(sequence, self.table)
        for layer in self.layers:
            sequence = layer(sequence)
            sequence = torch.tanh(sequence[0] if isinstance(sequence, tuple) else sequence)
        return self.head(sequence.mean(1))


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          report_multiple_bugs=False)
@given(
    tokens=st.booleans(),
    positions=st.sampled_from(["none", "lookup", "table"]),
    kinds=st.lists(st.sampled_from(["linear", "layer_norm", "attention", "gru"]), max_size=2),
    length=st.integers(min_value=2, max_value=5),
    examples=st.integers(min_value=2, max_value=6),
    max_physical_batch=st.integers(min_value=1, max_value=6),
    clip_quantile=st.floats(min_value=0.1, max_value=0.9),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_random_models_match_the_loop_and_keep_the_bound(
    tokens, positions, kinds, length, examples, max_physical_batch, clip_quantile, seed
):
    torch.manual_seed(seed)
    model = RandomSequenceModel(tokens, positions, kinds, length)
    inputs = torch.randint(0, VOCAB, (examples, length)) if tokens else torch.randn(examples, length, FEATURES)
    labels = torch.randint(0, CLASSES, (examples,))
    gradients = per_example_gradients_by_loop(model, flat_parameters(model), inputs, labels)
    clip_norm = torch.quantile(gradients.norm(dim=1), clip_quantile).item()
    actual = clipped_sum("fast", model, flat_parameters(model), inputs, labels, clip_norm, max_physical_batch)
    error = relative_error(actual, clipped_sum_by_loop(gradients, clip_norm))
    assert error <= TOLERANCE, f"fast engine on {positions}, {kinds}: relative error {error:.3g} against the loop"
    largest = largest_contribution("fast", model, inputs, labels, clip_norm, max_physical_batch)
    assert largest <= 1 + BOUND_SLACK, f"fast engine on {positions}, {kinds}: one example moves the sum by {largest} C"
