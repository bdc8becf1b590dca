"""The attacker of docs/threat-model.md: from every file a run leaves behind, recompute a step's noise or sample.

A run's ε holds only if nobody who reads its files (the released model,
metrics, summary, logs, and the checkpoints) can recompute any step's noise
vector (then the un-noised sum is the released update minus it) or any step's
sample (then the run is not subsampled). `harvest` reads every file and
collects every integer, byte string, integer array, float array and generator
state in it, recursively; `attack` tries each of them against what the run
really drew (`Truth`, recorded in the test's memory):

- as the driver's or a silo worker's key, through the project's own
  derivation (`workers.keys`, `workers.sampling`, `orchestrator.noise`),
  and as a test seed through it;
- as numpy seed material: the root entropy of a ``SeedSequence`` spawned per
  (kind, step, chunk) as noise once was, and ``default_rng`` seeds and streams
  sampled one step after another;
- as a numpy bit generator state, run forwards step by step with the
  sampler and with version 1's (`version_one_poisson_sample`), and rewound
  (PCG64's ``advance(-n)``) by whole steps of version 1's, which moved the
  generator by one double per example;
- and it looks for a sample's indices or a noise vector's values stored as such.

A finding names the file and the field. The tests assert there is none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from orchestrator.checkpoint import read_checkpoint
from orchestrator.noise import CHUNK_VALUES, GRADIENT_NOISE, SECURE_DRAWS, GaussianNoise, fill_unit_normal
from workers.keys import KEY_BYTES, SecretKey, process_key
from workers.sampling import local_poisson_sample, poisson_sample, step_generator

# Values of a noise vector compared; a chance match of 8 float64 values does not happen.
COMPARED_VALUES = 8
# Of a file that is neither a checkpoint nor text (a plot), the bytes tried as keys.
RAW_BYTES = 4096
# Streams of a seed the old driver used (sampler 0, noise 1, local sampling 2, user rows 3).
SEED_STREAMS = range(4)
_INTEGER = re.compile(r"-?\d+")
_HEX = re.compile(r"\b[0-9a-fA-F]{16,}\b")


@dataclass
class Truth:
    """What a run drew, kept in the test's memory: each step's unit noise and each sampler's samples.

    `samples` maps a sampler ("driver", or a silo worker's (shard, worker))
    to {step: sorted indices}; `population` gives each sampler's example
    count, and `sampling_rate` is q.
    """

    sampling_rate: float
    secure: bool = True
    noise: dict[int, np.ndarray] = field(default_factory=dict)
    samples: dict[object, dict[int, np.ndarray]] = field(default_factory=dict)
    population: dict[object, int] = field(default_factory=dict)

    def add_sample(self, sampler, step: int, indices, population: int) -> None:
        """Record sampler `sampler`'s sample of step `step` over its `population` examples."""
        self.samples.setdefault(sampler, {})[step] = np.sort(np.asarray(indices, dtype=np.int64))
        self.population[sampler] = population


@dataclass
class Harvest:
    """Everything an attacker can read in the files, by kind, each with where it was found."""

    integers: dict[int, str] = field(default_factory=dict)
    blobs: dict[bytes, str] = field(default_factory=dict)
    integer_arrays: list[tuple[np.ndarray, str]] = field(default_factory=list)
    float_arrays: list[tuple[np.ndarray, str]] = field(default_factory=list)
    generator_states: list[tuple[dict, str]] = field(default_factory=list)


def harvest(paths: list[Path]) -> Harvest:
    """Read every file in `paths` (folders recursively) as checkpoint, JSON, JSON lines or text, and collect it."""
    found = Harvest()
    files = sorted({file for path in paths for file in ([path] if path.is_file() else path.rglob("*"))
                    if file.is_file()})
    for file in files:
        for where, value in _parsed(file):
            _collect(value, where, found)
    return found


def _parsed(file: Path):
    """(where, value) for what `file` holds: a checkpoint's state, JSON, JSON lines, text, else its first bytes."""
    data = file.read_bytes()
    state = read_checkpoint(file) if file.suffix == ".pt" else None
    if state is not None:
        yield str(file), state
        return
    try:
        text = data.decode()
    except UnicodeDecodeError:
        yield f"{file} (raw bytes)", data[:RAW_BYTES]
        return
    try:
        yield str(file), json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    lines = text.splitlines()
    try:
        yield str(file), [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError:
        yield str(file), text


def _collect(value, where: str, found: Harvest) -> None:
    """Add `value`, and everything inside it, to `found`."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return
    if isinstance(value, (int, np.integer)):
        found.integers.setdefault(int(value), where)
    elif isinstance(value, str):
        for match in _INTEGER.findall(value):
            found.integers.setdefault(int(match), where)
        for match in _HEX.findall(value):
            found.integers.setdefault(int(match, 16), where)
            if len(match) % 2 == 0:
                found.blobs.setdefault(bytes.fromhex(match), where)
        if len(value) <= 4 * KEY_BYTES:
            found.blobs.setdefault(value.encode(), where)
    elif isinstance(value, (bytes, bytearray)):
        found.blobs.setdefault(bytes(value), where)
    elif isinstance(value, dict):
        if {"state", "inc"} <= set(value) or "bit_generator" in value:
            found.generator_states.append((value, where))
        for key, item in value.items():
            _collect(key, f"{where}: key", found)
            _collect(item, f"{where}[{key!r}]", found)
    elif isinstance(value, (list, tuple, set)):
        for index, item in enumerate(value):
            _collect(item, f"{where}[{index}]", found)
    elif isinstance(value, (torch.Tensor, np.ndarray)):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        array = array.reshape(-1)
        if np.issubdtype(array.dtype, np.integer):
            found.integer_arrays.append((array.astype(np.int64), where))
            for item in np.unique(array)[:10_000]:
                found.integers.setdefault(int(item), where)
        elif np.issubdtype(array.dtype, np.floating):
            found.float_arrays.append((array.astype(np.float64), where))
    elif hasattr(value, "__dict__"):
        _collect(vars(value), where, found)


def attack(found: Harvest, truth: Truth) -> list[str]:
    """Every way `found` lets the attacker recompute a step's noise or sample of `truth` (empty when none)."""
    findings = _stored_as_such(found, truth)
    for key, where in _candidate_keys(found):
        findings += _through_the_key(key, where, truth)
    for value, where in found.integers.items():
        findings += _through_numpy_seeds(value, where, truth)
    for state, where in found.generator_states:
        findings += _through_generator_state(state, where, truth)
    return findings


def _stored_as_such(found: Harvest, truth: Truth) -> list[str]:
    findings = []
    samples = [(sampler, step, indices) for sampler, steps in truth.samples.items()
               for step, indices in steps.items() if indices.size]
    for array, where in found.integer_arrays:
        values = np.unique(array)
        for sampler, step, indices in samples:
            if values.size == indices.size and np.array_equal(values, indices):
                findings.append(f"{where} holds the sample of {sampler} at step {step}")
    for array, where in found.float_arrays:
        for step, noise in truth.noise.items():
            if np.isin(noise[:COMPARED_VALUES], array).all() or np.isin(
                    noise[:COMPARED_VALUES].astype(np.float32), array.astype(np.float32)).all():
                findings.append(f"{where} holds the noise of step {step}")
    return findings


def _candidate_keys(found: Harvest):
    """Every key the harvest could be: each 32-byte string or window, each integer in either byte order, each seed."""
    seen = set()

    def once(key: SecretKey, where: str):
        material = key.derive("attacker")
        if material not in seen:
            seen.add(material)
            yield key, where

    for blob, where in found.blobs.items():
        for start in range(0, max(1, len(blob) - KEY_BYTES + 1), 8):
            window = blob[start:start + KEY_BYTES]
            if len(window) == KEY_BYTES:
                yield from once(SecretKey(window), f"{where} bytes {start}..{start + KEY_BYTES}")
    for value, where in found.integers.items():
        for order in ("little", "big"):
            yield from once(SecretKey((value % 2**256).to_bytes(KEY_BYTES, order)), f"{where} = {value} as a key")
        yield from once(process_key(value), f"{where} = {value} as the driver's seed")


def _noise_chunk(generator: np.random.Generator, truth: Truth) -> np.ndarray:
    """The first values of a vector's first chunk as the driver fills it from `generator`.

    Plain noise's first values are the stream's first draws; secure noise's add up draws a chunk apart.
    """
    size = min(CHUNK_VALUES, next(iter(truth.noise.values())).size) if truth.secure else COMPARED_VALUES
    values = np.empty(size)
    fill_unit_normal(generator, values, SECURE_DRAWS if truth.secure else 1)
    return values[:COMPARED_VALUES]


def _noise_matches(generator: np.random.Generator, step: int, truth: Truth) -> bool:
    return np.array_equal(_noise_chunk(generator, truth), truth.noise[step][:COMPARED_VALUES])


def _through_the_key(key: SecretKey, where: str, truth: Truth) -> list[str]:
    findings = []
    noise = GaussianNoise(key, truth.secure, threads=1)
    for step in truth.noise:
        if _noise_matches(noise.chunk_generator((GRADIENT_NOISE, step), 0), step, truth):
            findings.append(f"{where} reproduces the noise of step {step}")
    for sampler, steps in truth.samples.items():
        population = truth.population[sampler]
        for step, indices in steps.items():
            if sampler == "driver":
                drawn = poisson_sample(step_generator(key, step), population, truth.sampling_rate)
            else:
                drawn = local_poisson_sample(key, step, population, truth.sampling_rate)
            if np.array_equal(drawn, indices):
                findings.append(f"{where} reproduces the sample of {sampler} at step {step}")
    return findings


def _through_numpy_seeds(value: int, where: str, truth: Truth) -> list[str]:
    findings = []
    if value < 0:
        return findings
    for step in truth.noise:
        # The SeedSequence-per-chunk derivation of the noise's root entropy, with and without the chunk.
        for spawn_key in ((GRADIENT_NOISE, step, 0), (GRADIENT_NOISE, step)):
            generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(value, spawn_key=spawn_key)))
            if _noise_matches(generator, step, truth):
                findings.append(f"{where} = {value} as the noise's root entropy reproduces the noise of step {step}")
    for seed in [value, *([value, stream] for stream in SEED_STREAMS)]:
        findings += [f"{where} = {value} as a numpy seed {finding}"
                     for finding in _sequential_samples(np.random.default_rng(seed), truth)]
    return findings


