"""What follows from a config and its data: N, q, the planned steps, the users, and the checks against the data.

They read the data's metadata (sizes, the people's column), never an
example's features or labels.
"""

from __future__ import annotations

from accounting.lazy import LazyModule
from orchestrator import checks
from orchestrator.config.model import TrainConfig
from orchestrator.errors import UsageError

sources = LazyModule("workers.sources")
users = LazyModule("workers.users")


def training_set_size(config: TrainConfig) -> int:
    """N: the number of training examples the run samples from, from file metadata (no example is read).

    Unsharded configs only: a sharded config's N is the sum its workers report.
    Under check_data = "lenient" N counts every row of the files, those it
    drops too (they take no part in any sample): how many it drops comes from
    private values, and N is public (docs/privacy.md).
    """
    if config.shards:
        raise UsageError("a sharded config's N is the sum of its shards' sizes, which only their workers report; "
                         "pass the reported N as dataset_size")
    spec = config.dataset
    try:
        full = sources.source_size({**spec, "drop_invalid_rows": False} if isinstance(spec, dict) else spec, "train")
    except ValueError as error:
        raise UsageError(str(error), getattr(error, "with_values", None)) from None
    if config.train_subset is not None and config.train_subset > full:
        raise UsageError(
            f"train_subset must be <= {full} for {sources.spec_name(config.dataset)} (got {config.train_subset})"
        )
    return config.train_subset or full


def sampled_unit_count(config: TrainConfig) -> int:
    """How many units the run Poisson-samples from: N examples, or under privacy_unit = "user" the users.

    Users come from the synthetic assignment, or from the ``user_id`` column
    (read whole, once, to count its distinct values; no feature or label is
    read). Like N, the count is treated as public.
    """
    if config.privacy_unit == "example":
        return training_set_size(config)
    try:
        return users.user_index(user_spec(config), config.dataset, training_set_size(config)).user_count
    except (sources.DataError, ValueError) as error:
        raise UsageError(str(error), getattr(error, "with_values", None)) from None


def user_spec(config: TrainConfig) -> users.UserSpec | None:
    """The workers' description of the run's users, or None at example level."""
    if config.privacy_unit == "example":
        return None
    return users.UserSpec(config.user_id, config.synthetic_users, config.max_examples_per_user, config.local_steps,
                          config.local_learning_rate, config.seed)


def test_set_size(config: TrainConfig) -> int:
    """The number of test examples each evaluation covers: the test split, or its first ``test_subset``."""
    full = sources.source_size(config.dataset, "test")
    return min(full, config.test_subset or full)


def sampling_rate(config: TrainConfig, dataset_size: int | None = None) -> float:
    """q = expected batch size / N, with N = `dataset_size` when given, else `sampled_unit_count(config)`."""
    return config.batch_size / (dataset_size or sampled_unit_count(config))


def total_steps(config: TrainConfig, dataset_size: int | None = None) -> int:
    """Planned steps: `steps`, or ceil(epochs * N / batch_size), with N as in `sampling_rate`."""
    from accounting.events import steps_for_epochs

    if config.steps is not None:
        return config.steps
    return steps_for_epochs(config.epochs, dataset_size or sampled_unit_count(config), config.batch_size)


def expected_batch_size(config: TrainConfig, dataset_size: int | None = None) -> float:
    """q * N, the divisor of the noisy sum (never the realised batch size), with N as in `sampling_rate`."""
    return sampling_rate(config, dataset_size) * (dataset_size or sampled_unit_count(config))


def rows_per_person(config: TrainConfig) -> int | None:
    """At example level, the bound max_examples_per_user puts on every person's rows; else None."""
    return config.max_examples_per_user if config.privacy_unit == "example" else None


def check_people_within_bound(config: TrainConfig) -> None:
    """At example level with max_examples_per_user, refuse data in which a person owns more rows than that.

    Reads the people (the user_id column, or the synthetic assignment), never
    a feature or label. The refusal does not say how many rows the largest
    person owns, which is the data's and not the analyst's to know; its
    ``with_values`` does, for the data's owners (``--show-values``).
    """
    bound = rows_per_person(config)
    if bound is None:
        return
    try:
        largest = users.user_index(users.UserSpec(config.user_id, config.synthetic_users), config.dataset,
                                   training_set_size(config)).largest_user()
    except (sources.DataError, ValueError) as error:
        raise UsageError(str(error), getattr(error, "with_values", None)) from None
    if largest > bound:
        # How many rows the largest person owns is the data's, not the analyst's: quoted only with --show-values.
        raise UsageError(
            f"max_examples_per_user = {bound} bounds every person's rows at example level, but a person owns more "
            f"rows of the training data; raise it, keep at most {bound} rows a person in the data, or train with "
            "privacy_unit = \"user\"",
            f"max_examples_per_user = {bound} bounds every person's rows at example level, but one person owns "
            f"{largest} rows of the training data; set it to at least {largest}, keep at most that many rows a "
            "person in the data, or train with privacy_unit = \"user\"",
        )


def check_against_data(config: TrainConfig) -> None:
    """The checks that read the data's metadata: every person's rows within their bound, and batch_size <= N.

    With shards, N is known once the workers report their sizes; the trainer checks it then.
    """
    check_people_within_bound(config)
    if not config.shards:
        checks.batch_within_dataset("batch_size", config.batch_size, sampled_unit_count(config))
