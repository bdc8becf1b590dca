"""Fast-engine rules for the layers of sequence models: nn.RNN, nn.GRU, nn.LSTM and nn.EmbeddingBag.

Registered with ``workers.layer_rules``' registry when imported; ``workers.engines`` imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_map

from workers.layer_rules import (
    LayerCall,
    ParameterGradients,
    WholeModelFallback,
    instantiated,
    outer_product_gradients,
    register_rule,
)
from workers.recurrent import RECURRENT_TYPES, Unrolled, layer_weights, unroll, zero_state


def recurrent_rule(
    layer: nn.RNNBase, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """nn.RNN, nn.GRU, nn.LSTM (any layers, directions, bias, projection, initial state): products over time.

    Each recorded call is re-run by ``workers.recurrent.unroll`` with zero taps
    on every matrix product, and the recorded output gradients (output and
    final state) are back-propagated to the taps once. A weight's per-example
    gradient is then sum_t g_t a_t^T over the time steps (and calls), with g_t
    the gradient at its product and a_t what it multiplied: ghost norm or
    instantiation by the usual cost rule. A bias gradient is sum_t g_t.
    """
    if layer.training and layer.dropout > 0 and layer.num_layers > 1:
        raise WholeModelFallback(
            f"{type(layer).__name__} draws dropout masks between its layers in training mode, which a re-run "
            "of the layer cannot reproduce"
        )
    weights = layer_weights(layer) | dict(params)
    gradients: dict[str, list[Tensor]] = {name: [] for name in params}  # per call, [T, B, out]
    activations: dict[str, list[Tensor]] = {name: [] for name in params if name.startswith("weight")}
    for call in calls:
        unrolled, tap_gradients = _unrolled_with_tap_gradients(layer, weights, call, batch_size)
        for suffix, trace in unrolled.traces.items():
            for prefix, activation, tap in (
                ("ih", trace.inputs, trace.input_tap),
                ("hh", trace.previous_hidden, trace.hidden_tap),
                ("hr", trace.cell_outputs, trace.projection_tap),
            ):
                if tap is None:
                    continue
                for kind in ("weight", "bias"):
                    name = f"{kind}_{prefix}{suffix}"
                    if name in params:
                        gradients[name].append(tap_gradients[tap])
                        if kind == "weight":
                            activations[name].append(activation.detach())
    result = {}
    for name, per_call in gradients.items():
        if name in activations:
            shape = params[name].shape
            # Batch-major copies: the products below then run on plain (transposed) matrices,
            # and the ghost clipped sum views the [p, B * T] gradients without a copy.
            output_grads = torch.cat(per_call).transpose(0, 1).contiguous()
            result[name] = outer_product_gradients(
                output_grads.transpose(1, 2).unsqueeze(1),
                torch.cat(activations[name]).transpose(0, 1).contiguous().unsqueeze(1),
                lambda summed, shape=shape: summed.view(shape),
            )
        else:
            result[name] = instantiated(sum(gradient.sum(0) for gradient in per_call))
    return result


def _unrolled_with_tap_gradients(
    layer: nn.RNNBase, weights: Mapping[str, Tensor], call: LayerCall, batch_size: int
) -> tuple[Unrolled, dict[Tensor, Tensor]]:
    """Re-run one call with taps; the gradient of the summed loss at each tap, keyed by the tap."""
    arguments = dict(zip(("input", "hx"), call.args)) | call.kwargs
    inputs, initial_state = arguments["input"], arguments.get("hx")
    name = type(layer).__name__
    if isinstance(inputs, PackedSequence):
        raise WholeModelFallback(f"{name} is given a PackedSequence")
    if inputs.dim() != 3 or inputs.shape[0 if layer.batch_first else 1] != batch_size:
        raise WholeModelFallback(
            f"{name} is given an input of shape {tuple(inputs.shape)} without the batch of {batch_size} along "
            f"dimension {0 if layer.batch_first else 1}"
        )
    if initial_state is None:
        initial_state = zero_state(layer, batch_size, inputs)
    # The rule differentiates the re-run alone, not back into the layers that produced its arguments.
    initial_state = tree_map(Tensor.detach, initial_state)
    with torch.enable_grad():
        unrolled = unroll(layer, weights, inputs.detach(), initial_state, taps=True)
        taps = [tap for trace in unrolled.traces.values() for tap in trace.taps()]
        outputs = tree_flatten((unrolled.output, unrolled.final_state))[0]
        recorded = [(output, slot.grad) for output, slot in zip(outputs, call.outputs, strict=True)
                    if slot is not None and slot.grad is not None]
        if recorded:
            tap_gradients = torch.autograd.grad(
                [output for output, _ in recorded], taps, [gradient for _, gradient in recorded],
                allow_unused=True, materialize_grads=True,
            )
        else:  # the loss does not depend on this call
            tap_gradients = [torch.zeros_like(tap) for tap in taps]
    return unrolled, dict(zip(taps, tap_gradients, strict=True))


for _recurrent_type in RECURRENT_TYPES:
    register_rule(_recurrent_type)(recurrent_rule)


@register_rule(
    nn.EmbeddingBag,
    supports=lambda layer: layer.mode in ("sum", "mean") and layer.max_norm is None and not layer.scale_grad_by_freq,
)
def embedding_bag_rule(
    layer: nn.EmbeddingBag, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """EmbeddingBag (sum or mean; [B, L] bags or 1-D with offsets; per-sample weights; padding) by its rows.

    Example i's gradient has one non-zero row per distinct index v in its
    bags: sum over its entries j with index v of c_j g_i, for g_i the output
    gradient of its bag and c_j the entry's weight (per-sample weight, or
    1 / bag size for mean; 0 for padding). Only those rows are formed, never
    the [num_embeddings, embedding_dim] gradient.
    """
    entries = [_bag_entries(layer, call, batch_size) for call in calls]
    examples = torch.cat([example for example, _, _ in entries])
    indices = torch.cat([index for _, index, _ in entries])
    contributions = torch.cat([
        coefficient.unsqueeze(1).to(call.output_grad.dtype) * call.output_grad[example]
        for call, (example, _, coefficient) in zip(calls, entries, strict=True)
    ])
    # Entries of one example with one index add up to one row of its gradient.
    rows_of, row = torch.unique(examples * layer.num_embeddings + indices, return_inverse=True)
    rows = contributions.new_zeros(len(rows_of), layer.embedding_dim).index_add_(0, row, contributions)
    row_example, row_index = rows_of // layer.num_embeddings, rows_of % layer.num_embeddings
    squared = rows.new_zeros(batch_size).index_add_(0, row_example, rows.square().sum(1))

    def weight_sum(factors: Tensor) -> Tensor:
        weighted = rows * factors.to(rows.dtype)[row_example].unsqueeze(1)
        return torch.zeros_like(params["weight"]).index_add_(0, row_index, weighted)

    return {"weight": ParameterGradients(squared, weight_sum)}


def _bag_entries(layer: nn.EmbeddingBag, call: LayerCall, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The entries of one call's bags: (example [N], embedding index [N], coefficient [N]); bag i is example i."""
    arguments = dict(zip(("input", "offsets", "per_sample_weights"), call.args)) | call.kwargs
    indices, offsets, sample_weights = arguments["input"], arguments.get("offsets"), arguments.get("per_sample_weights")
    if indices.dim() == 2:
        bags, length = indices.shape
        examples = torch.arange(bags, device=indices.device).repeat_interleave(length)
        indices = indices.reshape(-1)
        sample_weights = sample_weights.reshape(-1) if sample_weights is not None else None
    else:
        bags = offsets.numel() - int(layer.include_last_offset)
        end = offsets[bags] if layer.include_last_offset else torch.tensor(indices.numel(), device=offsets.device)
        lengths = torch.diff(torch.cat([offsets[:bags], end.reshape(1)]))
        examples = torch.arange(bags, device=indices.device).repeat_interleave(lengths)
        used = slice(int(offsets[0]), int(offsets[0]) + examples.numel())
        indices = indices[used]
        sample_weights = sample_weights[used] if sample_weights is not None else None
    if bags != batch_size:
        raise WholeModelFallback(
            f"EmbeddingBag is given {bags} bags for a batch of {batch_size} examples; the fast engine needs "
            "one bag per example"
        )
    output_dtype = call.outputs[0].dtype
    coefficients = (
        sample_weights.detach().to(output_dtype) if sample_weights is not None
        else torch.ones(indices.shape, dtype=output_dtype, device=indices.device)
    )
    if layer.padding_idx is not None:
        coefficients = coefficients.masked_fill(indices == layer.padding_idx, 0.0)
    if layer.mode == "mean":
        # Mean takes no per-sample weights, so the coefficients are 1, or 0 for
        # padding, which PyTorch leaves out of the bag size; an empty bag is 0.
        sizes = coefficients.new_zeros(bags).index_add_(0, examples, coefficients)
        coefficients = coefficients / sizes.clamp(min=1)[examples]
    return examples, indices, coefficients
