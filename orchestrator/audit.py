"""`run_audit`: train once through the real pipeline with canaries, and bound epsilon from below.

The accountant's epsilon is an upper bound for DP-SGD as specified. The
audit measures what the implementation leaks: K canaries extend the index
space of the training set to N + K (canary k is example N + k); each is in
the dataset independently with probability 1/2, drawn from a generator the
scorer never sees. The real Poisson sampler runs over all N + K indices at the
configured rate q, so a canary joins exactly the steps the sampler picks it
for, and the accountant's events are those of the plan (same q, sigma,
steps): ``epsilon_upper`` is the PLD epsilon of what ran. Real indices go to
the gradient workers unchanged; the canaries' clipped gradients are added at
the partial-sum stage, before the driver's one noise draw.

- white-box (default): Dirac gradient canaries. Canary k's gradient lies
  on its own parameter coordinate and is clipped to C by the workers'
  ``clip_factors``; the coordinates are the K that real examples' gradients
  touch least at initialisation, since real gradients there only blur the
  scores. The auditor sees every noisy sum the driver computes and scores
  each canary by the log-likelihood ratio of its coordinate across the steps
  (``accounting.auditing.dirac_canary_scores``). Under fixed-order
  participation (a correlated mechanism without amplification) the schedule
  is the mechanism's and independent of the inclusions, so the score uses
  each canary's own steps (``pattern_canary_scores``): summed over every
  step, a canary's one or two participations would drown in the others'
  noise, and a wrong strategy inverse would go unseen.
- canary users (white-box, ``rows_per_canary`` m > 1): canary k is a person
  owning m rows whose gradients all lie on its coordinate. Under
  privacy_unit = "user" the person is one sampled unit (one of the sampler's
  user numbers) whose clipped contribution is at most C, so the bound must
  stay below the user-level epsilon. At example level its m rows are sampled
  and clipped one by one (m of the sampler's indices), the person moves a
  step's sum by up to m C, and the bound on persons exceeds the run's
  example-level epsilon: the audit says so.
- black-box: input canaries, K images from the end of the test split with a
  wrong label. Their gradients are clipped on the driver by
  ``workers.vmap_engine.per_example_clipped_sum`` (the workers' clipping code):
  the workers load only their own training split, so the canaries cannot be
  placed among their examples. The auditor sees only the final model and
  scores each canary by minus its loss.

The guesses become a lower bound with the one-run bound of Steinke, Nasr and
Jagielski (``accounting.auditing``). A lower bound above the accountant's
upper bound means the implementation is less private than claimed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Protocol

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from accounting.accountants import PLD_FALLBACK_LABEL, get_accountant, labelled_epsilon  # noqa: E402
from accounting.auditing import audit_scores, dirac_canary_scores, pattern_canary_scores  # noqa: E402
from accounting.events import Composition, group_events  # noqa: E402
from accounting.matrix_mechanisms import decorrelated_observations  # noqa: E402
from orchestrator import release  # noqa: E402
from orchestrator.config import TrainConfig, training_set_size  # noqa: E402
from orchestrator.errors import UsageError  # noqa: E402
from orchestrator.membership import example_losses, loss_attack_figures, membership_report  # noqa: E402
from orchestrator.noise import GaussianNoise, noisy_sum_at  # noqa: E402
from orchestrator.planning import RunPlan, correlated_noise_plan  # noqa: E402
from orchestrator.sampling import make_generator, partition  # noqa: E402
from orchestrator.trainer import Trainer  # noqa: E402
from workers.clipping import clip_factors  # noqa: E402
from workers.vmap_engine import per_example_clipped_sum  # noqa: E402
from workers.data import DATASETS, dataset_size, load_split  # noqa: E402
from workers.sources import spec_name  # noqa: E402
from workers.models import build_model, flat_parameters, parameter_count  # noqa: E402

MODES = ("white-box", "black-box")
DEFAULT_CANARIES = {"white-box": 5000, "black-box": 1000}
MIN_CANARIES = 100
CANARY_STREAM = 2
SCORES_PNG = "audit_scores.png"
AUDIT_JSON = "audit.json"
_MEMBERSHIP_EXAMPLES = 1000
PROBE_EXAMPLES = 64
# A Dirac canary row's gradient norm, in clip norms: above 1, so the workers' clipping brings it to C.
ROW_GRADIENT_NORM_FACTOR = 2.0


class Canaries(Protocol):
    """K canaries taking the sampler's `units` indices after its N: which are in the dataset, their clipped sums."""

    count: int
    units: int
    included: np.ndarray

    def clipped_sum(self, sampled: np.ndarray, model: torch.nn.Module, clip_norm: float) -> np.ndarray:
        """Sum of the clipped gradients of the `sampled` canary units (0-based) that are in the dataset (float64)."""


