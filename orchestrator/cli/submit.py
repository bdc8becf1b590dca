"""`dpfleet submit`: run `dpfleet train` as a job on a running Ray cluster, through Ray's Jobs API.

The job ships this source tree as its runtime_env working_dir and carries the
config file and the ledger settings as environment variables; the head node
runs `python -m orchestrator.cli train` with the Python on its PATH (the
image's, see deploy/Dockerfile). The plain equivalent is
`ray job submit --working-dir . -- python -m orchestrator.cli train --config FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Iterator

import aiohttp
import requests
from ray._raylet import AuthenticationTokenLoader
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from orchestrator.config import load_config
from orchestrator.errors import UsageError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Paths (gitignore syntax) kept out of the working_dir upload: environments, history, results, caches, and
# data/, where the examples export datasets (a cluster reads its data from its own storage, not from the upload).
UPLOAD_EXCLUDES = [
    ".git", ".venv", "runs/", "bench/results/", "build/", "dist/", "site/", "data/", "*.egg-info",
    "__pycache__/", ".pytest_cache/", ".hypothesis/", ".ruff_cache/",
]
CONFIG_VARIABLE = "DPFLEET_CONFIG_TOML"
_TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


def add_submit_arguments(submit: argparse.ArgumentParser) -> None:
    """The arguments of `submit`."""
    submit.description = (
        "Submit `dpfleet train --config FILE` to a Ray cluster's Jobs API, follow its logs and exit with "
        "its status (0 when it succeeded, 1 otherwise). This source tree travels as the job's working_dir; "
        "the Ray token is read where Ray reads it: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."
    )
    submit.add_argument("--address", metavar="URL",
                        help="the cluster's dashboard, e.g. http://HEAD:8265 (default: RAY_API_SERVER_ADDRESS, "
                             "else RAY_ADDRESS)")
    submit.add_argument("--config", required=True, help="TOML file with the run's keys (see examples/)")
    submit.add_argument("--workers", help="number of gradient worker actors (overrides the config)")
    submit.add_argument("--ledger", metavar="HOST:PORT",
                        help="privacy ledger server, as the cluster reaches it (default: DPFLEET_LEDGER)")
    submit.add_argument("--token", help="ledger token (default: DPFLEET_TOKEN)")
    submit.add_argument("--dataset-name", help="the dataset's name in the ledger (default: the config's dataset)")
    submit.add_argument("--overwrite", action="store_true",
                        help="passed to the job's dpfleet train: start the run even though its run_dir on the cluster "
                             "holds a finished run, whose summary and files it replaces (without it, such a run_dir "
                             "is refused)")
    submit.add_argument("--no-wait", action="store_true", help="print the job's id and return once it is submitted")
    submit.set_defaults(handler=f"{__name__}:run_submit")


def run_submit(args: argparse.Namespace) -> int:
    """Check the config here, submit the training job, follow its logs, return 0 if it succeeded else 1."""
    config = load_config(args.config, {"workers": args.workers})
    config_text = Path(args.config).read_text()
    ledger = args.ledger or os.environ.get("DPFLEET_LEDGER")
    token = args.token or os.environ.get("DPFLEET_TOKEN")
    if ledger and not token:
        raise UsageError(
            f"the ledger at {ledger} needs a token: pass --token or set DPFLEET_TOKEN "
            "(dpfleet ledger tenant create prints one)"
        )
    if not (ledger or config.ledger):
        print("dpfleet submit: no --ledger, DPFLEET_LEDGER or config ledger key: the job charges the embedded "
              "ledger on the node that runs it", file=sys.stderr)
    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        raise UsageError(
            f"dpfleet submit ships its source tree as the job's working_dir, but {PROJECT_ROOT} is an installed "
            "copy without one: run it from a dpfleet checkout (pip install -e .), or use `ray job submit` on a "
            "cluster whose image has dpfleet installed (see docs/cluster.md)"
        )
    address = dashboard_url(args.address)
    headers = ray_auth_headers()
    with _reaching(address, headers):
        client = _client(address, headers)
        job_id = client.submit_job(
            entrypoint=job_entrypoint(ledger, args.workers, args.dataset_name, args.overwrite),
            runtime_env=job_runtime_env(config_text, ledger, token),
        )
    print(f"dpfleet submit: job {job_id} submitted to {address}", file=sys.stderr, flush=True)
    if args.no_wait:
        print(f"follow it with: ray job logs --follow {job_id} --address {address}", file=sys.stderr)
        print(job_id)
        return 0
    try:
        with _reaching(address, headers):
            status, message = _follow(client, job_id)
    except KeyboardInterrupt:
        print(f"dpfleet submit: stopped following; job {job_id} keeps running "
              f"(ray job stop {job_id} --address {address} stops it)", file=sys.stderr)
        return 130
    if status == JobStatus.SUCCEEDED:
        print(f"dpfleet submit: job {job_id} succeeded", file=sys.stderr)
        return 0
    print(f"dpfleet submit: job {job_id} {status.value}: {_first_line(message or '') or 'no message'}",
          file=sys.stderr)
    return 1


def dashboard_url(address: str | None) -> str:
    """The Jobs API URL: --address, else RAY_API_SERVER_ADDRESS, else RAY_ADDRESS; http:// when no scheme is given."""
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        raise UsageError("give --address http://HEAD:8265 (the Ray dashboard of the cluster) or set RAY_ADDRESS")
    if address == "auto":
        raise UsageError("--address must be the cluster's dashboard URL, e.g. http://HEAD:8265 (got 'auto')")
    return address if "://" in address else f"http://{address}"


