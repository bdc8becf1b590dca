"""Users (the people behind the rows) for user-level privacy: who owns which rows, and each step's rows of a user.

Under ``privacy_unit = "user"`` the unit that is sampled, clipped and
protected is a user, not a row. These pure functions map users to their rows:
``UserIndex`` groups row positions by user, and ``rows_of_users`` picks a
sampled user's rows for one step (at most ``max_examples_per_user`` of them,
drawn at random each time).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from workers.sources import check_block_people, read_column

# The synthetic assignment is a fixed property of the data, the same on every worker and run.
SYNTHETIC_USERS_SEED = 20181023
LARGEST_SYNTHETIC_USER = 300
# Under one seed (tests only), the stream of the rows a capped user gives, apart from the samplers' and noise's.
USER_ROWS_STREAM = 3


def synthetic_user_ids(example_count: int, user_count: int, largest: int = LARGEST_SYNTHETIC_USER) -> np.ndarray:
    """A skewed assignment of ``example_count`` rows to ``user_count`` users: each row's user, in 0..user_count-1.

    User sizes follow a log-normal shape clipped to 1..``largest`` rows and
    sum to ``example_count``; rows go to users in a fixed random order, so a
    user's rows are spread over the dataset. Every user owns at least one row.
    """
    if not 1 <= user_count <= example_count:
        raise ValueError(f"synthetic users must number between 1 and the {example_count} examples (got {user_count})")
    if user_count * largest < example_count:
        raise ValueError(f"{user_count} users of at most {largest} rows cannot hold {example_count} examples; "
                         f"use at least {-(-example_count // largest)} users")
    generator = np.random.default_rng(SYNTHETIC_USERS_SEED)
    shape = generator.lognormal(mean=0.0, sigma=1.0, size=user_count)
    sizes = np.ones(user_count, dtype=np.int64)
    # Scale the shape until the clipped, rounded sizes first reach the total, then settle the rest one row at a time.
    low, high = 0.0, float(example_count)
    for _ in range(100):
        scale = (low + high) / 2
        sizes = np.clip(np.floor(shape * scale), 1, largest).astype(np.int64)
        low, high = (scale, high) if sizes.sum() < example_count else (low, scale)
    sizes = np.clip(np.floor(shape * low), 1, largest).astype(np.int64)
    by_size = np.argsort(-shape, kind="stable")
    while sizes.sum() < example_count:
        room = by_size[sizes[by_size] < largest]
        sizes[room[: example_count - sizes.sum()]] += 1
    owners = np.repeat(np.arange(user_count), sizes)
    return owners[generator.permutation(example_count)]


@dataclass(frozen=True)
class UserSpec:
    """Who the users are and what each sampled user does in a step.

    Exactly one of ``user_id`` (the column naming each row's person) and
    ``synthetic_users`` (a count to assign rows to) is set. With
    ``local_steps``, a user's contribution is its clipped model delta after
    that many local SGD steps at ``local_learning_rate`` (DP-FedAvg), else its
    clipped mean-loss gradient. ``seed`` (tests only) fixes which rows a user
    capped at ``max_examples_per_user`` gives each step.
    """

    user_id: str | None
    synthetic_users: int | None
    max_examples_per_user: int | None = None
    local_steps: int | None = None
    local_learning_rate: float | None = None
    seed: int | None = None


def user_index(spec: UserSpec, dataset: str | Mapping, example_count: int) -> "UserIndex":
    """The users of the first ``example_count`` training rows of ``dataset``.

    Refuses (DataError) a run on blocks declared by user id whose rows hold
    a person of another block (``check_block_people``).
    """
    if isinstance(dataset, Mapping):
        check_block_people(dataset, spec.user_id)
    if spec.synthetic_users is not None:
        return UserIndex.of(synthetic_user_ids(example_count, spec.synthetic_users))
    return UserIndex.of(read_column(dataset, "train", spec.user_id)[:example_count])


@dataclass(frozen=True)
class UserIndex:
    """Rows grouped by user: user u owns ``rows[starts[u]:starts[u + 1]]`` (row positions, ascending)."""

    starts: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, user_ids: np.ndarray) -> "UserIndex":
        """The index of one user id per row; ids may be any values, numbered in sorted order of their values."""
        _, dense = np.unique(np.asarray(user_ids), return_inverse=True)
        order = np.argsort(dense, kind="stable")
        counts = np.bincount(dense, minlength=int(dense.max()) + 1 if dense.size else 0)
        return cls(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), order.astype(np.int64))

    @property
    def user_count(self) -> int:
        """How many users own rows (public, like N at example level)."""
        return len(self.starts) - 1

    def largest_user(self) -> int:
        """The most rows any one user owns."""
        return int(np.diff(self.starts).max()) if self.user_count else 0


def rows_of_users(
    index: UserIndex, users: np.ndarray, max_examples_per_user: int | None, generator: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(row positions, each row's position in ``users``) for one step's sampled ``users``.

    A user with more than ``max_examples_per_user`` rows gives that many,
    drawn without replacement by ``generator``; the others give all theirs.
    """
    rows, owners = [], []
    for position, user in enumerate(np.asarray(users, dtype=np.int64)):
        owned = index.rows[index.starts[user]:index.starts[user + 1]]
        if max_examples_per_user is not None and len(owned) > max_examples_per_user:
            owned = np.sort(generator.choice(owned, size=max_examples_per_user, replace=False))
        rows.append(owned)
        owners.append(np.full(len(owned), position, dtype=np.int64))
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(rows), np.concatenate(owners)