def _sequential_samples(generator: np.random.Generator, truth: Truth, sample=poisson_sample) -> list[str]:
    """Which recorded samples a generator reproduces when it draws one step after another with `sample`."""
    findings = []
    for sampler, steps in truth.samples.items():
        population = truth.population[sampler]
        state = generator.bit_generator.state
        drawn = [sample(generator, population, truth.sampling_rate) for _ in range(max(steps) + 2)]
        generator.bit_generator.state = state
        findings += [f"reproduces the sample of {sampler} at step {step}" for step, indices in steps.items()
                     if any(np.array_equal(candidate, indices) for candidate in drawn)]
    return findings


def _generator_at(state: dict) -> np.random.Generator | None:
    """A numpy Generator at `state` (a bit generator's state, or PCG64's bare {"state", "inc"}); None if not one."""
    whole = state if "bit_generator" in state else {"bit_generator": "PCG64", "state": state, "has_uint32": 0,
                                                    "uinteger": 0}
    try:
        bit_generator = getattr(np.random, whole["bit_generator"])()
        bit_generator.state = whole
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    return np.random.Generator(bit_generator)


def version_one_poisson_sample(generator: np.random.Generator, population: int, rate: float) -> np.ndarray:
    """The Poisson sampler of checkpoint version 1: one uniform double per example, so a step moved the generator
    by exactly `population` draws."""
    return np.flatnonzero(generator.random(population) < rate)


