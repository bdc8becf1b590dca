"""Empirical lower bounds on epsilon from one training run (pure functions over counts and scores).

The bound is that of Steinke, Nasr and Jagielski, "Privacy auditing with one
(1) training run" (NeurIPS 2023): their (epsilon, delta) theorem, computed as
by the p-value procedure of their Appendix D. The setting: m canaries are each included in the training data
independently with probability 1/2; after training, an auditor that does not
know the inclusions guesses "in" or "out" on r of them and abstains on the
rest; v guesses are right. If training is (epsilon, delta)-DP, then

    P[v correct] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 m delta alpha,
    alpha = max over i in 1..v of P[v > Binomial(r, e^eps / (1 + e^eps)) >= v - i] / i,

so a run whose observed v has that p-value below beta refutes
(epsilon, delta)-DP at confidence 1 - beta. ``epsilon_lower_bound`` returns
the largest such epsilon (the p-value grows with epsilon, so bisection finds
it). It is a lower bound on the epsilon of the implementation *as it ran*,
at the given delta and confidence, against this particular auditor: a weak
auditor gives a small bound, never a wrong one.

Why this bound: it needs one training run (not hundreds), avoids the group
privacy cost of inserting many canaries at once, and holds for any auditor
and any DP algorithm, black-box or white-box. Its price is looseness at large
epsilon: r guesses, all correct, can never certify more than the epsilon of
randomized response that is right r times in a row (``perfect_guess_bound``).

Choosing how many guesses to make after looking at the scores is a second
test per choice. ``audit_scores`` therefore tries a fixed list of guess counts
and spends the failure probability beta evenly across them (Bonferroni), so
the bound it reports holds at the stated confidence; the paper's
experiments report the best count without that correction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import special, stats

_BISECTION_STEPS = 60


class AuditError(ValueError):
    """Counts, scores or levels outside what the one-run bound accepts."""


def randomized_response_accuracy(epsilon: float) -> float:
    """e^eps / (1 + e^eps): the best accuracy of an eps-DP guess on a fair coin."""
    return float(special.expit(epsilon))


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise AuditError(
            f"need 0 <= correct <= guesses <= canaries (got correct={correct}, guesses={guesses}, "
            f"canaries={canaries}); guesses counts only canaries the auditor did not abstain on"
        )


def _check_delta(delta: float) -> None:
    if not 0.0 <= delta < 1.0:
        raise AuditError(f"delta must be in [0, 1) (got {delta!r})")


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise AuditError(f"confidence must be in (0, 1), e.g. 0.95 (got {confidence!r})")


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Largest probability that an (epsilon, delta)-DP run lets the auditor be right `correct` times or more.

    `canaries` (m) were each included with probability 1/2; the auditor
    guessed on `guesses` (r) of them. Small values refute (epsilon, delta)-DP.
    The binomial tails come from scipy's regularised incomplete beta, so the
    value stays accurate far into the tails for r in the millions.
    """
    _check_counts(canaries, guesses, correct)
    if epsilon < 0:
        raise AuditError(f"epsilon must be >= 0 (got {epsilon!r})")
    _check_delta(delta)
    accuracy = randomized_response_accuracy(epsilon)
    tail = float(stats.binom.sf(correct - 1, guesses, accuracy))
    if delta == 0.0 or correct == 0:
        return min(tail, 1.0)
    # P[v > Binomial >= v - i] for i = 1..v is a running sum of the pmf going down from v - 1.
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, accuracy)
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(tail + 2.0 * canaries * delta * alpha, 1.0)


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float) -> float:
    """The largest epsilon that the observed counts refute at `confidence` (0 when they refute none).

    That is the supremum of epsilon with ``p_value(...) < 1 - confidence``,
    found by bisection (60 halvings, far below any meaningful digit). The
    doubling search ends: once e^eps / (1 + e^eps) rounds to 1, the p-value is 1.
    """
    _check_counts(canaries, guesses, correct)
    _check_delta(delta)
    _check_confidence(confidence)
    beta = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < beta:
        low, high = high, 2.0 * high
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if p_value(canaries, guesses, correct, middle, delta) < beta:
            low = middle
        else:
            high = middle
    return low


