"""One tenant cannot stall another, and bad tokens cost little: `python -m bench.ledger_fairness [--json]`.

A ledger server runs in its own process on a fresh SQLite file, with its
default rate limits (`accounting.ledger.limits`).

- Fairness. A victim tenant commits 1 step at a time to its own long
  reservation, closed loop, for `--seconds`: first alone (unloaded), then
  while an attacking tenant runs one attack from 4 client processes as fast
  as replies come. Each attack is run three times: with the attackers
  waiting as the refusals for rate say; sending again at once; and sending
  again at once at nice 19, standing in for attackers on other machines
  (what their requests cost the server shows, not their own CPU, which on
  one machine competes with the server and the victim for the same cores):
  - "fits": each Fits at the cap, MAX_PLAN_MECHANISMS mechanisms the server
    has never seen (so each would cost that many RDP curves);
  - "long compositions": each cycle reserves a plan of 10**6 steps of a new
    mechanism, commits it all and asks its dataset's status, so the server
    composes 10**6 more steps into the attacker's PLD;
  - "wrong tokens and rotation": calls with wrong tokens of 50 key ids per
    client from the victim's address, one client rotating the attacker's
    own token every 20 calls (a rotation makes every server look at its
    verified tokens again).
  Printed: the victim's commit p50 and p99 unloaded and loaded, their
  ratio (goal: loaded p99 <= 2x unloaded p99), and how many attack calls
  were answered and how many were refused.
- Bad tokens. 1,000 calls with a wrong token (a real tenant's key id with
  a wrong secret: the lookup and compare a guesser forces), and the server
  process's CPU seconds they take (goal < 1 s); once with the default
  limit on failed authentications per key id, and once with it lifted, so
  the digest check alone shows. Beside them, what one scrypt (the hash of
  schema version 6 and before) costs on this machine, times 1,000.

`--json` also writes bench/results/ledger_fairness.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import psutil

from accounting.events import Composition, SampledGaussian
from accounting.ledger.client import RemoteLedger
from accounting.ledger.errors import LedgerError, RateLimited
from accounting.ledger.validation import EPSILON_RANGE, MAX_PLAN_MECHANISMS
from bench.ledger import ADMIN_TOKEN, DELTA, STEP, closed_loop, serve_process, timed

FLOOD_CLIENTS = 4
BAD_TOKEN_CALLS = 1000
TARGET_P99_RATIO = 2.0
TARGET_BAD_TOKEN_CPU_SECONDS = 1.0
RESULTS = Path(__file__).resolve().parent / "results" / "ledger_fairness.json"


@contextlib.contextmanager
def ledger_server(folder: str, name: str, rate_limits: dict) -> Iterator[tuple[str, psutil.Process]]:
    """A server process on a fresh file in `folder`: its address and its process (for CPU times)."""
    process = serve_process(os.path.join(folder, name), rate_limits)
    try:
        yield process.stdout.readline().strip(), psutil.Process(process.pid)
    finally:
        process.terminate()
        process.wait()


def commit_latencies(address: str, token: str, reservation_id: str, first_sequence: int, seconds: float) -> list:
    """Commit 1 step at a time for `seconds`, closed loop, from sequence `first_sequence`; each commit's latency."""
    with RemoteLedger(address, token) as client:
        _, latencies = closed_loop(
            lambda sequence: timed(lambda: client.commit(reservation_id, 1, sequence)), seconds, first_sequence
        )
    return latencies


def fits_attack(client: RemoteLedger, address: str, client_index: int, request: int) -> RemoteLedger:
    """One Fits at the mechanism cap, each of mechanisms never sent before."""
    client.fits("mnist", Composition(tuple(
        SampledGaussian(0.001, 1.0 + (client_index * 10**7 + request * 1000 + i) * 1e-9, 1)
        for i in range(MAX_PLAN_MECHANISMS)
    )))
    return client


def composition_attack(client: RemoteLedger, address: str, client_index: int, request: int) -> RemoteLedger:
    """Reserve and commit 10**6 steps of a new mechanism, then ask the status, which composes them into the PLD."""
    plan = Composition((SampledGaussian(0.001, 2.0 + (client_index * 10**6 + request) * 1e-9, 10**6),))
    reservation = client.reserve("mnist", f"long-{client_index}-{request}", plan)
    client.commit(reservation.reservation_id, plan.steps, 0)
    client.get_budget("mnist")
    return client