class DiracCanaries:
    """Gradient canaries: every row of canary k has gradient ROW_GRADIENT_NORM_FACTOR * C on `coordinates[k]` alone.

    `included[k]` says whether canary k is in the dataset; the scorer must
    never see it. A canary owns `rows_per_canary` rows. `grouped` (privacy_unit
    = "user") makes a canary one sampled unit whose contribution is the mean
    of its rows' gradients, clipped, as a worker clips a user's; otherwise
    each row is a sampled unit clipped on its own, as a worker clips an
    example, and `units` counts rows. Either way the clipping is the
    workers' ``clip_factors``.
    """

    def __init__(self, coordinates: np.ndarray, included: np.ndarray, rows_per_canary: int = 1,
                 grouped: bool = False):
        self.coordinates = np.asarray(coordinates, dtype=np.int64)
        self.included = np.asarray(included, dtype=bool)
        self.count = len(self.included)
        self.rows_per_canary = rows_per_canary
        self.grouped = grouped
        self.units = self.count if grouped else self.count * rows_per_canary

    def owners(self, sampled: np.ndarray) -> np.ndarray:
        """The canary of each sampled unit: the unit itself (grouped) or, for one of its rows, u // rows_per_canary."""
        owners = np.asarray(sampled, dtype=np.int64)
        return owners if self.grouped else owners // self.rows_per_canary

    def clipped_sum(self, sampled: np.ndarray, model: torch.nn.Module, clip_norm: float) -> np.ndarray:
        """Sum of the clipped gradients of the sampled canary units that are in the dataset (float64)."""
        owners = self.owners(sampled)
        owners = owners[self.included[owners]]
        # A unit's gradient (one row's, or the mean of a canary's identical rows) has this norm before clipping.
        norm = torch.tensor(ROW_GRADIENT_NORM_FACTOR * clip_norm, dtype=torch.float64)
        clipped = float(norm * clip_factors(norm, clip_norm))
        total = np.zeros(parameter_count(model), dtype=np.float64)
        np.add.at(total, self.coordinates[owners], clipped)
        return total


