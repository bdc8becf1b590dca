"""User-level privacy: who owns which rows, one clipped contribution per sampled user, and the accounting."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from scipy import stats

from accounting.accountants import get_accountant
from accounting.events import SampledGaussian, group_events
from accounting.ledger.store import open_embedded_ledger
from orchestrator.cli import main
from orchestrator.config import build_config
from orchestrator.errors import UsageError
from orchestrator.sampling import partition
from orchestrator.trainer import Trainer
from workers.actor import GradientWorker
from workers.models import build_model, flat_parameters
from workers.sources import write_parquet_shards
from workers.users import UserIndex, UserSpec, rows_of_users, synthetic_user_ids

ROWS, USERS = 600, 40


def test_the_synthetic_assignment_is_skewed_fixed_and_covers_every_row_and_user():
    owners = synthetic_user_ids(60_000, 1_000)
    sizes = np.bincount(owners, minlength=1_000)
    assert sizes.sum() == 60_000 and sizes.min() >= 1 and sizes.max() == 300
    assert np.median(sizes) < 60 < sizes.mean() + 1  # skewed: most users own few rows, some own many
    np.testing.assert_array_equal(owners, synthetic_user_ids(60_000, 1_000))
    with pytest.raises(ValueError, match="at least 200 users"):
        synthetic_user_ids(60_000, 100)


def test_user_index_groups_rows_by_user_and_caps_rows_at_random():
    index = UserIndex.of(np.array(["b", "a", "b", "c", "b", "a"]))
    assert index.user_count == 3 and index.largest_user() == 3
    rows, owners = rows_of_users(index, np.array([1, 0]), None, np.random.default_rng(0))
    assert rows.tolist() == [0, 2, 4, 1, 5] and owners.tolist() == [0, 0, 0, 1, 1]
    drawn = [tuple(rows_of_users(index, np.array([1]), 2, np.random.default_rng(seed))[0]) for seed in range(40)]
    assert {len(choice) for choice in drawn} == {2} and set(drawn) == {(0, 2), (0, 4), (2, 4)}
    assert [part.size for part in rows_of_users(index, np.array([], dtype=np.int64), 2, np.random.default_rng())] == [0, 0]


def user_worker(**spec):
    return GradientWorker("gdp_cnn", "mnist", ROWS, 32, users=UserSpec(None, USERS, seed=5, **spec))


@pytest.mark.parametrize("spec", [{}, {"max_examples_per_user": 4}, {"local_steps": 3, "local_learning_rate": 0.5}])
def test_one_user_moves_the_sum_by_at_most_c_whatever_its_rows(spec):
    worker = user_worker(**spec)
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    biggest = int(np.argmax(np.diff(worker.user_index.starts)))
    others = np.array([user for user in range(8) if user != biggest])
    clip_norm = 0.05
    without = worker.user_clipped_sum(weights, others, clip_norm, step=0)
    with_user = worker.user_clipped_sum(weights, np.sort(np.append(others, biggest)), clip_norm, step=0)
    alone = worker.user_clipped_sum(weights, np.array([biggest]), clip_norm, step=0)
    assert np.linalg.norm(alone[:-1]) == pytest.approx(clip_norm, rel=1e-4)  # a big user's gradient is clipped
    assert np.linalg.norm(with_user[:-1] - without[:-1]) <= clip_norm * (1 + 1e-5)
    # A user whose rows are not finite adds exactly nothing.
    index = worker.user_index
    worker.source.inputs[index.rows[index.starts[biggest]:index.starts[biggest + 1]]] = float("nan")
    poisoned = worker.user_clipped_sum(weights, np.sort(np.append(others, biggest)), clip_norm, step=0)
    np.testing.assert_allclose(poisoned[:-1], without[:-1], rtol=0, atol=1e-6)
    assert poisoned[-1] == (spec.get("max_examples_per_user") or np.diff(worker.user_index.starts)[biggest])


def test_users_split_across_workers_sum_to_what_one_worker_computes():
    weights = flat_parameters(build_model("gdp_cnn")).numpy()
    workers = [user_worker(), user_worker()]
    users = np.arange(0, USERS, 3)
    parts = [worker.user_clipped_sum(weights, share, 0.1, step=2) for worker, share in zip(workers, partition(users, 2))]
    np.testing.assert_allclose(np.sum(parts, axis=0), workers[0].user_clipped_sum(weights, users, 0.1, step=2),
                               rtol=0, atol=1e-6)


def user_config(tmp_path, **overrides):
    values = dict(dataset="mnist", train_subset=ROWS, test_subset=200, privacy_unit="user", synthetic_users=USERS,
                  batch_size=8, steps=3, noise_multiplier=1.5, seed=4, workers=2, run_dir=str(tmp_path / "run"))
    values.update(overrides)
    return build_config(values)


def test_users_are_poisson_sampled_at_q_over_users(tmp_path):
    trainer = Trainer(user_config(tmp_path), show_progress=False)
    assert trainer.plan.dataset_size == USERS and trainer.plan.sampling_rate == pytest.approx(8 / USERS)
    draws = 3_000
    counts = np.zeros(USERS)
    for step in range(draws):
        users, groups = trainer._draw_sample(step)
        assert groups is None
        counts[users] += 1
    # Each user's inclusion count is Binomial(draws, q); together they fit it (chi-square over users).
    q = 8 / USERS
    statistic = (((counts - draws * q) ** 2) / (draws * q * (1 - q))).sum()
    assert stats.chi2.sf(statistic, USERS) > 1e-3


@pytest.mark.parametrize(("values", "message"), [
    ({"synthetic_users": 10}, "add privacy_unit"),
    ({"privacy_unit": "user"}, "exactly one of user_id"),
    ({"privacy_unit": "user", "synthetic_users": 10, "local_steps": 2}, "both local_steps"),
    ({"privacy_unit": "user", "synthetic_users": 10, "microbatch_size": 4}, "microbatch_size"),
    ({"privacy_unit": "user", "synthetic_users": 10, "batch_size": 11}, "batch_size"),
    ({"privacy_unit": "persons"}, "privacy_unit"),
])
def test_user_keys_that_do_not_fit_together_are_refused(values, message):
    base = dict(dataset="mnist", train_subset=ROWS, steps=2, noise_multiplier=1.0, batch_size=5)
    with pytest.raises(UsageError, match=message):
        build_config({**base, **values})


def people_dataset(tmp_path):
    """A Parquet dataset of ROWS random rows with a `person` column: 30 people owning 20 rows each; its TOML."""
    directory = tmp_path / "people"
    images = np.random.default_rng(0).random((ROWS, 784), dtype=np.float32)
    labels = np.arange(ROWS) % 10
    write_parquet_shards(str(directory / "train"), [(images, labels)], ROWS, 2)
    write_parquet_shards(str(directory / "test"), [(images[:100], labels[:100])], 100, 1)
    # The people: a user_id column beside the features, 30 people owning 20 rows each.
    for part in sorted((directory / "train").iterdir()):
        table = pq.read_table(part)
        first = 0 if part.name.endswith("00000.parquet") else ROWS // 2
        people = pa.array([f"person-{(first + row) % 30}" for row in range(table.num_rows)])
        pq.write_table(table.append_column("person", people), part, row_group_size=16)
    dataset = (f'[dataset]\nformat = "parquet"\ntrain = "{directory / "train"}"\ntest = "{directory / "test"}"\n'
               'shape = [1, 28, 28]\nfeatures = "features"\nname = "people"\n')
    return dataset


def test_user_and_fedavg_runs_account_per_user_and_charge_the_ledger_at_the_row_bound(local_ray, tmp_path, capsys):
    dataset = people_dataset(tmp_path)
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("people", 50.0, 1e-5)  # a budget over rows
    common = ('privacy_unit = "user"\nuser_id = "person"\nbatch_size = 6\nsteps = 3\nnoise_multiplier = 2.0\n'
              'seed = 2\nworkers = 1\ndataset_budget_epsilon = 50.0\n')
    summaries = []
    for name, extra in (("sgd", ""), ("fedavg", "local_steps = 2\nlocal_learning_rate = 0.1\n")):
        config = tmp_path / f"{name}.toml"
        config.write_text(f'run_dir = "{tmp_path / name}"\n' + common + extra + dataset)
        assert main(["train", "--config", str(config), "--no-progress", "--json"]) == 0
        summaries.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    pld = get_accountant("pld")
    for summary in summaries:
        assert summary["privacy_unit"] == "user" and summary["users"] == 30
        assert summary["epsilon"] == pytest.approx(pld.epsilon(SampledGaussian(6 / 30, 2.0, 3), 1e-5), rel=1e-9)
        assert summary["row_epsilon"] == pytest.approx(
            pld.epsilon(SampledGaussian(6 / 30, 2.0, 3, sensitivity_factor=2.0), 1e-5), rel=1e-9)
        assert summary["row_epsilon"] > summary["epsilon"]
    # On a dataset with a budget over rows, both jobs charged what one row reveals, composed.
    with open_embedded_ledger() as ledger:
        spent = ledger.get_budget("people").spent_epsilon
    assert spent == pytest.approx(pld.epsilon(SampledGaussian(6 / 30, 2.0, 6, sensitivity_factor=2.0), 1e-5),
                                  rel=1e-9)
    assert summaries[0]["test_accuracy"] != summaries[1]["test_accuracy"] or \
        summaries[0]["test_loss"] != summaries[1]["test_loss"]
    # A user-level job too costly for the budget over rows is refused naming the mismatch of units, not ε alone.
    config = tmp_path / "costly.toml"
    config.write_text(f'run_dir = "{tmp_path / "costly"}"\n' + common.replace("= 2.0", "= 0.3") + dataset)
    assert main(["train", "--config", str(config), "--no-progress"]) == 3
    assert ("The privacy units differ: this job protects users (privacy_unit = \"user\") and the ledger's dataset "
            "'people' is budgeted per example") in capsys.readouterr().err


def test_example_level_runs_on_a_user_level_budget_are_charged_by_group_privacy_or_refused(local_ray, tmp_path,
                                                                                           capsys):
    dataset = people_dataset(tmp_path)
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("people", 8.0, 1e-5, "user")
    common = "batch_size = 6\nsteps = 3\nnoise_multiplier = 20.0\nseed = 2\nworkers = 1\n"

    def train(name, extra):
        config = tmp_path / f"{name}.toml"
        config.write_text(f'run_dir = "{tmp_path / name}"\n' + common + extra + dataset)
        return main(["train", "--config", str(config), "--no-progress", "--json"])

    # Without a bound on each person's rows, the ledger refuses the example-level job (exit 3).
    assert train("unbounded", "") == 3
    err = capsys.readouterr().err
    assert "does not bound how many rows one person has" in err
    assert "The privacy units differ: this job protects single examples and the ledger's dataset 'people'" in err
    # A bound below what the data holds is refused before anything runs.
    with pytest.raises(UsageError, match="but a person owns more rows of the training data") as refused:
        build_config({"dataset": {"format": "parquet", "train": str(tmp_path / "people" / "train"),
                                  "test": str(tmp_path / "people" / "test"), "shape": [1, 28, 28],
                                  "features": "features"},
                      "user_id": "person", "max_examples_per_user": 10, "steps": 1, "noise_multiplier": 1.0,
                      "batch_size": 6})
    # How many rows the largest person owns is the data's: only the owner's message (--show-values) says it.
    assert "20" not in str(refused.value) and "one person owns 20 rows" in refused.value.with_values
    capsys.readouterr()
    assert train("bounded", 'user_id = "person"\nmax_examples_per_user = 20\n') == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = SampledGaussian(6 / ROWS, 20.0, 3)
    pld = get_accountant("pld")
    assert summary["epsilon"] == pytest.approx(pld.epsilon(rows, 1e-5), rel=1e-9)
    assert summary["rows_per_person"] == 20
    assert summary["user_epsilon"] == pytest.approx(pld.epsilon(group_events(rows, 20), 1e-5), rel=1e-9)
    # A user-level job on the same budget is charged its own per-person events, composed with the group bound.
    assert train("per-person", 'privacy_unit = "user"\nuser_id = "person"\n') == 0
    with open_embedded_ledger() as ledger:
        status = ledger.get_budget("people")
    assert status.spent_epsilon == pytest.approx(
        pld.epsilon(group_events(rows, 20).then(SampledGaussian(6 / 30, 20.0, 3)), 1e-5), rel=1e-9)
