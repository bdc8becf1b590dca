"""Membership inference by loss threshold: how well a trained model's losses tell members from non-members.

The attack (Yeom et al. 2018) guesses "member" when an example's loss is
below a threshold; sweeping the threshold gives its ROC curve. The figures
are empirical, for this model and these examples: unlike an audit they prove
nothing about epsilon, but they say what a simple attacker gets in practice.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats

FALSE_POSITIVE_RATE = 0.01
_LOSS_BATCH = 1000


def loss_attack_figures(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> dict:
    """AUC and TPR at 1% FPR of "lower loss = member", from per-example losses (nats).

    AUC is the probability that a random member has a lower loss than a
    random non-member (ties count one half). TPR at 1% FPR is the fraction of
    members below the highest threshold that puts at most 1% of the
    non-members below it.
    """
    members = np.asarray(member_losses, dtype=np.float64).ravel()
    nonmembers = np.asarray(nonmember_losses, dtype=np.float64).ravel()
    if members.size == 0 or nonmembers.size == 0:
        raise ValueError(
            f"need at least one member and one non-member (got {members.size} and {nonmembers.size})"
        )
    if not (np.all(np.isfinite(members)) and np.all(np.isfinite(nonmembers))):
        raise ValueError("losses must be finite; an inf or nan loss cannot be ranked")
    # Mann-Whitney: AUC = (rank sum of the non-members - n(n+1)/2) / (n * m), ranking by loss.
    ranks = stats.rankdata(np.concatenate([members, nonmembers]))
    nonmember_rank_sum = ranks[members.size :].sum()
    auc = (nonmember_rank_sum - nonmembers.size * (nonmembers.size + 1) / 2) / (members.size * nonmembers.size)
    allowed = int(np.floor(FALSE_POSITIVE_RATE * nonmembers.size))
    threshold = np.sort(nonmembers)[allowed]
    return {
        "auc": float(auc),
        "tpr_at_1pct_fpr": float(np.mean(members < threshold)),
        "members": int(members.size),
        "nonmembers": int(nonmembers.size),
    }


def example_losses(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Per-example cross-entropy losses (nats) of `model` in eval mode, as float64."""
    was_training = model.training
    device = next(model.parameters()).device  # the driver's GPU when it has one
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(labels), _LOSS_BATCH):
            logits = model(images[start : start + _LOSS_BATCH].to(device))
            losses.append(F.cross_entropy(logits, labels[start : start + _LOSS_BATCH].to(device), reduction="none"))
    model.train(was_training)
    return torch.cat(losses).double().cpu().numpy() if losses else np.zeros(0)


def membership_report(
    model: torch.nn.Module,
    member_images: torch.Tensor,
    member_labels: torch.Tensor,
    nonmember_images: torch.Tensor,
    nonmember_labels: torch.Tensor,
) -> dict:
    """The loss-threshold attack on `model`: {"auc", "tpr_at_1pct_fpr", "members", "nonmembers"}.

    Members are examples the model trained on, non-members held-out ones
    (e.g. the test split). AUC 0.5 and TPR 0.01 are what guessing gets.
    """
    return loss_attack_figures(
        example_losses(model, member_images, member_labels),
        example_losses(model, nonmember_images, nonmember_labels),
    )