class MislabelledCanaries:
    """Input canaries: images with a wrong label, clipped on the driver like any worker's examples.

    `included[k]` says whether canary k is in the dataset; the scorer must
    never see it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, included: np.ndarray, max_physical_batch: int):
        self.images = images
        self.labels = labels
        self.included = np.asarray(included, dtype=bool)
        self.count = len(self.included)
        self.units = self.count
        self.max_physical_batch = max_physical_batch

    def clipped_sum(self, sampled: np.ndarray, model: torch.nn.Module, clip_norm: float) -> np.ndarray:
        """Sum of the clipped gradients of the sampled canaries that are in the dataset (float64)."""
        chosen = torch.as_tensor(sampled[self.included[sampled]], dtype=torch.int64)
        device = next(model.parameters()).device  # the driver's GPU when it has one
        summed = per_example_clipped_sum(
            model, flat_parameters(model), self.images[chosen].to(device), self.labels[chosen].to(device),
            clip_norm, self.max_physical_batch,
        )
        return summed.double().cpu().numpy()


class CanaryTrainer(Trainer):
    """The real Trainer over N + `canaries.units` indices: indices >= N are canaries, added at the partial-sum stage.

    N counts examples, or users under privacy_unit = "user".

    With `watch` (parameter coordinates), every noisy sum the driver computes
    is recorded at those coordinates in `observations`, with the step's
    noise multiplier in `noise_multipliers`.
    """

    def __init__(self, config: TrainConfig, canaries: Canaries, watch: np.ndarray | None = None, **options):
        if config.microbatch_size:
            raise ValueError("the audit inserts canaries as single examples, so it cannot run with microbatch_size "
                             f"(got {config.microbatch_size}); audit the configuration without it")
        self.canaries = canaries
        self.watch = watch
        self.observations: list[np.ndarray] = []
        self.noise_multipliers: list[float] = []
        # Under fixed-order participation, each step's sampled units per canary (included or not): the schedule
        # is the mechanism's, which claims no amplification, so the scorer may know it (`pattern_canary_scores`).
        self.participations: list[np.ndarray] = []
        self._step_participation: np.ndarray | None = None
        super().__init__(config, **options)

    def _plan_run(self, dataset_size, charge_epsilon) -> RunPlan:
        plan = super()._plan_run(dataset_size, charge_epsilon)
        self.real_dataset_size = plan.dataset_size
        # The sampling rate, and so the accountant's events, stay the plan's; the divisor q * N stays too
        # (post-processing, so it cannot change what leaks). A correlated mechanism's epochs or groups span the
        # canaries too, so its participations are those of N + K.
        units = self.real_dataset_size + self.canaries.units
        correlation = (None if plan.correlation is None
                       else correlated_noise_plan(self.config, units, plan.steps))
        return dataclasses.replace(plan, dataset_size=units, correlation=correlation)

    def _partial_sums(self, workers: list, weights, shards: list[np.ndarray], group_shards: None,
                      next_shards: list[np.ndarray] | None) -> list[np.ndarray]:
        indices = np.concatenate(shards)
        real = indices[indices < self.real_dataset_size]
        upcoming = None
        if next_shards is not None:
            next_indices = np.concatenate(next_shards)
            upcoming = partition(next_indices[next_indices < self.real_dataset_size], len(workers))
        sums = super()._partial_sums(workers, weights, partition(real, len(workers)), None, upcoming)
        sampled_canaries = indices[indices >= self.real_dataset_size] - self.real_dataset_size
        if self.watch is not None and self.plan.sampler == "fixed-order":
            self._step_participation = np.bincount(self.canaries.owners(sampled_canaries),
                                                   minlength=self.canaries.count)
        canary_sum = self.canaries.clipped_sum(sampled_canaries, self.model, self.config.clip_norm)
        # The workers' sums end with their raw counts; the canaries add nothing to those.
        return sums + [np.concatenate([canary_sum, np.zeros(sums[0].size - canary_sum.size)])]

    def _apply_noise(self, partial_sums: list[np.ndarray], unit_noise, noise_std: float) -> None:
        if self.watch is not None:
            self.observations.append(noisy_sum_at(partial_sums, unit_noise, noise_std, self.watch))
            self.noise_multipliers.append(self.plan.sigma_at(self.step))
            if self._step_participation is not None:
                self.participations.append(self._step_participation)
        super()._apply_noise(partial_sums, unit_noise, noise_std)


def quietest_coordinates(config: TrainConfig, count: int, generator: np.random.Generator) -> np.ndarray:
    """The `count` parameter coordinates that real examples' clipped gradients touch least, at initialisation.

    Real gradients on a canary's coordinate are noise to its score, so the
    canaries go where the first PROBE_EXAMPLES training examples put the
    least total |clipped gradient| (ties broken at random). The choice uses
    no canary's inclusion, so the bound stays valid whatever it picks.
    """
    with torch.random.fork_rng():
        if config.seed is not None:
            torch.manual_seed(config.seed)  # the trainer's own initial weights
        model = build_model(config.model_spec)
    images, labels = load_split(config.dataset, "train", config.data_root)
    weights = flat_parameters(model)
    activity = np.zeros(parameter_count(model), dtype=np.float64)
    for index in range(min(PROBE_EXAMPLES, training_set_size(config))):
        gradient = per_example_clipped_sum(
            model, weights, images[index : index + 1], labels[index : index + 1], config.clip_norm, 1
        )
        activity += np.abs(gradient.double().numpy())
    shuffled = generator.permutation(activity.size)
    return shuffled[np.argsort(activity[shuffled], kind="stable")[:count]]


def mislabelled(
    images: torch.Tensor, labels: torch.Tensor, generator: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The images with each label replaced by one of the nine wrong ones, uniformly."""
    shift = torch.as_tensor(generator.integers(1, 10, size=len(labels)), dtype=labels.dtype)
    return images, (labels + shift) % 10


