"""nn.RNN, nn.GRU and nn.LSTM unrolled over time in plain torch operations: one implementation for both engines.

PyTorch runs a recurrent layer as one fused kernel. torch.func has no batching
rule for it (vmap fails or loops over examples), and the kernel hides the two
matrix products of every time step, whose inputs and output gradients the
fast engine needs. ``unroll`` computes the same function step by step:
PyTorch's equations and gate order (RNN: tanh or relu; GRU: r, z, n; LSTM: i,
f, g, o, with the optional projection), its weight names, both directions,
stacked layers, and dropout between layers in training mode, drawn as PyTorch
draws it (on the time-major layer output, after each layer but the last).

Optionally it adds zero "taps" (leaves that require grad) to each direction's
input-to-hidden products x_t W_ih^T + b_ih (all time steps at once), its
hidden-to-hidden products h_{t-1} W_hh^T + b_hh (per step) and, for a
projected LSTM, its projections m_t W_hr^T (per step), so that one backward
pass through the unrolled layer yields the loss gradient at each product.

The vmap engine runs the layers through ``unrolled_forward`` (see
``unrolled_recurrences``); the fast engine's rule re-runs ``unroll`` with taps
on each recorded call (``workers.sequence_rules``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

RECURRENT_TYPES: tuple[type[nn.RNNBase], ...] = (nn.RNN, nn.GRU, nn.LSTM)
"""The layer types ``unroll`` implements, exactly (a subclass may override forward, so it is not covered)."""

State = Tensor | tuple[Tensor, Tensor]
"""A recurrent state: h, or (h, c) for an LSTM; [B, H] for one direction, [L * D, B, H] for the whole layer."""


@dataclass
class DirectionTrace:
    """What one direction of one layer multiplied its weights with in an unrolled run, and the taps on the products.

    All tensors are time-major, in sequence order (also for the reverse
    direction): ``inputs`` [T, B, d] multiplies W_ih; ``previous_hidden``
    [T, B, H_out] (h_{t-1} at step t, the initial state at the first step)
    multiplies W_hh; ``cell_outputs`` [T, B, H] (o_t * tanh(c_t)) multiplies
    W_hr of a projected LSTM and is None otherwise. The taps, when asked for,
    are the zero leaves added to those products, shaped like them:
    ``input_tap`` and ``hidden_tap`` [T, B, G * H] for G gates,
    ``projection_tap`` [T, B, H_out].
    """

    inputs: Tensor
    previous_hidden: Tensor
    cell_outputs: Tensor | None
    input_tap: Tensor | None
    hidden_tap: Tensor | None
    projection_tap: Tensor | None

    def taps(self) -> list[Tensor]:
        """The taps this direction has, in a fixed order: input, hidden, projection."""
        return [tap for tap in (self.input_tap, self.hidden_tap, self.projection_tap) if tap is not None]


@dataclass
class Unrolled:
    """The result of ``unroll``: the layer's outputs as the layer returns them, and a trace per direction.

    ``traces`` is keyed by the weight-name suffix of the direction: "_l0",
    "_l0_reverse", "_l1", ...
    """

    output: Tensor
    final_state: State
    traces: dict[str, DirectionTrace] = field(default_factory=dict)


def _cell(mode: str, input_product: Tensor, hidden_product: Tensor, state: State) -> tuple[Tensor, State]:
    """One time step of a layer in ``mode`` (nn.RNNBase.mode: "RNN_TANH", "RNN_RELU", "GRU" or "LSTM").

    From the step's two products [B, G * H]: (h_t before any projection, the
    new state without projection).
    """
    if mode == "RNN_TANH":
        hidden = torch.tanh(input_product + hidden_product)
        return hidden, hidden
    if mode == "RNN_RELU":
        hidden = torch.relu(input_product + hidden_product)
        return hidden, hidden
    if mode == "GRU":
        input_reset, input_update, input_new = input_product.chunk(3, 1)
        hidden_reset, hidden_update, hidden_new = hidden_product.chunk(3, 1)
        reset = torch.sigmoid(input_reset + hidden_reset)
        update = torch.sigmoid(input_update + hidden_update)
        new = torch.tanh(input_new + reset * hidden_new)
        hidden = (1 - update) * new + update * state
        return hidden, hidden
    input_gate, forget_gate, cell_gate, output_gate = (input_product + hidden_product).chunk(4, 1)
    _, cell = state
    cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(input_gate) * torch.tanh(cell_gate)
    hidden = torch.sigmoid(output_gate) * torch.tanh(cell)
    return hidden, (hidden, cell)


def _zero_tap(like: Tensor) -> Tensor:
    return torch.zeros_like(like, requires_grad=True)


def _direction(
    mode: str, weights: Mapping[str, Tensor], suffix: str, inputs: Tensor, state: State, reverse: bool, taps: bool
) -> tuple[Tensor, State, DirectionTrace]:
    """One direction of one layer over a time-major input [T, B, d]: (its outputs [T, B, H_out], final state, trace)."""
    input_products = F.linear(inputs, weights[f"weight_ih{suffix}"], weights.get(f"bias_ih{suffix}"))
    weight_hh, bias_hh = weights[f"weight_hh{suffix}"], weights.get(f"bias_hh{suffix}")
    projection = weights.get(f"weight_hr{suffix}")
    input_tap = hidden_tap = projection_tap = None
    if taps:
        input_tap = _zero_tap(input_products)
        input_products = input_products + input_tap
        hidden_tap = _zero_tap(input_products)
        if projection is not None:
            projection_tap = _zero_tap(input_products[..., : projection.shape[0]])
    # unbind, not indexing per step: its backward stacks the T step gradients
    # once, where indexing would add a full [T, ...] zero tensor per step.
    input_steps = input_products.unbind(0)
    hidden_tap_steps = hidden_tap.unbind(0) if taps else None
    projection_tap_steps = projection_tap.unbind(0) if projection_tap is not None else None
    steps = len(input_steps)
    outputs: list[Tensor | None] = [None] * steps
    previous_hidden: list[Tensor | None] = [None] * steps
    cell_outputs: list[Tensor | None] = [None] * steps
    for step in range(steps - 1, -1, -1) if reverse else range(steps):
        hidden = state[0] if mode == "LSTM" else state
        previous_hidden[step] = hidden
        hidden_product = F.linear(hidden, weight_hh, bias_hh)
        if taps:
            hidden_product = hidden_product + hidden_tap_steps[step]
        output, state = _cell(mode, input_steps[step], hidden_product, state)
        if projection is not None:
            cell_outputs[step] = output
            output = F.linear(output, projection)
            if projection_tap_steps is not None:
                output = output + projection_tap_steps[step]
            state = (output, state[1])
        outputs[step] = output
    trace = DirectionTrace(
        inputs, torch.stack(previous_hidden), torch.stack(cell_outputs) if projection is not None else None,
        input_tap, hidden_tap, projection_tap,
    )
    return torch.stack(outputs), state, trace


def unroll(
    layer: nn.RNNBase, weights: Mapping[str, Tensor], inputs: Tensor, initial_state: State | None = None,
    taps: bool = False,
) -> Unrolled:
    """Run ``layer`` (nn.RNN, nn.GRU or nn.LSTM) step by step with ``weights`` in place of its parameters.

    ``layer`` gives only its configuration (and ``training``, for dropout
    between layers); ``weights`` maps its parameter names (weight_ih_l0,
    bias_hh_l1_reverse, ...) to tensors. ``inputs`` and ``initial_state`` are
    batched, as the layer takes them: [B, T, d] with ``batch_first``, else
    [T, B, d]; h0 (and c0) [L * D, B, H_out] or None for zeros. With ``taps``
    each direction's trace carries zero leaves on its products (see
    ``DirectionTrace``); the result is the same.
    """
    mode = layer.mode
    sequence = inputs.transpose(0, 1) if layer.batch_first else inputs
    directions = 2 if layer.bidirectional else 1
    if initial_state is None:
        initial_state = zero_state(layer, sequence.shape[1], sequence)
    final_states: list[State] = []
    traces: dict[str, DirectionTrace] = {}
    for depth in range(layer.num_layers):
        if depth > 0 and layer.training and layer.dropout > 0:
            sequence = F.dropout(sequence, layer.dropout, training=True)
        direction_outputs = []
        for direction in range(directions):
            suffix = f"_l{depth}" + ("_reverse" if direction else "")
            index = depth * directions + direction
            state = (
                (initial_state[0][index], initial_state[1][index]) if mode == "LSTM" else initial_state[index]
            )
            output, state, traces[suffix] = _direction(mode, weights, suffix, sequence, state, bool(direction), taps)
            direction_outputs.append(output)
            final_states.append(state)
        sequence = torch.cat(direction_outputs, 2) if directions == 2 else direction_outputs[0]
    output = sequence.transpose(0, 1) if layer.batch_first else sequence
    if mode == "LSTM":
        final_state = (torch.stack([h for h, _ in final_states]), torch.stack([c for _, c in final_states]))
    else:
        final_state = torch.stack(final_states)
    return Unrolled(output, final_state, traces)


def layer_weights(layer: nn.RNNBase) -> dict[str, Tensor]:
    """The layer's weights by name, as the layer holds them now (``functional_call`` substitutes them by name)."""
    return {name: getattr(layer, name) for name in layer._flat_weights_names}


