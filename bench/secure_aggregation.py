"""Per-step cost of secure aggregation against plain aggregation, for 3 silos at 1M and 10M parameters.

    python -m bench.secure_aggregation [--repeats 5] [--json]

Side by side in one process, on the same random clipped sums: the plain path
(each silo sends its float32 sum; the driver adds them in float64) and the
secure path's arithmetic: the step's round (two key pairs a silo, signed
with its Ed25519 identity, checked by every other silo, and the sealed
shares of its masking key and self-mask seed), each silo encoding its sum in
fixed point and adding its self-mask and its two pairwise masks (ChaCha20
keystreams), the driver adding the uint64 inputs on the ring, rebuilding the
three self-masks from the answers and taking them out, and decoding; and the
driver's part of a step in which one silo dropped (its masking key rebuilt
from the survivors' shares, and its two pairs' masks taken out). Silos work
in parallel, so a step costs the round, one silo's time and the driver's.
With the noise in the silos (`noise_placement = "silos"`), a silo also draws
its exact discrete Gaussian share (σ = 1: variance (σ·s·C)² at the silo
noise's scale) and adds it before its masks: that silo's time is reported
beside. The bytes each silo sends are reported (uint64 against float32);
Ray's transport (three round trips more for the keys and one for the
answers) and the gradients themselves are the same in both paths and are
not timed. `--json` writes bench/results/secure_aggregation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from accounting.skellam import SILO_NOISE_ROUNDING_RATIO
from workers.secure_aggregation import (
    RandomWords,
    RoundHistory,
    SiloParty,
    fixed_point_scale,
    new_round,
    noise_share,
    public_identity,
    silo_noise_scale,
    unmask_request,
    unmasked_total,
)

RESULTS = Path(__file__).resolve().parent / "results" / "secure_aggregation.json"
SIZES = (1_000_000, 10_000_000)
SILOS = 3
CLIP_NORM, EXAMPLES = 1.0, 60_000


def median_seconds(action, repeats: int) -> float:
    """The median wall time of `repeats` calls of `action`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def keyed_silos(scale: float, step: int) -> tuple[dict[int, SiloParty], object, dict]:
    """The three silos after the round's keys and shares (the driver's relay played here), the round and the keys
    the silos advertised."""
    identities = {party: Ed25519PrivateKey.generate() for party in range(SILOS)}
    registry = [public_identity(identities[party]) for party in range(SILOS)]
    round_ = new_round(step, range(SILOS), 2)
    silos = {party: SiloParty(party, round_, scale, CLIP_NORM * EXAMPLES, RoundHistory(), identities[party],
                              registry) for party in range(SILOS)}
    advertised = {party: silo.advertise() for party, silo in silos.items()}
    sealed = {party: silo.share_keys(advertised) for party, silo in silos.items()}
    for receiver, silo in silos.items():
        silo.receive_shares({sender: boxes[receiver] for sender, boxes in sealed.items() if sender != receiver})
    return silos, round_, advertised


def measure(size: int, repeats: int) -> dict:
    """The plain and the secure step's seconds for `size` parameters (silo's part, driver's part, total)."""
    generator = np.random.default_rng(0)
    sums = [generator.standard_normal(size, dtype=np.float32) for _ in range(SILOS)]
    scale = fixed_point_scale(CLIP_NORM * EXAMPLES, SILOS)
    keying_seconds = median_seconds(lambda: keyed_silos(scale, 0), repeats)

    def plain_driver():
        total = np.zeros(size)
        for part in sums:
            total += part
        return total

    def masked_inputs(dropped=()):
        silos, round_, advertised = keyed_silos(scale, 0)
        inputs = [silos[party].masked(sums[party]) for party in range(SILOS) if party not in dropped]
        request = unmask_request(round_, inputs)
        return round_, advertised, inputs, [silos[party].reveal(request) for party in request.survivors]

    def one_silo():
        silos, _, _ = keyed_silos(scale, 0)
        started = time.perf_counter()
        silos[0].masked(sums[0])
        return time.perf_counter() - started

    silo_seconds = float(np.median([one_silo() for _ in range(repeats)]))
    everyone = masked_inputs()
    driver_seconds = median_seconds(lambda: unmasked_total(*everyone, scale), repeats)
    plain_seconds = median_seconds(plain_driver, repeats)
    error = float(np.abs(unmasked_total(*everyone, scale) - plain_driver()).max())
    one_dropped = masked_inputs(dropped=(2,))
    recovery_seconds = median_seconds(lambda: unmasked_total(*one_dropped, scale), repeats)
    secure_seconds = keying_seconds + silo_seconds + driver_seconds

    noise_scale = silo_noise_scale(CLIP_NORM, size, SILO_NOISE_ROUNDING_RATIO)
    share_variance = (noise_scale * CLIP_NORM) ** 2

    def noised_silo():
        silos, _, _ = keyed_silos(noise_scale, 0)
        started = time.perf_counter()
        silos[0].masked(sums[0], noise_share(RandomWords(), share_variance, size))
        return time.perf_counter() - started
    noised_silo_seconds = float(np.median([noised_silo() for _ in range(repeats)]))
    noised_seconds = keying_seconds + noised_silo_seconds + driver_seconds
    return {
        "parameters": size,
        "plain_step_s": plain_seconds,
        "secure_silo_s": silo_seconds,
        "secure_driver_s": driver_seconds,
        "secure_step_s": secure_seconds,
        "overhead_s": secure_seconds - plain_seconds,
        "secure_over_plain": secure_seconds / plain_seconds,
        "silo_noise_silo_s": noised_silo_seconds,
        "silo_noise_step_s": noised_seconds,
        "silo_noise_over_plain": noised_seconds / plain_seconds,
        "dropout_driver_s": recovery_seconds,
        "keying_round_s": keying_seconds,
        "bytes_per_silo_plain": 4 * size,
        "bytes_per_silo_secure": 8 * size,
        "largest_decoding_error": error,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure both sizes, print them side by side, and with --json write bench/results/secure_aggregation.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="write bench/results/secure_aggregation.json")
    arguments = parser.parse_args(argv)
    rows = [measure(size, arguments.repeats) for size in SIZES]
    print(f"{'parameters':>11} {'plain s':>9} {'silo s':>9} {'driver s':>9} {'secure s':>9} {'ratio':>7} "
          f"{'dropout s':>10} {'keying s':>9} {'noised silo s':>14} {'noised s':>9} {'ratio':>7}")
    for row in rows:
        print(f"{row['parameters']:>11,} {row['plain_step_s']:>9.4f} {row['secure_silo_s']:>9.4f} "
              f"{row['secure_driver_s']:>9.4f} {row['secure_step_s']:>9.4f} {row['secure_over_plain']:>7.1f} "
              f"{row['dropout_driver_s']:>10.4f} {row['keying_round_s']:>9.4f} {row['silo_noise_silo_s']:>14.4f} "
              f"{row['silo_noise_step_s']:>9.4f} {row['silo_noise_over_plain']:>7.1f}")
    if arguments.json:
        RESULTS.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_average": os.getloadavg(),
            "command": "python -m bench.secure_aggregation " + " ".join(argv if argv is not None else sys.argv[1:]),
            "silos": SILOS, "threshold": 2, "clip_norm": CLIP_NORM, "examples": EXAMPLES, "repeats": arguments.repeats,
            "sizes": rows,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