def _check_request(config: TrainConfig, canaries: int, confidence: float, mode: str, rows_per_canary: int) -> None:
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    if isinstance(rows_per_canary, bool) or not isinstance(rows_per_canary, int) or rows_per_canary < 1:
        raise UsageError(f"rows_per_canary must be an integer >= 1 (got {rows_per_canary!r})")
    if rows_per_canary > 1 and mode != "white-box":
        raise UsageError(f"canary users of {rows_per_canary} rows are gradient canaries: audit them in white-box "
                         "mode, or leave rows per canary at 1 for black-box")
    if config.shards:
        raise UsageError("an audit injects canaries at the driver's sampled indices, and with shards the examples "
                         "are sampled on their own nodes; audit the same model and settings without shards")
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < MIN_CANARIES:
        raise UsageError(
            f"canaries must be an integer >= {MIN_CANARIES} (got {canaries!r}); "
            "the smallest guess count is 1% of the canaries"
        )
    if not 0.0 < confidence < 1.0:
        raise UsageError(f"confidence must be in (0, 1), e.g. 0.95 (got {confidence!r})")
    if mode == "white-box":
        parameters = parameter_count(build_model(config.model_spec))
        if canaries > parameters:
            raise UsageError(
                f"white-box canaries each need their own parameter: at most {parameters} for "
                f"{config.model} (got {canaries}); lower --canaries"
            )
    if not isinstance(config.dataset, str) or config.dataset not in DATASETS:
        raise UsageError(f"audits run on the built-in datasets ({', '.join(DATASETS)}); "
                         f"got {spec_name(config.dataset)!r}")
    if mode == "black-box" and canaries > dataset_size(config.dataset, "test") // 2:
        raise UsageError(
            f"black-box canaries come from the second half of the {config.dataset} test split: at most "
            f"{dataset_size(config.dataset, 'test') // 2} (got {canaries}); lower --canaries"
        )


def verdict(
    epsilon_lower: float,
    epsilon_upper: float,
    privacy_unit: str = "example",
    rows_per_canary: int = 1,
    epsilon_upper_person: float | None = None,
) -> str:
    """One line: does the measured leakage stay within the accountant's bound?

    Canaries of several rows trained at example level are persons that the
    example-level epsilon does not cover: a lower bound above it is the
    missing user-level protection showing, not a fault of the implementation.
    Their bound is `epsilon_upper_person`, the group-privacy epsilon of a
    person of `rows_per_canary` rows; only a lower bound above that is a
    violation.
    """
    if privacy_unit == "example" and rows_per_canary > 1:
        if epsilon_upper_person is None:
            raise ValueError("canaries of several rows at example level need epsilon_upper_person, the group-privacy "
                             "bound of a person of that many rows")
        if epsilon_lower > epsilon_upper_person:
            return (
                f"VIOLATION: measured leakage (epsilon >= {epsilon_lower:.3g}) for canary users of {rows_per_canary} "
                f"rows exceeds their group-privacy bound {epsilon_upper_person:.3g}; the implementation is not as "
                "private as claimed"
            )
        if epsilon_lower > epsilon_upper:
            return (
                f"user-level leakage: epsilon >= {epsilon_lower:.3g} for canary users of {rows_per_canary} rows "
                f"exceeds the example-level epsilon {epsilon_upper:.3g}: rows of one person are not protected "
                f'together (group-privacy bound {epsilon_upper_person:.3g}; privacy_unit = "user" protects them)'
            )
        return (f"not shown: lower bound {epsilon_lower:.3g} for canary users of {rows_per_canary} rows <= "
                f"example-level epsilon {epsilon_upper:.3g}; a person of {rows_per_canary} rows is bounded only by "
                f"{epsilon_upper_person:.3g} (group privacy)")
    if epsilon_lower > epsilon_upper:
        return (
            f"VIOLATION: measured leakage (epsilon >= {epsilon_lower:.3g}) exceeds the accountant's bound "
            f"{epsilon_upper:.3g}; the implementation is not as private as claimed"
        )
    per_user = " (per user)" if privacy_unit == "user" else ""
    return f"consistent: lower bound {epsilon_lower:.3g} <= accountant {epsilon_upper:.3g}{per_user}"


