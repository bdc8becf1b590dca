"""Integer noise for the silos' shares: the discrete Gaussian, drawn exactly from a cryptographic bit stream.

The sampler is Canonne, Kamath and Steinke's ("The Discrete Gaussian for
Differential Privacy", NeurIPS 2020, arXiv 2004.00010, Algorithms 1-3), in
integer arithmetic only: a Bernoulli(exp(−n/d)) trial for integers n, d
(Algorithm 1), the discrete Laplace of scale t (Algorithm 2), and the
discrete Gaussian N_Z(0, t²) by rejection from it (Algorithm 3 with σ = t,
so the acceptance exponent (|y| − t)² / (2t²) splits into three fractions of
integers below 2^63). Every trial compares a uniform integer, drawn by
rejection from masked 64-bit words, with an integer: no floating point, so
the output has the discrete Gaussian's law exactly. The words are ChaCha20's
keystream under a 32-byte key from the operating system's entropy
(``secrets``); a fixed key (tests only) replays a stream.

Each array operation runs over every pending coordinate at once, and the
coordinates a rejection sends back are drawn again until none is left.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

from workers.secure_aggregation.masks import SEED_BYTES, expand_mask

# t ≤ 2^28 keeps 2t² · K below 2^63 for every K that Algorithm 1 reaches (K ≥ 32 has probability below 10^-35).
LARGEST_SCALE = 2**28
MAX_DISCRETE_GAUSSIAN_VARIANCE = float(LARGEST_SCALE) ** 2
_LARGEST_TRIAL = 32


class RandomWords:
    """A stream of uniform 64-bit words: ChaCha20's keystream under a key from OS entropy (or `key`, tests only).

    The key stays in this object, which has no readable ``repr`` and refuses
    to be pickled.
    """

    def __init__(self, key: bytes | None = None):
        if key is not None and len(key) != SEED_BYTES:
            raise ValueError(f"a random stream's key is {SEED_BYTES} bytes (got {len(key)})")
        self._key = key if key is not None else secrets.token_bytes(SEED_BYTES)
        self._draws = 0

    def words(self, size: int) -> np.ndarray:
        """`size` fresh uniform uint64 words; no two calls read the same part of the stream."""
        self._draws += 1
        return expand_mask(self._key, self._draws, size)

    def below(self, bounds: np.ndarray | int, size: int | None = None) -> np.ndarray:
        """One uniform integer in 0..bound − 1 for each of `bounds` (int64, each in 1..2^62; or one int bound for
        `size` draws), exactly: a word masked to the bound's bit length is kept when it is below the bound, else
        drawn again."""
        if size is not None:
            if not 1 <= bounds <= 2**62:
                raise ValueError(f"uniform integers need a bound in 1..2^62 (got {bounds})")
            # One bound: its mask is one word, and no per-draw bound is gathered.
            mask, bound = np.uint64((1 << (int(bounds) - 1).bit_length()) - 1), np.int64(bounds)
            values = (self.words(size) & mask).astype(np.int64)
            redraw = np.flatnonzero(values >= bound)
            while redraw.size:
                drawn = (self.words(redraw.size) & mask).astype(np.int64)
                values[redraw] = drawn
                redraw = redraw[drawn >= bound]
            return values
        bounds = np.asarray(bounds, dtype=np.int64)
        if bounds.size and not (bounds.min() >= 1 and bounds.max() <= 2**62):
            raise ValueError(f"uniform integers need bounds in 1..2^62 (got {bounds.min()}..{bounds.max()})")
        # The smallest all-ones word ≥ bound − 1: the bit length's mask, by smearing the top bit down.
        masks = (bounds - 1).astype(np.uint64)
        for shift in (1, 2, 4, 8, 16, 32):
            masks |= masks >> np.uint64(shift)
        values = (self.words(bounds.size) & masks).astype(np.int64)
        redraw = np.flatnonzero(values >= bounds)
        while redraw.size:
            drawn = (self.words(redraw.size) & masks[redraw]).astype(np.int64)
            values[redraw] = drawn
            redraw = redraw[drawn >= bounds[redraw]]
        return values

    def __repr__(self) -> str:
        return "RandomWords(<key hidden>)"

    def __reduce__(self):
        raise TypeError("a RandomWords holds a noise key: it lives in memory only, never pickled or sent")


def bernoulli_exp(words: RandomWords, numerators: np.ndarray, denominator: int) -> np.ndarray:
    """One Bernoulli(exp(−n/d)) trial for each of `numerators` n ≥ 0 (int64) over the one `denominator` d ≥ 1,
    exactly.

    exp(−n/d) = exp(−1)^⌊n/d⌋ · exp(−(n mod d)/d), each factor by Algorithm 1
    of Canonne et al.: for γ in [0, 1], count K while Bernoulli(γ/K) succeeds;
    K is odd with probability exp(−γ).
    """
    whole, remainder = np.divmod(np.asarray(numerators, dtype=np.int64), denominator)
    result = _exp_fraction(words, remainder, denominator)
    pending = np.flatnonzero(result & (whole > 0))
    while pending.size:
        kept = _exp_fraction(words, np.ones(pending.size, dtype=np.int64), 1)
        result[pending[~kept]] = False
        whole[pending] -= 1
        pending = pending[kept & (whole[pending] > 0)]
    return result


def _exp_fraction(words: RandomWords, numerators: np.ndarray, denominator: int) -> np.ndarray:
    """Bernoulli(exp(−n/d)) for each n ≤ d (Algorithm 1 of Canonne et al.).

    Every trial still pending at a round has succeeded the same number of
    times, so one K serves them all.
    """
    result = np.empty(numerators.size, dtype=bool)
    pending, trial = np.arange(numerators.size), 1
    while pending.size:
        if trial >= _LARGEST_TRIAL:
            raise RuntimeError("a Bernoulli(exp(-γ)) trial ran past its bound; the random stream is broken")
        succeeded = words.below(denominator * trial, pending.size) < numerators
        result[pending[~succeeded]] = trial % 2 == 1
        pending, numerators, trial = pending[succeeded], numerators[succeeded], trial + 1
    return result


def discrete_laplace(words: RandomWords, scale: int, size: int) -> np.ndarray:
    """`size` draws of the discrete Laplace of scale t = `scale`: P(y) ∝ exp(−|y|/t) on the integers (int64;
    Algorithm 2 of Canonne et al.)."""
    values = np.empty(size, dtype=np.int64)
    pending = np.arange(size)
    while pending.size:
        count = pending.size
        remainders = words.below(scale, count)
        kept = bernoulli_exp(words, remainders, scale)
        # The multiples of t: a geometric count of Bernoulli(exp(−1)) successes.
        multiples = np.zeros(count, dtype=np.int64)
        counting = np.flatnonzero(kept)
        while counting.size:
            succeeded = _exp_fraction(words, np.ones(counting.size, dtype=np.int64), 1)
            multiples[counting[succeeded]] += 1
            counting = counting[succeeded]
        magnitudes = remainders + scale * multiples
        negative = words.below(2, count) == 1
        # −0 would count zero twice.
        kept &= ~(negative & (magnitudes == 0))
        signed = np.where(negative, -magnitudes, magnitudes)
        values[pending[kept]] = signed[kept]
        pending = pending[~kept]
    return values


def discrete_gaussian(words: RandomWords, scale: int, size: int) -> np.ndarray:
    """`size` draws of the discrete Gaussian N_Z(0, t²), t = `scale`: P(y) ∝ exp(−y² / (2t²)) (int64).

    Algorithm 3 of Canonne et al. with σ = t: a discrete Laplace draw y of
    scale t is kept with probability exp(−(|y| − t)² / (2t²)); writing
    ||y| − t| = u·t + w (0 ≤ w < t), that exponent is u²/2 + u·w/t + w²/(2t²),
    three integer fractions tried one after another.
    """
    if isinstance(scale, bool) or int(scale) != scale or not 1 <= scale <= LARGEST_SCALE:
        raise ValueError(f"the discrete Gaussian's scale t must be an integer in 1..2^28 (got {scale!r})")
    scale = int(scale)
    values = np.empty(size, dtype=np.int64)
    pending = np.arange(size)
    while pending.size:
        count = pending.size
        drawn = discrete_laplace(words, scale, count)
        whole, part = np.divmod(np.abs(np.abs(drawn) - scale), scale)
        kept = bernoulli_exp(words, whole * whole, 2)
        for numerators, denominator in ((whole * part, scale), (part * part, 2 * scale * scale)):
            trying = np.flatnonzero(kept)
            kept[trying] = bernoulli_exp(words, numerators[trying], denominator)
        values[pending[kept]] = drawn[kept]
        pending = pending[~kept]
    return values


def noise_scale_for(variance: float) -> int:
    """The integer t with t² the smallest square ≥ `variance`: a share drawn at scale t has at least that
    variance (the accountant's), never less."""
    if not 0 < variance <= MAX_DISCRETE_GAUSSIAN_VARIANCE:
        raise ValueError(f"a noise share's variance must lie in (0, {MAX_DISCRETE_GAUSSIAN_VARIANCE:.3g}] (got "
                         f"{variance}); lower noise_multiplier or the model's size")
    scale = math.isqrt(math.ceil(variance))
    return scale if scale * scale >= variance else scale + 1


def noise_share(words: RandomWords, variance: float, size: int) -> np.ndarray:
    """`size` coordinates of one silo's noise share: N_Z(0, t²) with t² ≥ `variance` (ring units), int64."""
    return discrete_gaussian(words, noise_scale_for(variance), size)