def perfect_guess_bound(guesses: int, confidence: float) -> float:
    """The epsilon that `guesses` correct guesses out of `guesses` certify when delta = 0.

    Closed form: accuracy^r = beta, so epsilon = logit(beta^(1/r)), or 0 when
    even r right guesses are likely at chance. No auditor making that many
    guesses can certify more, whatever the true epsilon.
    """
    _check_confidence(confidence)
    if guesses < 1:
        raise AuditError(f"guesses must be >= 1 (got {guesses})")
    return max(0.0, float(special.logit((1.0 - confidence) ** (1.0 / guesses))))


def dirac_canary_scores(
    observations: np.ndarray,
    sampling_rate: float,
    noise_multipliers: np.ndarray,
    clip_norm: float,
    rows_per_canary: int = 1,
) -> np.ndarray:
    """One score per gradient canary: the log-likelihood ratio of "included" against "absent".

    `observations` is [steps, canaries]: at each step, the noisy gradient sum
    on each canary's own coordinate. An included canary owns
    `rows_per_canary` (m) rows, each sampled on its own by Poisson sampling
    (rate q) and each adding `clip_norm` to that coordinate; with m = 1 the
    canary is one sampled unit (an example, or a user under user-level
    privacy). The step's noise is N(0, (sigma_t * C)^2), so given b of the m
    rows sampled the likelihood ratio is exp(b (x / C - b / 2) / sigma_t^2),
    and with b ~ Binomial(m, q) the step's ratio is its binomial mixture
    (1 - q + q * exp((x C - C^2 / 2) / (sigma_t * C)^2) when m = 1). The score
    is the sum of their logarithms over the steps: by Neyman-Pearson, the
    most powerful statistic for one canary when nothing else touches its
    coordinate. Real examples' gradients on that coordinate only add noise.
    """
    observations = np.asarray(observations, dtype=np.float64)
    noise_multipliers = np.asarray(noise_multipliers, dtype=np.float64)
    if observations.ndim != 2 or noise_multipliers.shape != (observations.shape[0],):
        raise AuditError(
            f"observations must be [steps, canaries] with one noise multiplier per step "
            f"(got {observations.shape} and {noise_multipliers.shape})"
        )
    if not 0.0 < sampling_rate <= 1.0:
        raise AuditError(f"sampling_rate must be in (0, 1] (got {sampling_rate!r})")
    if not (clip_norm > 0 and np.all(noise_multipliers > 0)):
        raise AuditError("clip_norm and every noise multiplier must be > 0")
    if isinstance(rows_per_canary, bool) or not isinstance(rows_per_canary, (int, np.integer)) or rows_per_canary < 1:
        raise AuditError(f"rows_per_canary must be an integer >= 1 (got {rows_per_canary!r})")
    rows = np.arange(rows_per_canary + 1, dtype=np.float64)
    # log P[b rows sampled] is -inf for b = 0 when q = 1: every row is in every batch.
    with np.errstate(divide="ignore"):
        log_sampled = stats.binom.logpmf(rows, rows_per_canary, sampling_rate)
    scores = np.zeros(observations.shape[1])
    # One step at a time keeps the [canaries, m + 1] terms small for long runs.
    for observed, sigma in zip(observations, noise_multipliers):
        exponent = rows * (observed[:, None] / clip_norm - rows / 2) / sigma**2
        scores += special.logsumexp(log_sampled + exponent, axis=-1)
    return scores


def pattern_canary_scores(
    observations: np.ndarray, patterns: np.ndarray, noise_multipliers: np.ndarray, clip_norm: float
) -> np.ndarray:
    """One score per gradient canary whose contribution at each step, when included, is known: its log-likelihood
    ratio of "included" against "absent".

    `observations` is [steps, canaries] as for `dirac_canary_scores`;
    `patterns` (same shape) is what an included canary adds to its
    coordinate at each step, in clip norms, and must not depend on which
    canaries are included (then any score gives a valid bound). Under
    fixed-order participation it is the mechanism's own schedule, which
    claims no amplification, so the auditor may know it. With independent
    noise N(0, (sigma_t * C)^2) the ratio is exp(sum_t s_t (x_t / C - s_t / 2)
    / sigma_t^2), the most powerful statistic for one canary (Neyman-Pearson);
    a canary that never takes part scores 0.
    """
    observations = np.asarray(observations, dtype=np.float64)
    patterns = np.asarray(patterns, dtype=np.float64)
    noise_multipliers = np.asarray(noise_multipliers, dtype=np.float64)
    if observations.ndim != 2 or patterns.shape != observations.shape \
            or noise_multipliers.shape != (observations.shape[0],):
        raise AuditError(
            f"observations and patterns must both be [steps, canaries] with one noise multiplier per step "
            f"(got {observations.shape}, {patterns.shape} and {noise_multipliers.shape})"
        )
    if not (clip_norm > 0 and np.all(noise_multipliers > 0)):
        raise AuditError("clip_norm and every noise multiplier must be > 0")
    return (patterns * (observations / clip_norm - patterns / 2) / noise_multipliers[:, None] ** 2).sum(axis=0)