def _through_generator_state(state: dict, where: str, truth: Truth) -> list[str]:
    findings = []
    if _generator_at(state) is None:
        return findings
    for step in truth.noise:
        if _noise_matches(_generator_at(state), step, truth):
            findings.append(f"{where}: the generator state reproduces the noise of step {step}")
    findings += [f"{where}: the generator state, drawing on, {finding}"
                 for sample in (poisson_sample, version_one_poisson_sample)
                 for finding in _sequential_samples(_generator_at(state), truth, sample)]
    for sampler, steps in truth.samples.items():
        population = truth.population[sampler]
        for rewind in range(-(max(steps) + 2), 0):
            candidate = _generator_at(state)
            if not hasattr(candidate.bit_generator, "advance"):
                continue
            # Version 1 drew one double per example per step: moving by whole steps lands on another step's draw.
            candidate.bit_generator.advance(rewind * population)
            drawn = version_one_poisson_sample(candidate, population, truth.sampling_rate)
            findings += [f"{where}: the generator state moved by {rewind} steps reproduces the sample of {sampler} "
                         f"at step {step}" for step, indices in steps.items() if np.array_equal(drawn, indices)]
    return findings


ROW_WINDOW_VALUES = 16


def row_signatures(rows: torch.Tensor) -> list[bytes]:
    """For each training row, 16 float32 values from its first non-zero one, as bytes: a window that no
    stretch of background (zeros) shares, found wherever the row was written as the workers read it."""
    signatures = []
    for row in rows.reshape(len(rows), -1).to(torch.float32).numpy():
        first = int(np.flatnonzero(row)[0]) if row.any() else 0
        signatures.append(row[first:first + ROW_WINDOW_VALUES].tobytes())
    return signatures


def rows_found(paths: list[Path], rows: torch.Tensor) -> list[str]:
    """Each file in `paths` (folders recursively) whose bytes hold one of `rows`, as `file: row i`."""
    signatures = row_signatures(rows)
    files = sorted({file for path in paths for file in ([path] if path.is_file() else path.rglob("*"))
                    if file.is_file()})
    found = []
    for file in files:
        data = file.read_bytes()
        found += [f"{file}: row {index}" for index, signature in enumerate(signatures) if signature in data]
    return found

