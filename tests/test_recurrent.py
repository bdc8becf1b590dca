"""Recurrent layers and EmbeddingBag: both engines against a plain per-example loop in float64.

Every comparison clips at the median per-example norm of the loop, so some
examples are scaled down and some pass through unchanged, and requires the
clipped sum and each parameter's per-example norms to agree to 1e-5
relative. The fast engine must serve these models per layer (no whole-model
fallback) and neither engine may hand torch.func a fused recurrent kernel
(which it can only loop over, with a "performance drop" warning).
"""

import itertools
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from reference import clipped_sum_by_loop, per_example_gradients_by_loop, relative_error
from workers.engines import ENGINES, _units, fast_clipped_sum
from workers.layer_rules import vmap_rule
from workers.models import flat_parameters
from workers.recurrent import unrolled_forward, unrolled_recurrences
from workers.sequence_rules import embedding_bag_rule, recurrent_rule
from workers.vmap_engine import microbatch_clipped_sum

TOLERANCE = 1e-5
CELLS = {
    "rnn_tanh": (nn.RNN, {}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
    "gru": (nn.GRU, {}),
    "lstm": (nn.LSTM, {}),
}


def assert_engines_match_the_loop(model, inputs, labels, max_physical_batch=4, looped_kernels=False):
    """Clip at the loop's median norm; each engine's sum and per-parameter norms must match the loop's.

    Unless ``looped_kernels``, torch.func may not warn that it loops over examples for want of a batching rule.
    """
    weights = flat_parameters(model)
    gradients = per_example_gradients_by_loop(model, weights, inputs, labels)
    trainable = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    expected_norms = dict(zip([name for name, _ in trainable],
                              (block.norm(dim=1) for block in gradients.split([n for _, n in trainable], dim=1))))
    total = gradients.norm(dim=1)
    clip_norm = total.median().item()
    assert (total > clip_norm * (1 + 1e-4)).any() and (total <= clip_norm).any()
    expected = clipped_sum_by_loop(gradients, clip_norm)
    for engine in ENGINES:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fast clipping engine")  # no whole-model fallback
            warnings.filterwarnings("ignore" if looped_kernels else "error", message="There is a performance drop")
            summed, norms = ENGINES[engine](model, weights, inputs, labels, clip_norm, max_physical_batch,
                                            return_norms=True)
        assert relative_error(summed, expected) < TOLERANCE, engine
        for name, values in expected_norms.items():
            assert relative_error(norms[name], values) < TOLERANCE, (engine, name)


class Recurrent(nn.Module):
    """A recurrent layer on float sequences [B, T, features]; the head reads its output and final state.

    With ``initial_state`` the model computes h0 (and c0) from the input by a
    linear layer, so gradients also flow into the layer's initial state.
    """

    def __init__(self, cell, batch_first=True, num_layers=1, bidirectional=False, bias=True, initial_state=False,
                 features=3, hidden=4, proj_size=0, classes=3):
        super().__init__()
        layer_type, options = CELLS[cell]
        if proj_size:
            options = {**options, "proj_size": proj_size}
        self.batch_first, self.initial_state = batch_first, initial_state
        self.rnn = layer_type(features, hidden, num_layers=num_layers, bidirectional=bidirectional, bias=bias,
                              batch_first=batch_first, **options)
        self.states = num_layers * (2 if bidirectional else 1)
        self.hidden, self.output_size = hidden, proj_size or hidden
        self.lstm = layer_type is nn.LSTM
        if initial_state:
            self.initial = nn.Linear(features, self.states * (self.output_size + (hidden if self.lstm else 0)))
        width = self.output_size * (2 if bidirectional else 1) + self.states * self.output_size
        self.head = nn.Linear(width + (self.states * hidden if self.lstm else 0), classes)

    def forward(self, x):
        hx = None
        if self.initial_state:
            state = torch.tanh(self.initial(x.mean(1))).reshape(x.shape[0], self.states, -1).transpose(0, 1)
            hx = state.split([self.output_size, self.hidden], 2) if self.lstm else state
        output, final = self.rnn(x if self.batch_first else x.transpose(0, 1), hx)
        output = output if self.batch_first else output.transpose(0, 1)
        finals = final if self.lstm else (final,)
        return self.head(torch.cat([output.mean(1)] + [state.transpose(0, 1).flatten(1) for state in finals], 1))


def sequences(seed, examples=6, steps=5, features=3):
    torch.manual_seed(seed)
    return torch.randn(examples, steps, features), torch.randint(0, 3, (examples,))


@pytest.mark.parametrize(
    ("cell", "batch_first", "num_layers", "bidirectional"),
    list(itertools.product(CELLS, [True, False], [1, 2], [False, True])),
)
def test_recurrent_layers(cell, batch_first, num_layers, bidirectional):
    inputs, labels = sequences(1)
    model = Recurrent(cell, batch_first, num_layers, bidirectional)
    assert {type(unit.layer): unit.rule for unit in _units(model)}[type(model.rnn)] is recurrent_rule
    assert_engines_match_the_loop(model, inputs, labels)


@pytest.mark.parametrize("cell", CELLS)
def test_initial_state_passed_in_and_no_bias(cell):
    inputs, labels = sequences(2)
    model = Recurrent(cell, batch_first=False, num_layers=2, bidirectional=True, bias=False, initial_state=True)
    assert_engines_match_the_loop(model, inputs, labels)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_projected_lstm():
    inputs, labels = sequences(3)
    model = Recurrent("lstm", num_layers=2, bidirectional=True, initial_state=True, hidden=5, proj_size=3)
    assert_engines_match_the_loop(model, inputs, labels)


def test_layer_called_twice_and_frozen_weights():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(4, 4, batch_first=True)
            self.gru.weight_hh_l0.requires_grad_(False)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            first, _ = self.gru(x)
            _, final = self.gru(torch.tanh(first))
            return self.head(final[0])

    inputs, labels = sequences(4, features=4)
    assert_engines_match_the_loop(Twice(), inputs, labels)


def test_dropout_between_layers():
    """In eval mode the per-layer rule applies; in training mode the fast engine hands the model to the vmap engine."""
    inputs, labels = sequences(5)
    model = Recurrent("lstm", num_layers=2).eval()
    model.rnn.dropout = 0.5
    assert_engines_match_the_loop(model, inputs, labels)
    weights = flat_parameters(model)
    _, without_dropout = fast_clipped_sum(model, weights, inputs, labels, 0.1, 4, return_norms=True)
    model.train()
    with pytest.warns(UserWarning, match="dropout masks between its layers"):
        summed, with_dropout = fast_clipped_sum(model, weights, inputs, labels, 0.1, 4, return_norms=True)
    assert summed.norm() <= 0.1 * len(labels) * (1 + 1e-6)
    # The second layer's input weights see the dropped-out first layer.
    assert not torch.allclose(with_dropout["rnn.weight_ih_l1"], without_dropout["rnn.weight_ih_l1"])


def test_unrolled_forward_is_the_layer_forward_with_its_dropout():
    """Same outputs and final states as the fused kernel, dropout masks included (same seed, CPU)."""
    torch.manual_seed(6)
    for layer in (nn.GRU(3, 4, num_layers=3, dropout=0.4, bidirectional=True),
                  nn.LSTM(3, 4, num_layers=2, dropout=0.4, batch_first=True, proj_size=2),
                  nn.RNN(3, 4, num_layers=2, dropout=0.4, nonlinearity="relu")):
        layer = layer.double()
        inputs = torch.randn(5, 7, 3, dtype=torch.float64)
        for unbatched in (False, True):
            x = inputs[0] if unbatched else inputs
            torch.manual_seed(7)
            expected = torch.utils._pytree.tree_flatten(layer(x))[0]
            torch.manual_seed(7)
            actual = torch.utils._pytree.tree_flatten(unrolled_forward(layer, x))[0]
            for a, e in zip(actual, expected, strict=True):
                torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_unrolled_recurrences_restore_the_layers_and_see_substituted_weights():
    model = Recurrent("gru", bidirectional=True)
    inputs, _ = sequences(8)
    doubled = {name: 2 * parameter.detach() for name, parameter in model.rnn.named_parameters()}
    expected = torch.func.functional_call(model.rnn, doubled, (inputs,))[0]
    with unrolled_recurrences(model):
        assert model.rnn.forward.func is unrolled_forward
        actual = torch.func.functional_call(model.rnn, doubled, (inputs,))[0]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert "forward" not in model.rnn.__dict__


def test_microbatches_of_a_recurrent_model_match_the_loop():
    inputs, labels = sequences(9)
    model = Recurrent("lstm", bidirectional=True)
    weights = flat_parameters(model)
    group_ids = torch.tensor([0, 0, 1, 1, 1, 2])
    summed = microbatch_clipped_sum(model, weights, inputs, labels, group_ids, 1e9)
    # A microbatch's gradient is that of its mean loss.
    sizes = torch.bincount(group_ids).double()[group_ids]
    expected = (per_example_gradients_by_loop(model, weights, inputs, labels) / sizes[:, None]).sum(0)
    assert relative_error(summed, expected) < TOLERANCE


def test_packed_sequences_are_refused_with_the_fix():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(3, 4, batch_first=True)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            lengths = torch.full((x.shape[0],), x.shape[1])
            _, final = self.gru(pack_padded_sequence(x, lengths, batch_first=True))
            return self.head(final[0])

    model = Packed()
    inputs, labels = sequences(10)
    for engine in ENGINES.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match="PackedSequence.*pass the padded batch"):
                engine(model, flat_parameters(model), inputs, labels, 1.0, 4)


