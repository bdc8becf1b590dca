"""Microbatches: neighbouring batches move the clipped sum by at most 2C, and the accountant knows it."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accounting.accountants import get_accountant
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.sampling import assign_microbatches, make_generator, microbatch_count, partition_microbatches
from orchestrator.planning import plan_run
from workers.vmap_engine import microbatch_clipped_sum
from workers.models import flat_parameters


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def random_batch(seed, examples, groups):
    """Inputs, labels and microbatch ids of a random batch for tiny_model."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(examples, 6, generator=generator) * 3
    labels = torch.randint(0, 3, (examples,), generator=generator)
    return inputs, labels, torch.randint(0, groups, (examples,), generator=generator)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    examples=st.integers(2, 12),
    groups=st.integers(1, 4),
    clip_norm=st.floats(0.01, 2.0),
)
def test_removing_one_example_moves_the_clipped_sum_by_at_most_2c(seed, examples, groups, clip_norm):
    model = tiny_model()
    weights = flat_parameters(model)
    inputs, labels, group_ids = random_batch(seed, examples, groups)
    full = microbatch_clipped_sum(model, weights, inputs, labels, group_ids, clip_norm)
    for removed in range(examples):
        keep = torch.arange(examples) != removed
        neighbour = microbatch_clipped_sum(model, weights, inputs[keep], labels[keep], group_ids[keep], clip_norm)
        assert (full - neighbour).norm() <= 2 * clip_norm * (1 + 1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), examples=st.integers(2, 12), groups=st.integers(1, 4), clip_norm=st.floats(0.05, 2.0))
def test_removing_one_example_moves_the_unclipped_microbatch_count_by_at_most_1(seed, examples, groups, clip_norm):
    # The count adaptive clipping releases: microbatches with norm <= C, an empty one counting as unclipped.
    model = tiny_model()
    weights = flat_parameters(model)
    inputs, labels, group_ids = random_batch(seed, examples, groups)

    def unclipped_count(keep):
        _, norms, _ = microbatch_clipped_sum(model, weights, inputs[keep], labels[keep], group_ids[keep], clip_norm,
                                             return_norms=True)
        return int((norms <= clip_norm).sum()) + groups - norms.numel()

    full = unclipped_count(torch.ones(examples, dtype=torch.bool))
    for removed in range(examples):
        assert abs(full - unclipped_count(torch.arange(examples) != removed)) <= 1


def test_each_microbatch_contribution_is_clipped_to_c():
    model = tiny_model()
    inputs, labels = torch.randn(8, 6) * 5, torch.randint(0, 3, (8,))
    single = microbatch_clipped_sum(model, flat_parameters(model), inputs, labels, torch.zeros(8, dtype=torch.long), 0.1)
    assert single.norm() == pytest.approx(0.1, rel=1e-5)


def test_groups_are_assigned_independently_and_kept_whole_across_workers():
    generator = make_generator(5, 0)
    group_ids = assign_microbatches(generator, 10_000, 32)
    counts = np.bincount(group_ids, minlength=32)
    assert counts.min() > 250 and counts.max() < 380
    indices = np.arange(10_000)
    shards, group_shards = partition_microbatches(indices, group_ids, 3)
    assert sorted(np.concatenate(shards).tolist()) == indices.tolist()
    for part, groups in enumerate(group_shards):
        assert set(np.unique(groups) % 3) <= {part}
    assert microbatch_count(256, 8) == 32 and microbatch_count(10, 50) == 1


def test_the_plan_accounts_microbatches_with_sensitivity_factor_2():
    base = dict(steps=100, batch_size=256, train_subset=6000, noise_multiplier=1.1)
    plain = plan_run(build_config(base))
    grouped = plan_run(build_config({**base, "microbatch_size": 8}))
    assert grouped.microbatches == 32 and grouped.contributions_per_step == 32
    assert all(event.sensitivity_factor == 2.0 for event in grouped.planned_events.events)
    halved = plan_run(build_config({**base, "noise_multiplier": 0.55}))
    pld = get_accountant("pld")
    assert pld.epsilon(grouped.planned_events, 1e-5) == pytest.approx(pld.epsilon(halved.planned_events, 1e-5))
    assert pld.epsilon(grouped.planned_events, 1e-5) > pld.epsilon(plain.planned_events, 1e-5)


def test_eps_shows_the_effect_of_microbatches(capsys):
    argv = ["eps", "--dataset-size", "60000", "--batch-size", "250", "--noise-multiplier", "1.3",
            "--epochs", "15", "--delta", "1e-5", "--json"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--microbatch-size", "5"]) == 0
    with_groups, without = json.loads(capsys.readouterr().out), json.loads(plain)
    assert with_groups["sensitivity_factor"] == 2.0
    assert with_groups["epsilon_without_factor"] == pytest.approx(without["epsilon"])
    assert with_groups["epsilon"] > 4 * without["epsilon"]