def plot_scores(
    scores: np.ndarray, included: np.ndarray, guesses_in: int, guesses_out: int, path: Path, title: str
) -> None:
    """Write a PNG with the histograms of the canaries' scores, included against left out.

    Dashed lines mark where the guesses start: "in" above the right one,
    "out" below the left one.
    """
    figure, axis = plt.subplots(figsize=(6, 3.5))
    bins = np.histogram_bin_edges(scores, bins=60)
    axis.hist(scores[~included], bins=bins, alpha=0.6, label=f"left out ({(~included).sum()})", color="tab:blue")
    axis.hist(scores[included], bins=bins, alpha=0.6, label=f"included ({included.sum()})", color="tab:red")
    ranked = np.sort(scores)
    if guesses_in:
        axis.axvline(ranked[-guesses_in], color="tab:red", linestyle="--", linewidth=1)
    if guesses_out:
        axis.axvline(ranked[guesses_out - 1], color="tab:blue", linestyle="--", linewidth=1)
    axis.set(xlabel="canary score (higher = guessed included)", ylabel="canaries")
    axis.set_title(title, fontsize="medium")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_audit(
    config: TrainConfig,
    canaries: int | None = None,
    confidence: float = 0.95,
    mode: str = "white-box",
    noise: GaussianNoise | None = None,
    trainer_class: type[CanaryTrainer] = CanaryTrainer,
    seed: int | None = None,
    show_progress: bool = False,
    out=sys.stdout,
    rows_per_canary: int = 1,
) -> dict:
    """Train `config` once with canaries and return the audit (also written to run_dir/audit.json).

    `canaries` defaults to DEFAULT_CANARIES[mode]; `seed` fixes the canaries'
    inclusions and coordinates (default: the config's seed; entropy when both
    are None). `noise` and `trainer_class` are the Trainer's hooks (tests
    inject faults through them). With `rows_per_canary` > 1 (white-box) each
    canary is a person owning that many rows, grouped into one sampled user
    when the config's privacy_unit is "user" and sampled row by row
    otherwise. epsilon_lower holds at `confidence` and the config's delta;
    epsilon_upper is the PLD epsilon of the steps that ran, per the config's
    privacy unit; for canary users at example level, epsilon_upper_person is
    the group-privacy epsilon of a person of that many rows. The run is not
    charged to the privacy ledger.
    """
    canaries = DEFAULT_CANARIES.get(mode, 0) if canaries is None else canaries
    _check_request(config, canaries, confidence, mode, rows_per_canary)
    grouped = config.privacy_unit == "user"
    generator = make_generator(config.seed if seed is None else seed, CANARY_STREAM)
    test_images, test_labels = load_split(config.dataset, "test", config.data_root)
    canary_set, watch = _draw_canaries(config, canaries, mode, rows_per_canary, generator, test_images, test_labels)
    included = canary_set.included
    trainer = trainer_class(config, canary_set, watch=watch, noise=noise, show_progress=show_progress, out=out)
    owning = f" of {rows_per_canary} rows each" if rows_per_canary > 1 else ""
    trainer.say(release.line("audit_canaries", canaries=canaries, mode=mode, owning=owning,
                             first=trainer.real_dataset_size, last=trainer.plan.dataset_size - 1,
                             size=trainer.plan.dataset_size))
    summary = trainer.run()

    scores, statistic = _canary_scores(trainer, mode, canary_set, 1 if grouped else rows_per_canary)
    bound = audit_scores(scores, included, config.delta, confidence)
    epsilon_upper = get_accountant("pld").epsilon(trainer.record.events, config.delta)
    epsilon_upper_person, person_accountant = (_person_bound(trainer.record.events, rows_per_canary, config.delta)
                                               if rows_per_canary > 1 and not grouped else (None, None))
    membership = _membership_of_trained_model(trainer.model, config, test_images, test_labels)
    run_dir = Path(config.run_dir)
    png = run_dir / SCORES_PNG
    kind = f"{rows_per_canary}-row users, {config.privacy_unit} level" if rows_per_canary > 1 else f"{mode} canaries"
    plot_scores(scores, included, bound.guesses_in, bound.guesses_out, png,
                f"{kind}: epsilon >= {bound.epsilon_lower:.2f} (accountant {epsilon_upper:.2f})")
    result = {
        "epsilon_lower": bound.epsilon_lower,
        "epsilon_upper": epsilon_upper,
        "confidence": confidence,
        "delta": config.delta,
        "canaries": canaries,
        "guesses": bound.guesses,
        "correct": bound.correct,
        "guesses_in": bound.guesses_in,
        "guesses_out": bound.guesses_out,
        "guess_counts_tried": bound.tried,
        "mode": mode,
        "rows_per_canary": rows_per_canary,
        "privacy_unit": config.privacy_unit,
        "statistic": statistic,
        "epsilon_upper_person": epsilon_upper_person,
        "epsilon_upper_person_accountant": person_accountant,
        "verdict": verdict(bound.epsilon_lower, epsilon_upper, config.privacy_unit, rows_per_canary,
                           epsilon_upper_person),
        # Higher score = guessed included, so minus the score plays the part of a loss.
        "canary_membership": loss_attack_figures(-scores[included], -scores[~included]),
        "membership": membership,
        "test_accuracy": summary["test_accuracy"],
        "steps": summary["steps"],
        "sampling_rate": trainer.plan.sampling_rate,
        "noise_multiplier": trainer.plan.noise_multiplier,
        "clip_norm": config.clip_norm,
        "run_dir": str(run_dir),
        "scores_png": str(png),
    }
    (run_dir / AUDIT_JSON).write_text(json.dumps(release.record("audit.json", result), indent=2, sort_keys=True))
    return result