def token_attack(client: RemoteLedger, address: str, client_index: int, request: int) -> RemoteLedger:
    """A call with a wrong token (a fresh key id each time); client 0 rotates the attacker's token every 20 and
    goes on with the new one (the client it returns)."""
    if client_index == 0 and request % 20 == 0:
        rotated = client.rotate_token("flooder").token
        client.close()
        return RemoteLedger(address, rotated)
    if not _GUESSERS:  # one channel per wrong token, kept: a flood from one address pays no connections
        _GUESSERS.extend(
            RemoteLedger(address, f"dpf_{client_index:08x}{guess:08x}_wrongsecret") for guess in range(GUESSED_KEY_IDS)
        )
    _GUESSERS[request % GUESSED_KEY_IDS].list_datasets()
    return client


# Wrong tokens per attacking process, each of its own key id, used in turn.
GUESSED_KEY_IDS = 50
_GUESSERS: list = []


# How the attackers behave: (label, whether they wait as refusals for rate say, their niceness).
ATTACKER_MANNERS = (
    ("wait as refusals say", True, 0),
    ("ignore refusals", False, 0),
    ("ignore refusals, at nice 19 (as if on other machines)", False, 19),
)
ATTACKS = {"fits": fits_attack, "long compositions": composition_attack, "wrong tokens and rotation": token_attack}


def flood(
    address: str, token: str, client_index: int, attack: str, honor_retry: bool, niceness: int, ready: object,
    stop: object, counts: dict,
) -> None:
    """Run `attack` (a name of ATTACKS) again and again until `stop`, at `niceness`; with `honor_retry`, wait as
    long as a refusal for rate says first. `ready` is released once this process sends."""
    os.nice(niceness)
    answered = refused = 0
    client = RemoteLedger(address, token)
    request = 0
    ready.release()
    while not stop.is_set():
        request += 1
        try:
            client = ATTACKS[attack](client, address, client_index, request)
            answered += 1
        except RateLimited as error:
            refused += 1
            if honor_retry:
                stop.wait(error.retry_after_seconds)
        except LedgerError:
            refused += 1
    client.close()
    counts[client_index] = (answered, refused)


def percentiles_ms(latencies: list) -> dict:
    values = np.array(latencies) * 1000
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)), "n": len(values)}


def fairness(folder: str, name: str, seconds: float, attack: str, honor_retry: bool, niceness: int) -> dict:
    """The victim's commit latencies unloaded and under `attack` (a name of ATTACKS), its clients at `niceness`."""
    with ledger_server(folder, name, {}) as (address, _):
        with RemoteLedger(address, ADMIN_TOKEN) as admin:
            victim = admin.create_tenant("victim").token
            flooder = admin.create_tenant("flooder").token
        with RemoteLedger(address, victim) as client:
            client.create_dataset("mnist", EPSILON_RANGE[1], DELTA)
            reservation_id = client.reserve("mnist", "long", STEP.with_steps(10**7)).reservation_id
        with RemoteLedger(address, flooder) as client:
            client.create_dataset("mnist", EPSILON_RANGE[1], DELTA)
        unloaded = commit_latencies(address, victim, reservation_id, 0, seconds)
        # Spawned, not forked: this process has used gRPC.
        spawn = multiprocessing.get_context("spawn")
        stop, ready = spawn.Event(), spawn.Semaphore(0)
        with spawn.Manager() as manager:
            counts = manager.dict()
            flooders = [
                spawn.Process(
                    target=flood, args=(address, flooder, index, attack, honor_retry, niceness, ready, stop, counts)
                )
                for index in range(FLOOD_CLIENTS)
            ]
            for process in flooders:
                process.start()
            for _ in flooders:  # starting a Python process with gRPC and numpy is seconds of CPU on its own
                ready.acquire(timeout=300)
            time.sleep(1.0)  # the flood is running before the victim starts
            loaded = commit_latencies(address, victim, reservation_id, len(unloaded), seconds)
            stop.set()
            for process in flooders:
                process.join(timeout=60)
                if process.is_alive():
                    process.terminate()
            answered = sum(count[0] for count in counts.values())
            refused = sum(count[1] for count in counts.values())
    row = {"unloaded": percentiles_ms(unloaded), "loaded": percentiles_ms(loaded),
           "attack_calls_answered": answered, "attack_calls_refused": refused}
    row["p99_ratio"] = row["loaded"]["p99_ms"] / row["unloaded"]["p99_ms"]
    row["p50_ratio"] = row["loaded"]["p50_ms"] / row["unloaded"]["p50_ms"]
    return row


