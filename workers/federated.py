"""DP-FedAvg's client side (McMahan et al. 2018): each sampled user trains locally, and its model delta is clipped.

The driver adds noise to the sum of clipped deltas once and applies the noisy
mean delta with its server optimizer; one user moves that sum by at most
``clip_norm``, whatever the number of local steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from workers.clipping import (
    LossFunction,
    check_arguments,
    clip_factors,
    device_of,
    functional_parameters,
    in_ieee_float32,
)


@in_ieee_float32
def clipped_local_update_sum(
    model: nn.Module,
    flat_weights: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    user_of_row: torch.Tensor,
    clip_norm: float,
    local_steps: int,
    local_learning_rate: float,
    loss_fn: LossFunction = F.cross_entropy,
) -> tuple[torch.Tensor, int]:
    """Sum over users of each user's model delta after local training, clipped to L2 norm ``clip_norm``.

    ``user_of_row`` [n] names each row's user. User u starts from
    ``flat_weights`` and takes ``local_steps`` steps of plain SGD (rate
    ``local_learning_rate``) on the mean loss over its own rows; its delta is
    the flat final weights minus ``flat_weights``. A user whose delta is not
    finite (a NaN or inf in its rows) contributes zero. Returns the flat
    float32 sum and the number of rows of users left out (a raw count, for the
    driver only).
    """
    check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch=1)
    if local_steps < 1 or not local_learning_rate > 0:
        raise ValueError(f"local_steps must be >= 1 and local_learning_rate > 0 (got {local_steps} and "
                         f"{local_learning_rate})")
    device = device_of(model)
    trainable, start, fixed = functional_parameters(model, flat_weights, device)
    total = torch.zeros(sum(parameter.numel() for _, parameter in trainable), dtype=torch.float32, device=device)
    inputs, labels, user_of_row = inputs.to(device), labels.to(device), user_of_row.to(device)

    def mean_loss(params, user_inputs, user_labels):
        return loss_fn(functional_call(model, (params, fixed), (user_inputs,)), user_labels)

    left_out = 0
    for user in torch.unique(user_of_row):
        rows = torch.nonzero(user_of_row == user).flatten()
        params = dict(start)
        for _ in range(local_steps):
            gradients = grad(mean_loss)(params, inputs[rows], labels[rows])
            params = {name: params[name] - local_learning_rate * gradients[name] for name in params}
        delta = torch.cat([(params[name] - start[name]).reshape(-1).to(torch.float32) for name, _ in trainable])
        if not delta.isfinite().all():
            left_out += rows.numel()
            continue
        total += delta * clip_factors(delta.norm(), clip_norm)
    return total, left_out