def _draw_canaries(
    config: TrainConfig, canaries: int, mode: str, rows_per_canary: int, generator: np.random.Generator,
    test_images: torch.Tensor, test_labels: torch.Tensor,
) -> tuple[Canaries, np.ndarray | None]:
    """The audit's canaries, each included with probability 1/2, and the coordinates to watch (white-box only).

    White-box canaries are Dirac gradients on the quietest coordinates;
    black-box ones are mislabelled examples from the end of the test split.
    """
    included = generator.random(canaries) < 0.5
    if mode == "white-box":
        watch = quietest_coordinates(config, canaries, generator)
        return DiracCanaries(watch, included, rows_per_canary, config.privacy_unit == "user"), watch
    return MislabelledCanaries(
        *mislabelled(test_images[-canaries:], test_labels[-canaries:], generator), included,
        config.max_physical_batch,
    ), None


def _canary_scores(trainer: CanaryTrainer, mode: str, canary_set: Canaries,
                   sampled_rows: int) -> tuple[np.ndarray, str]:
    """Each canary's score (higher = guessed included) after the run, and a line saying what the score is.

    White-box: the likelihood ratio of the noisy sums watched at the
    canary's coordinate, for a canary of `sampled_rows` rows per sampled
    unit (1 when grouped: a canary is one sampled user). Black-box: minus
    the trained model's loss on the canary.
    """
    if mode != "white-box":
        return (-example_losses(trainer.model, canary_set.images, canary_set.labels),
                "minus the final model's loss on the mislabelled canary")
    observations, noise_multipliers = np.array(trainer.observations), np.array(trainer.noise_multipliers)
    correlation = trainer.plan.correlation
    if correlation is not None:
        observations, noise_multipliers = decorrelated_observations(correlation, observations,
                                                                    trainer.plan.noise_multiplier)
    if trainer.participations:
        # The decorrelation is linear: an included canary's decorrelated contribution is its schedule's image.
        patterns, _ = decorrelated_observations(correlation, np.array(trainer.participations, dtype=np.float64),
                                                trainer.plan.noise_multiplier)
        return (pattern_canary_scores(observations, patterns, noise_multipliers, trainer.config.clip_norm),
                "sum over steps of s (x / C - s / 2) / sigma^2 on the canary's coordinate, s its decorrelated "
                "fixed-order schedule")
    scores = dirac_canary_scores(observations, trainer.plan.sampling_rate, noise_multipliers,
                                 trainer.config.clip_norm, sampled_rows)
    if sampled_rows == 1:
        return scores, "sum over steps of log(1 - q + q exp((x C - C^2/2) / (sigma C)^2)) on the canary's coordinate"
    return scores, (f"sum over steps of log E[exp(b (x / C - b / 2) / sigma^2)], b ~ Binomial({sampled_rows}, q), "
                    "on the canary's coordinate")


def _person_bound(events: Composition, rows_per_canary: int, delta: float) -> tuple[float, str]:
    """What a run's example-level `events` bound for a person of `rows_per_canary` rows, and the accountant used.

    That is the bound of canary users trained at example level (group privacy).
    """
    epsilon, shown = labelled_epsilon(get_accountant("pld"), group_events(events, rows_per_canary), delta)
    return epsilon, "rdp" if shown == PLD_FALLBACK_LABEL else "pld"


def _membership_of_trained_model(model: torch.nn.Module, config: TrainConfig, test_images: torch.Tensor,
                                 test_labels: torch.Tensor) -> dict:
    """The loss attack's figures on the first training rows against the first half of the test split."""
    train_images, train_labels = load_split(config.dataset, "train", config.data_root)
    members = min(_MEMBERSHIP_EXAMPLES, training_set_size(config))  # rows, also when users are sampled
    # Black-box canaries come from the second half of the test split, so the first half is never trained on.
    nonmembers = min(_MEMBERSHIP_EXAMPLES, len(test_labels) // 2)
    return membership_report(model, train_images[:members], train_labels[:members],
                             test_images[:nonmembers], test_labels[:nonmembers])