# --- EmbeddingBag


class Bags(nn.Module):
    """Token ids [B, L] (0 is padding where ``padding_idx`` is 0) into one bag per example, then a head.

    ``layout`` "rows" passes the [B, L] ids, "offsets" the flattened ids with
    one offset per example. With ``weighted`` each entry is weighted by a
    fixed function of its token id.
    """

    def __init__(self, mode, layout="rows", weighted=False, padding_idx=None, vocabulary=7, width=5):
        super().__init__()
        self.layout, self.weighted = layout, weighted
        self.bag = nn.EmbeddingBag(vocabulary, width, mode=mode, padding_idx=padding_idx)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens):
        weights = (tokens % 3 + 1).to(self.bag.weight.dtype) / 3 if self.weighted else None
        if self.layout == "rows":
            bagged = self.bag(tokens, per_sample_weights=weights)
        else:
            offsets = torch.arange(0, tokens.numel(), tokens.shape[1])
            bagged = self.bag(tokens.reshape(-1), offsets, None if weights is None else weights.reshape(-1))
        return self.head(torch.tanh(bagged))


@pytest.mark.parametrize(
    ("mode", "layout", "weighted", "padding_idx"),
    [("sum", "rows", False, None), ("mean", "rows", False, None), ("sum", "offsets", False, None),
     ("mean", "offsets", False, 0), ("sum", "rows", True, None), ("sum", "offsets", True, 0),
     ("sum", "rows", False, 0), ("mean", "rows", False, 0)],
)
def test_embedding_bag(mode, layout, weighted, padding_idx):
    torch.manual_seed(11)
    model = Bags(mode, layout, weighted, padding_idx)
    assert {type(unit.layer): unit.rule for unit in _units(model)}[nn.EmbeddingBag] is embedding_bag_rule
    tokens = torch.randint(0, 7, (8, 6))  # few ids: repeats within a bag, padding in most
    tokens[0] = 0  # with padding_idx 0: an example whose bag is empty
    # torch.func has no batching rule for embedding_bag; the vmap engine loops over examples there.
    assert_engines_match_the_loop(model, tokens, torch.randint(0, 3, (8,)), looped_kernels=True)


def test_embedding_bag_max_takes_the_per_module_fallback():
    torch.manual_seed(12)
    model = Bags("max")
    assert {type(unit.layer): unit.rule for unit in _units(model)}[nn.EmbeddingBag] is vmap_rule
    assert_engines_match_the_loop(model, torch.randint(0, 7, (8, 6)), torch.randint(0, 3, (8,)), looped_kernels=True)