def ray_auth_headers() -> dict[str, str]:
    """The Authorization header for the Ray token, from where Ray itself finds it; {} when there is none.

    Ray's own client sends the token only when RAY_AUTH_MODE=token is set in the
    submitting shell; a cluster's auth mode is the cluster's business, so the
    token is sent whenever one is found.
    """
    try:
        return AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True)
    except AuthenticationError:
        raise UsageError(
            f"RAY_AUTH_TOKEN_PATH is {os.environ.get('RAY_AUTH_TOKEN_PATH')!r}, which cannot be read or is empty: "
            "point it at the file holding the cluster's Ray token, or unset it"
        ) from None


def job_entrypoint(ledger: str | None, workers: str | None, dataset_name: str | None,
                   overwrite: bool = False) -> str:
    """The job's shell command: write the config from its variable to a file, then `dpfleet train` on it, with
    --overwrite when ``overwrite``."""
    flags = ["--no-progress"]
    if ledger:
        # As a flag (its value still from the variable) so it wins over a `ledger` key in the config.
        flags.append('--ledger "$DPFLEET_LEDGER"')
    if workers is not None:
        flags.append(f"--workers {shlex.quote(str(workers))}")
    if dataset_name is not None:
        flags.append(f"--dataset-name {shlex.quote(dataset_name)}")
    if overwrite:
        flags.append("--overwrite")
    return (
        f'config="$(mktemp)" && trap \'rm -f "$config"\' EXIT && printf "%s" "${CONFIG_VARIABLE}" > "$config" && '
        f'python -m orchestrator.cli train --config "$config" {" ".join(flags)}'
    )


def job_runtime_env(config_text: str, ledger: str | None, token: str | None) -> dict:
    """The job's runtime_env: this source tree as working_dir, the config and ledger settings as variables."""
    env_vars = {CONFIG_VARIABLE: config_text}
    if ledger:
        env_vars["DPFLEET_LEDGER"] = ledger
    if token:
        env_vars["DPFLEET_TOKEN"] = token
    return {"working_dir": str(PROJECT_ROOT), "excludes": UPLOAD_EXCLUDES, "env_vars": env_vars}


@contextlib.contextmanager
def _reaching(address: str, headers: dict[str, str]) -> Iterator[None]:
    """Turn the ways a cluster can be out of reach, or refuse us, into one-line usage errors."""
    try:
        yield
    except AuthenticationError:
        if headers:
            raise UsageError(
                f"the Ray cluster at {address} rejected the Ray token (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                "~/.ray/auth_token): use this cluster's token (`ray get-auth-token` on its head prints it)"
            ) from None
        raise UsageError(
            f"the Ray cluster at {address} requires a Ray token and none was found: set RAY_AUTH_TOKEN, or "
            "RAY_AUTH_TOKEN_PATH, or write it to ~/.ray/auth_token (`ray get-auth-token` on the head prints it)"
        ) from None
    except (ConnectionError, requests.exceptions.RequestException, aiohttp.ClientError) as error:
        raise UsageError(
            f"cannot reach the Ray Jobs API at {address} ({_one_line(error)}): check --address (the head's "
            "dashboard, port 8265 unless changed) and that the cluster is up"
        ) from None
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"the Ray cluster at {address} refused the request: {_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    return _first_line(str(error)) or type(error).__name__


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


@contextlib.contextmanager
def _explicit_address() -> Iterator[None]:
    """Hide RAY_ADDRESS and RAY_API_SERVER_ADDRESS, which Ray's client would prefer to the address it is given."""
    saved = {name: os.environ.pop(name) for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _client(address: str, headers: dict[str, str]) -> JobSubmissionClient:
    with _explicit_address():
        return JobSubmissionClient(address, headers=dict(headers))


def _follow(client: JobSubmissionClient, job_id: str) -> tuple[JobStatus, str | None]:
    """Print the job's logs as they come; then wait for its final status and return it with its message."""

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)

    try:
        asyncio.run(tail())
    except (RuntimeError, aiohttp.ClientError) as error:
        # The job goes on without its log stream, and its status still decides the exit status.
        print(f"dpfleet submit: lost the log stream of job {job_id} ({_one_line(error)}); waiting for it to end",
              file=sys.stderr, flush=True)
    info = client.get_job_info(job_id)
    while info.status not in _TERMINAL:
        time.sleep(1.0)
        info = client.get_job_info(job_id)
    return info.status, info.message