def count_correct(scores: np.ndarray, included: np.ndarray, guesses_in: int, guesses_out: int) -> tuple[int, int]:
    """(guesses, correct): "in" for the `guesses_in` highest scores, "out" for the `guesses_out` lowest.

    The auditor abstains on every other canary.

    `scores` is one number per canary (higher = more likely included);
    `included` is the canaries' true inclusion, used only to count hits.
    Ties are broken by canary order, which the scores do not depend on.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape:
        raise AuditError(
            f"scores and included must be 1-D and of the same length (got {scores.shape} and {included.shape})"
        )
    if not np.all(np.isfinite(scores)):
        raise AuditError("scores must be finite; a nan or inf score cannot be ranked")
    if guesses_in < 0 or guesses_out < 0 or guesses_in + guesses_out > scores.size:
        raise AuditError(
            f"guesses_in and guesses_out must be >= 0 with a sum <= {scores.size} canaries "
            f"(got {guesses_in} and {guesses_out})"
        )
    order = np.argsort(-scores, kind="stable")
    said_in = order[:guesses_in]
    said_out = order[scores.size - guesses_out :]
    correct = int(included[said_in].sum()) + int((~included[said_out]).sum())
    return guesses_in + guesses_out, correct


@dataclass(frozen=True)
class AuditBound:
    """The result of auditing one run: the bound and the guesses behind it.

    `epsilon_lower` holds at `confidence` and `delta` for the whole audit
    (all tried guess counts included); `guesses_in` and `guesses_out` are the
    counts that gave it; `tried` is how many (in, out) counts were tried.
    """

    epsilon_lower: float
    canaries: int
    guesses: int
    correct: int
    guesses_in: int
    guesses_out: int
    confidence: float
    delta: float
    tried: int


def guess_splits(canaries: int, fractions: Sequence[float] = (0.01, 0.02, 0.05, 0.1, 0.2)) -> list[tuple[int, int]]:
    """The (guesses_in, guesses_out) counts an audit of `canaries` tries, fixed before any score is seen.

    For each fraction f: round(f * m) "in" guesses alone, and the same number
    of "in" and of "out" guesses. Counts of 0 are dropped and duplicates merged.
    """
    splits = []
    for fraction in fractions:
        count = int(round(fraction * canaries))
        if count >= 1:
            splits += [(count, 0), (count, count)]
    return sorted({split for split in splits if sum(split) <= canaries})


def audit_scores(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float,
    splits: Sequence[tuple[int, int]] | None = None,
) -> AuditBound:
    """The best lower bound over the guess counts in `splits`, valid at `confidence` as a whole.

    Each split is tested at confidence 1 - (1 - confidence) / len(splits)
    (Bonferroni), so picking the best one after the fact keeps the overall
    level. `splits` defaults to ``guess_splits(len(scores))``.
    """
    _check_delta(delta)
    _check_confidence(confidence)
    canaries = len(scores)
    splits = list(guess_splits(canaries) if splits is None else splits)
    if not splits:
        raise AuditError(f"no guess counts to try for {canaries} canaries; audit at least 100 canaries")
    per_test_confidence = 1.0 - (1.0 - confidence) / len(splits)
    best = None
    for guesses_in, guesses_out in splits:
        guesses, correct = count_correct(scores, included, guesses_in, guesses_out)
        bound = epsilon_lower_bound(canaries, guesses, correct, delta, per_test_confidence)
        if best is None or bound > best.epsilon_lower:
            best = AuditBound(bound, canaries, guesses, correct, guesses_in, guesses_out, confidence, delta,
                              len(splits))
    return best