def unrolled_forward(layer: nn.RNNBase, input: Tensor, hx: State | None = None) -> tuple[Tensor, State]:
    """``layer.forward`` computed by ``unroll``: same arguments (batched or unbatched, not packed), same result."""
    if isinstance(input, PackedSequence):
        raise ValueError(
            f"{type(layer).__name__} is given a PackedSequence, for which per-example gradients are not "
            "implemented; pass the padded batch [B, T, d] (batch_first) instead and pick each example's "
            "last valid output by its length"
        )
    batched = input.dim() == 3
    if not batched:
        input = input.unsqueeze(0 if layer.batch_first else 1)
        if hx is not None:
            hx = tuple(state.unsqueeze(1) for state in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
    if hx is None:
        hx = zero_state(layer, input.shape[0 if layer.batch_first else 1], input)
    layer.check_forward_args(input, hx, None)
    result = unroll(layer, layer_weights(layer), input, hx)
    output, final_state = result.output, result.final_state
    if not batched:
        output = output.squeeze(0 if layer.batch_first else 1)
        final_state = (
            tuple(state.squeeze(1) for state in final_state) if isinstance(final_state, tuple)
            else final_state.squeeze(1)
        )
    return output, final_state


def zero_state(layer: nn.RNNBase, batch_size: int, like: Tensor) -> State:
    """The layer's default initial state: zeros [L * D, batch_size, H_out] (and [L * D, batch_size, H] for c0)."""
    shape = (layer.num_layers * (2 if layer.bidirectional else 1), batch_size)
    hidden = like.new_zeros(*shape, layer.proj_size or layer.hidden_size)
    return (hidden, like.new_zeros(*shape, layer.hidden_size)) if layer.mode == "LSTM" else hidden


@contextlib.contextmanager
def unrolled_recurrences(model: nn.Module) -> Iterator[None]:
    """While open, every nn.RNN, nn.GRU and nn.LSTM in ``model`` runs ``unrolled_forward``; restored on exit.

    torch.func (vmap over examples) can batch the unrolled operations, not
    PyTorch's fused recurrent kernels. Only the module instances' ``forward``
    attribute changes; parameters, hooks and the modules' classes stay.
    """
    layers = [module for module in model.modules() if type(module) in RECURRENT_TYPES]
    previous = [module.__dict__.get("forward") for module in layers]
    for module in layers:
        module.forward = functools.partial(unrolled_forward, module)
    try:
        yield
    finally:
        for module, forward in zip(layers, previous, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
