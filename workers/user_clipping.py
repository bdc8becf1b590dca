"""One clipped contribution per user: its mean-loss gradient, or its DP-FedAvg model delta after local steps.

Users are computed one after another, each over all its rows at once: on a
CPU a user's ordinary batched forward and backward beats batching users under
torch.func.vmap, which turns every convolution into a grouped one. One user
moves the returned sum by at most ``clip_norm``, whatever its rows and
whatever the number of local steps.
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
from workers.validation import keeps_buffers


@keeps_buffers
@in_ieee_float32
def clipped_user_sum(
    model: nn.Module,
    flat_weights: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    user_of_row: torch.Tensor,
    clip_norm: float,
    loss_fn: LossFunction = F.cross_entropy,
    local_steps: int = 0,
    local_learning_rate: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """Sum over users of each user's contribution, clipped to L2 norm ``clip_norm``; and the rows left out.

    ``user_of_row`` [n] names each row's user. With ``local_steps`` = 0 a
    user's contribution is the gradient, at ``flat_weights``, of its mean loss
    over its rows. With ``local_steps`` = k >= 1 (DP-FedAvg, McMahan et al.
    2018) the user starts from ``flat_weights``, takes k steps of plain SGD at
    ``local_learning_rate`` on that mean loss, and contributes its final
    weights minus ``flat_weights``. A user whose contribution is not finite (a
    NaN or inf in its rows) adds zero, and its rows are counted in the second
    value, a raw count for the driver only.
    """
    check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch=1)
    if local_steps < 0 or (local_steps and not local_learning_rate > 0):
        raise ValueError(f"local_steps must be >= 0, with local_learning_rate > 0 when it is not 0 (got {local_steps} "
                         f"and {local_learning_rate})")
    device = device_of(model)
    trainable, start, fixed = functional_parameters(model, flat_weights, device)
    total = torch.zeros(sum(parameter.numel() for _, parameter in trainable), dtype=torch.float32, device=device)
    inputs, labels, user_of_row = inputs.to(device), labels.to(device), user_of_row.to(device)

    def mean_loss(params, user_inputs, user_labels):
        return loss_fn(functional_call(model, (params, fixed), (user_inputs,)), user_labels)

    def flat(tensors):
        return torch.cat([tensors[name].reshape(-1).to(torch.float32) for name, _ in trainable])

    left_out = 0
    for user in torch.unique(user_of_row):
        rows = torch.nonzero(user_of_row == user).flatten()
        user_inputs, user_labels = inputs[rows], labels[rows]
        if not local_steps:
            contribution = flat(grad(mean_loss)(start, user_inputs, user_labels))
        else:
            params = start
            for _ in range(local_steps):
                gradients = grad(mean_loss)(params, user_inputs, user_labels)
                params = {name: params[name] - local_learning_rate * gradients[name] for name in params}
            contribution = flat({name: params[name] - start[name] for name in params})
        if not contribution.isfinite().all():
            left_out += rows.numel()
            continue
        total += contribution * clip_factors(contribution.norm(), clip_norm)
    return total, left_out