def bad_tokens(folder: str, name: str, rate_limits: dict) -> dict:
    """Server CPU seconds of BAD_TOKEN_CALLS calls with a wrong secret on a real key id."""
    with ledger_server(folder, name, rate_limits) as (address, process):
        with RemoteLedger(address, ADMIN_TOKEN) as admin:
            token = admin.create_tenant("acme").token
        wrong = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        with RemoteLedger(address, wrong) as client:
            client.timeout_seconds = 30
            before = process.cpu_times()
            started = time.perf_counter()
            outcomes = {}
            for _ in range(BAD_TOKEN_CALLS):
                try:
                    client.list_datasets()
                except LedgerError as error:
                    outcomes[type(error).__name__] = outcomes.get(type(error).__name__, 0) + 1
            wall = time.perf_counter() - started
            after = process.cpu_times()
    cpu = (after.user - before.user) + (after.system - before.system)
    return {"calls": BAD_TOKEN_CALLS, "server_cpu_seconds": cpu, "wall_seconds": wall, "refusals": outcomes}


def scrypt_seconds() -> float:
    """One scrypt of a token at the parameters of schema version 6 (tokens.hash_token), median of 5."""
    from accounting.ledger.tokens import hash_token

    times = []
    for _ in range(5):
        started = time.perf_counter()
        hash_token("dpf_0123456789abcdef_" + "x" * 43, b"0123456789abcdef")
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_fairness", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of each victim phase (default 10)")
    parser.add_argument("--json", action="store_true", help="also write bench/results/ledger_fairness.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dpfleet-fairness-") as folder:
        floods = {
            f"{attack}, attackers {manner}": fairness(
                folder, f"{index}-{honor_retry}-{niceness}.db", args.seconds, attack, honor_retry, niceness
            )
            for index, attack in enumerate(ATTACKS)
            for manner, honor_retry, niceness in ATTACKER_MANNERS
        }
        limited = bad_tokens(folder, "limited.db", {})
        unlimited = bad_tokens(folder, "unlimited.db", {"auth_failure_burst": 10**9})
    scrypt = scrypt_seconds()
    for label, fair in floods.items():
        print(f"{label}:")
        print(f"  victim commits, unloaded: p50 {fair['unloaded']['p50_ms']:.2f} ms, "
              f"p99 {fair['unloaded']['p99_ms']:.2f} ms ({fair['unloaded']['n']} commits)")
        print(f"  victim commits, {FLOOD_CLIENTS} clients attacking: "
              f"p50 {fair['loaded']['p50_ms']:.2f} ms, p99 {fair['loaded']['p99_ms']:.2f} ms "
              f"({fair['loaded']['n']} commits; attack: {fair['attack_calls_answered']} calls answered, "
              f"{fair['attack_calls_refused']} refused)")
        print(f"  loaded / unloaded: p50 {fair['p50_ratio']:.2f}x, p99 {fair['p99_ratio']:.2f}x "
              f"(goal p99 <= {TARGET_P99_RATIO:g}x)")
    for label, row in (("default per-key-id limit", limited), ("per-key-id limit lifted", unlimited)):
        print(f"{BAD_TOKEN_CALLS} bad-token calls, {label}: {row['server_cpu_seconds']:.3f} s server CPU, "
              f"{row['wall_seconds']:.2f} s wall, {row['refusals']} (goal < {TARGET_BAD_TOKEN_CPU_SECONDS:g} s)")
    print(f"for comparison, {BAD_TOKEN_CALLS} scrypt checks (schema 6 and before): {scrypt * BAD_TOKEN_CALLS:.1f} s "
          f"({scrypt * 1000:.1f} ms each)")
    if args.json:
        machine = {
            "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
        }
        RESULTS.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": machine,
            "command": "python -m bench.ledger_fairness " + " ".join(argv if argv is not None else sys.argv[1:]),
            "fairness": floods, "bad_tokens_default_limit": limited, "bad_tokens_limit_lifted": unlimited,
            "scrypt_seconds_each": scrypt,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
