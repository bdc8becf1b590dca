"""What `dpfleet ledger ...` does: each command's handler, over the embedded ledger or a server.

Client commands talk to `--ledger HOST:PORT` (or DPFLEET_LEDGER) with
`--token` (or DPFLEET_TOKEN); with no address they open the embedded ledger
file. The parser is in ``orchestrator.cli.ledger_parser``; this module is
imported only when a ledger command runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable

from accounting.events import Composition, noise_placement
from accounting.lazy import LazyModule
from accounting.ledger.admission import check_plan_share
from accounting.ledger.callers import ADMIN
from accounting.ledger.client import RemoteLedger
from accounting.ledger.databases import is_postgresql, shown_location
from accounting.ledger.errors import BudgetExceeded, InvalidArgument, LedgerError
from accounting.ledger.interface import PrivacyLedger
from accounting.ledger.records import DatasetStatus
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.store import (
    HistoryKeySource,
    Ledger,
    default_ledger_path,
    history_key_source,
    load_public_key,
    load_signing_key,
    new_signing_key,
    open_embedded_ledger,
)
from accounting.ledger.validation import check_budget_epsilon, check_delta, delta_warning
from accounting.ledger.verification import SignedHead
from orchestrator import checks
from orchestrator.cli.display import format_number, format_table, print_json
from orchestrator.errors import BudgetRefusedError, UsageError

# The server (gRPC, the web page, metrics) loads only for `ledger serve`.
service = LazyModule("accounting.ledger.service")
# Reading a block's files (for their identity) loads the data readers only when a block is added.
ledger_session = LazyModule("orchestrator.ledger_session")


def ledger_command(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn ledger refusals into the command line's errors: a budget refusal exits 3, the rest 2."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BudgetExceeded as error:
            raise BudgetRefusedError(str(error)) from None
        except (LedgerError, OSError) as error:
            raise UsageError(str(error)) from None

    return run


def ledger_from_flags(args: argparse.Namespace) -> PrivacyLedger:
    """The remote ledger named by --ledger / DPFLEET_LEDGER, else the embedded one."""
    address = args.ledger or os.environ.get("DPFLEET_LEDGER")
    if address:
        token = args.token or os.environ.get("DPFLEET_TOKEN")
        if not token:
            raise UsageError(f"--token (or DPFLEET_TOKEN) is needed to use the ledger at {address}")
        timeout = checks.positive_number("--timeout", args.timeout)
        return RemoteLedger(address, token, tls_ca=args.tls_ca, timeout_seconds=timeout)
    if args.token:
        raise UsageError(
            f"--token needs --ledger HOST:PORT (or DPFLEET_LEDGER); without them the embedded ledger "
            f"{default_ledger_path()} is used and needs no token"
        )
    return open_embedded_ledger()


def _ledger_number(flag: str, text: str, check: Callable[[float], float]) -> float:
    """A number given on the command line, range-checked by the ledger's own validation (a server's too)."""
    try:
        return check(float(text))
    except ValueError:  # float() of text that is not a number
        raise UsageError(f"{flag} must be a number (got {text!r})") from None
    except InvalidArgument as error:
        raise UsageError(f"{flag}: {error}") from None


def _scheduling(args: argparse.Namespace) -> SchedulingPolicy | None:
    """The policy the scheduling flags give, or None when --scheduling is not given."""
    if args.scheduling is None:
        if args.unlock_jobs is not None or args.unlock_seconds is not None:
            raise UsageError("--unlock-jobs and --unlock-seconds need --scheduling dpf or dpack")
        return None
    unlock_jobs = checks.integer_at_least("--unlock-jobs", args.unlock_jobs, 1) if args.unlock_jobs else None
    unlock_seconds = checks.positive_number("--unlock-seconds", args.unlock_seconds) if args.unlock_seconds else None
    return SchedulingPolicy(args.scheduling, unlock_jobs, unlock_seconds)


def _status_table(statuses: list[DatasetStatus]) -> str:
    headers = [
        "dataset", "unit", "budget ε", "δ", "spent ε (filter)", "reserved ε", "remaining ε", "spent ε (non-adaptive)",
        "filter orders", "active jobs", "released jobs", "queue",
    ]
    rows = [
        [
            status.name,
            status.privacy_unit,
            status.budget_epsilon,
            status.delta,
            status.spent_epsilon_filter,
            status.reserved_epsilon,
            status.remaining_epsilon,
            f"{format_number(status.spent_epsilon)} ({status.spent_epsilon_accountant})",
            " ".join(format_number(order) for order in status.admission.orders),
            len(status.jobs),
            status.released_jobs,
            f"{status.scheduling.name}, {status.queued_jobs} waiting",
        ]
        for status in statuses
    ]
    text = format_table(headers, rows)
    if any(status.spent_epsilon_accountant != "pld" for status in statuses):
        text += (
            "\n\n(rdp): the PLD figure of new commits was not ready yet (--no-wait); "
            "a status without --no-wait waits for it."
        )
    blocks = [
        [
            status.name, block.name, block.budget_epsilon, block.delta, block.spent_epsilon_filter,
            block.reserved_epsilon, block.remaining_epsilon,
            f"{format_number(block.spent_epsilon)} ({block.spent_epsilon_accountant})",
            " ".join(format_number(order) for order in block.admission.orders),
        ]
        for status in statuses for block in status.blocks
    ]
    if blocks:
        text += "\n\nblocks (each its own budget):\n" + format_table(
            ["dataset", "block", "budget ε", "δ", "spent ε (filter)", "reserved ε", "remaining ε",
             "spent ε (non-adaptive)", "filter orders"],
            blocks,
        )
    quotas = [
        [
            status.name, quota.block or "(dataset)", quota.tenant,
            f"{format_number(quota.quota_epsilon)}{' (dataset-wide)' if quota.inherited else ''}",
            quota.spent_epsilon_filter, quota.reserved_epsilon, quota.remaining_epsilon,
        ]
        for status in statuses for quota in status.quotas
    ]
    if quotas:
        text += "\n\ntenant quotas (an extra filter on the tenant's own use):\n" + format_table(
            ["dataset", "block", "tenant", "quota ε", "spent ε (filter)", "reserved ε", "remaining ε"], quotas
        )
    pools = [
        [status.name, status.admission.plan_epsilon, status.admission.plan_delta, status.plans, status.plans_epsilon,
         status.plans_delta, status.admission.plan_epsilon - status.plans_epsilon]
        for status in statuses if status.admission.has_plan_pool
    ]
    if pools:
        text += ("\n\nplan pools (set aside at creation; budget ε and δ above are the filter's part):\n"
                 + format_table(["dataset", "pool ε", "pool δ", "plans", "charged ε", "charged δ", "remaining ε"],
                                pools))
    jobs = [job for status in statuses for job in status.jobs]
    if jobs:
        text += "\n\njobs holding budget:\n" + _jobs_table(jobs)
    return text + (
        "\n\nspent ε (filter) + reserved ε + remaining ε = budget ε: the RDP filter at the dataset's orders, "
        "each at δ/(number of orders), admits jobs and bounds them however they were chosen. spent ε "
        "(non-adaptive): the PLD ε of the committed steps, which holds only if no job was chosen after seeing "
        "another's results." + (
            " unit user: every ε is per person, with all its rows."
            if any(status.privacy_unit == "user" for status in statuses) else ""
        )
    )


def _queued_table(jobs: list) -> str:
    headers = ["queued job", "dataset", "job", "state", "position", "priority", "planned steps", "queued at",
               "deadline", "why it waits / reservation"]
    rows = [
        [
            job.queue_id, job.dataset, job.job_id, job.state, job.position or "", job.priority, job.planned.steps,
            job.created_at, job.deadline or "", job.reservation_id or job.reason,
        ]
        for job in jobs
    ]
    return format_table(headers, rows)


def _jobs_table(jobs: list) -> str:
    """The jobs as a table; with the ε each took from its budgets where the listing replayed them."""
    charged = any(job.charges is not None for job in jobs)
    headers = [
        "reservation", "dataset", "blocks", "job", "state", "committed steps", "planned steps",
        *(["took ε (filter)"] if charged else []), "noise", "created", "lease ends",
    ]
    rows = [
        [
            job.reservation_id, job.dataset, " ".join(job.blocks), job.job_id,
            "lease expired" if job.lease_expired else job.state, job.committed_steps, job.planned_steps,
            *([f"paid with plan {job.plan}" if job.plan else _took(job.charges)] if charged else []),
            job.noise_placement, job.created_at, job.expires_at or "",
        ]
        for job in jobs
    ]
    return format_table(headers, rows)


def _took(charges: tuple | None) -> str:
    """What a job's commits took from its budget, or from each block's (`d1 0.95, d2 0.95`)."""
    if charges is None:
        return ""
    return ", ".join(f"{charge.block + ' ' if charge.block else ''}{format_number(charge.charged_epsilon)}"
                     for charge in charges)


# Under `dpfleet ledger jobs`: what its column is, and what it is not.
_TOOK_NOTE = (
    "took ε (filter): what the job's committed steps took from its budget's remaining ε (each block's, for a job "
    "on blocks), in the filter's ε at the budget's δ: each commit the rise it made in spent ε (filter), in the "
    "order the ledger charged them. A budget's jobs add up to its spent ε (filter), and its first job pays the "
    "RDP-to-(ε, δ) conversion's offset, so a later job of the same plan takes less. It is not the job's own "
    "privacy, its ε by its accountant (dpfleet train prints both). A job of a pre-registered plan was paid for "
    "when its plan was admitted (dpfleet ledger plan list): it takes nothing here, and its unrun steps are not "
    "refunded."
)


@ledger_command
def run_serve(args: argparse.Namespace) -> int:
    """Serve a ledger file over gRPC until SIGTERM or SIGINT."""
    port = _port("--port", args.port)
    http_port = _port("--http-port", args.http_port) if args.http_port is not None else None
    metrics_port = _port("--metrics-port", args.metrics_port) if args.metrics_port is not None else None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together; give both, or neither for plaintext")
    if args.admin_token_file:
        try:
            admin_token = Path(args.admin_token_file).read_text().strip()
        except OSError as error:
            raise UsageError(f"--admin-token-file: cannot read {args.admin_token_file}: {error.strerror}") from None
    else:
        admin_token = os.environ.get("DPFLEET_ADMIN_TOKEN") or None
    if admin_token is None:
        print(
            "warning: no admin token (--admin-token-file or DPFLEET_ADMIN_TOKEN); admin commands will be refused",
            file=sys.stderr,
        )

    def announce(server: service.LedgerServer) -> None:
        scheme = "https" if args.tls_cert else "http"
        urls = {}
        if server.web is not None and server.web.http_port is not None:
            urls["page"] = f"{scheme}://{_url_host(server.host)}:{server.web.http_port}/"
        if server.web is not None and server.web.metrics_port is not None:
            urls["metrics"] = f"{scheme}://{_url_host(server.host)}:{server.web.metrics_port}/metrics"
        if args.json:
            print_json({"listening": server.address, **urls})
        else:
            print(f"listening on {server.address}", flush=True)
            for what, url in urls.items():
                print(f"{what} on {url}", flush=True)

    service.serve(
        args.db, args.host, port, admin_token, args.tls_cert, args.tls_key, announce=announce,
        http_port=http_port, metrics_port=metrics_port, scheduling=_scheduling(args),
        history_key_file=_history_key(args), allow_key_beside_database=args.allow_key_beside_database,
        curve_rate_per_second=checks.positive_number("--curves-per-second", args.curves_per_second),
        curve_burst=checks.integer_at_least("--curve-burst", args.curve_burst, 1),
        auth_failure_rate_per_second=checks.positive_number(
            "--auth-failures-per-second", args.auth_failures_per_second
        ),
        auth_failure_burst=checks.integer_at_least("--auth-failure-burst", args.auth_failure_burst, 1),
        curve_processes=checks.integer_at_least("--curve-processes", args.curve_processes, 0),
    )
    return 0


def _port(flag: str, value: str) -> int:
    port = checks.integer_at_least(flag, value, 0)
    if port > 65535:
        raise UsageError(f"{flag} must be in [0, 65535] (got {port}); 0 picks a free port")
    return port


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@ledger_command
def run_tenant_create(args: argparse.Namespace) -> int:
    """Create a tenant and print its token once."""
    with ledger_from_flags(args) as ledger:
        created = ledger.create_tenant(args.name)
    if args.json:
        print_json(created.to_dict())
    else:
        print(f"tenant {created.tenant} created. Its token, shown only now (keep it secret):\n{created.token}")
    return 0


def _print_statuses(statuses: list[DatasetStatus], as_json: bool) -> None:
    if as_json:
        print_json({"datasets": [status.to_dict() for status in statuses]})
    else:
        print(_status_table(statuses))


@ledger_command
def run_dataset_create(args: argparse.Namespace) -> int:
    """Create a dataset with its (epsilon, delta) budget."""
    epsilon = _ledger_number("--epsilon", args.epsilon, check_budget_epsilon)
    delta = _ledger_number("--delta", args.delta, check_delta)
    size = None if args.dataset_size is None else checks.integer_at_least("--dataset-size", args.dataset_size, 1)
    warning = delta_warning(delta, size)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    with ledger_from_flags(args) as ledger:
        status = ledger.create_dataset(args.name, epsilon, delta, args.privacy_unit, _scheduling(args),
                                       _ledger_number("--plan-share", args.plan_share, check_plan_share))
    _print_statuses([status], args.json)
    return 0


@ledger_command
def run_dataset_raise(args: argparse.Namespace) -> int:
    """Set a dataset's budget epsilon (admin)."""
    epsilon = _ledger_number("--epsilon", args.epsilon, check_budget_epsilon)
    with ledger_from_flags(args) as ledger:
        status = ledger.raise_budget(args.name, epsilon)
    _print_statuses([status], args.json)
    return 0


@ledger_command
def run_block_add(args: argparse.Namespace) -> int:
    """Add a block with its own budget to a dataset."""
    epsilon = _ledger_number("--epsilon", args.epsilon, lambda value: check_budget_epsilon(value, "block epsilon"))
    delta = None if args.delta is None else _ledger_number("--delta", args.delta, check_delta)
    data = block_data(args.files, args.rows, args.partition, args.user_hash, args.user_range)
    with ledger_from_flags(args) as ledger:
        if data and "files" in data:
            # A block of files goes with their identity, whose people are known only on a per-person dataset.
            data = ledger_session.with_identity(args.name, data, ledger.get_budget(args.dataset,
                                                                                   pld_may_be_pending=True),
                                                args.user_id)
        status = ledger.add_block(args.dataset, args.name, epsilon, delta, data)
    _print_statuses([status], args.json)
    return 0


def block_data(
    files: list[str] | None, rows: str | None, partition: str | None, user_hash: str | None, user_range: str | None
) -> dict:
    """A block's declaration of where its rows are, from `block add`'s flags; local paths become absolute,
    as a training config's locations do, so that the two compare equal."""
    data: dict = {}
    if files:
        data["files"] = [location if "://" in location else os.path.abspath(os.path.expanduser(location))
                         for location in files]
    if rows is not None:
        data["rows"] = _integer_range("--rows", rows)
    if user_range is not None:
        data["user_range"] = _integer_range("--user-range", user_range)
    if partition is not None:
        column, equals, value = partition.partition("=")
        if not (column and equals):
            raise UsageError(f"--partition must be COLUMN=VALUE, e.g. day=2026-11-23 (got {partition!r})")
        data["partition"] = {"column": column, "value": value}
    if user_hash is not None:
        bucket, slash, buckets = user_hash.partition("/")
        if not (slash and bucket.isdigit() and buckets.isdigit()):
            raise UsageError(f"--user-hash must be BUCKET/BUCKETS, e.g. 3/16 (got {user_hash!r})")
        data["user_hash"] = {"buckets": int(buckets), "bucket": int(bucket)}
    if not data:
        raise UsageError(
            "a block declares where its rows are: give --files, and/or one of --rows, --partition, --user-hash "
            "or --user-range"
        )
    return data


def _integer_range(flag: str, value: str) -> list[int]:
    first, colon, stop = value.partition(":")
    if not (colon and first.isdigit() and stop.isdigit()):
        raise UsageError(f"{flag} must be FIRST:STOP, a half-open range of integers >= 0, e.g. 0:1000 (got {value!r})")
    return [int(first), int(stop)]


@ledger_command
def run_quota_set(args: argparse.Namespace) -> int:
    """Give a tenant a quota on a dataset or one of its blocks (admin)."""
    epsilon = _ledger_number("--epsilon", args.epsilon, lambda value: check_budget_epsilon(value, "quota epsilon"))
    with ledger_from_flags(args) as ledger:
        status = ledger.set_quota(args.dataset, args.tenant, epsilon, args.block)
    _print_statuses([status], args.json)
    return 0


@ledger_command
def run_status(args: argparse.Namespace) -> int:
    """Print budget, spent, reserved and remaining epsilon of one or every visible dataset."""
    with ledger_from_flags(args) as ledger:
        if args.dataset:
            statuses = [ledger.get_budget(args.dataset, args.no_wait)]
        else:
            statuses = ledger.list_datasets(args.no_wait)
    _print_statuses(statuses, args.json)
    return 0


@ledger_command
def run_history(args: argparse.Namespace) -> int:
    """Print the newest changes to the ledger, oldest first."""
    limit = checks.integer_at_least("--limit", args.limit, 1)
    with ledger_from_flags(args) as ledger:
        entries = ledger.history(args.dataset, limit)
    if args.json:
        print_json({"history": [entry.to_dict() for entry in entries]})
    else:
        rows = [
            [entry.entry_id, entry.at, entry.actor, entry.action, entry.dataset or "", _details(entry.details)]
            for entry in entries
        ]
        print(format_table(["#", "at (UTC)", "who", "what", "dataset", "details"], rows))
    return 0


def _details(details: dict) -> str:
    shown = {key: value for key, value in details.items() if not isinstance(value, dict)}
    events = details.get("planned_events", details.get("events"))
    if isinstance(events, dict):
        # A reserve's or a commit's events say who adds the noise: the driver, or the silos in Skellam shares.
        shown["noise"] = noise_placement(Composition.from_dict(events))
    return ", ".join(f"{key}={value}" for key, value in sorted(shown.items()))


@ledger_command
def run_release(args: argparse.Namespace) -> int:
    """Free a reservation's unrun steps."""
    with ledger_from_flags(args) as ledger:
        reservation = ledger.release(args.reservation_id)
    if args.json:
        print_json(reservation.to_dict())
    else:
        freed = reservation.planned_steps - reservation.committed_steps
        print(
            f"released {reservation.reservation_id} (job {reservation.job_id} on {reservation.dataset}): "
            f"{reservation.committed_steps} of {reservation.planned_steps} steps stay spent, {freed} freed"
        )
    return 0


@ledger_command
def run_jobs(args: argparse.Namespace) -> int:
    """List reservations, oldest first; with --queued, the jobs waiting for budget, by position."""
    if args.queued and args.active:
        raise UsageError("--queued lists waiting jobs and --active jobs holding budget; give one of them")
    with ledger_from_flags(args) as ledger:
        if args.queued:
            queued = ledger.list_queued(args.dataset)
        else:
            jobs = ledger.list_jobs(args.dataset, "active" if args.active else None, charges=True)
    if args.queued:
        if args.json:
            print_json({"queued": [job.to_dict() for job in queued]})
        else:
            print(_queued_table(queued))
    elif args.json:
        print_json({"jobs": [job.to_dict() for job in jobs]})
    else:
        print(_jobs_table(jobs) + (f"\n\n{_TOOK_NOTE}" if jobs else ""))
    return 0


def _plans_table(plans: list) -> str:
    headers = ["plan", "dataset", "tenant", "jobs", "started", "unstarted (not refunded)", "ε", "δ", "registered"]
    rows = [
        [plan.name, plan.dataset, plan.tenant, len(plan.jobs), plan.started_jobs, len(plan.jobs) - plan.started_jobs,
         plan.epsilon, plan.delta, plan.created_at]
        for plan in plans
    ]
    return format_table(headers, rows)


@ledger_command
def run_plan_list(args: argparse.Namespace) -> int:
    """A dataset's pre-registered plans, oldest first."""
    with ledger_from_flags(args) as ledger:
        plans = ledger.list_plans(args.dataset)
    if args.json:
        print_json({"plans": [plan.to_dict() for plan in plans]})
    elif not plans:
        print(f"dataset {args.dataset!r} has no plan")
    else:
        print(_plans_table(plans) + "\n\nε, δ: what the plan pool was charged at registration, the PLD ε of all "
              "the plan's jobs composed; plans add up by basic composition. Jobs that never start are not refunded.")
    return 0


@ledger_command
def run_cancel(args: argparse.Namespace) -> int:
    """Take a waiting job out of its dataset's queue."""
    with ledger_from_flags(args) as ledger:
        queued = ledger.cancel_queued(args.queue_id)
    if args.json:
        print_json(queued.to_dict())
    else:
        print(f"{queued.queue_id} (job {queued.job_id} on {queued.dataset}): {queued.state}")
    return 0


@ledger_command
def run_token_rotate(args: argparse.Namespace) -> int:
    """Replace a tenant's token, or the admin token of the call, and print the new one once."""
    if args.admin == (args.tenant is not None):
        raise UsageError("name a tenant (--tenant NAME) or ask for the admin token (--admin), one of them")
    with ledger_from_flags(args) as ledger:
        rotated = ledger.rotate_token(args.tenant)
    if args.json:
        print_json(rotated.to_dict())
    else:
        whose = f"tenant {rotated.tenant}'s token" if rotated.tenant else "the admin token"
        print(
            f"{whose} rotated; the old one stops working on every server within a second. "
            f"The new one, shown only now (keep it secret):\n{rotated.token}"
        )
    return 0


@ledger_command
def run_token_revoke(args: argparse.Namespace) -> int:
    """Revoke a tenant's token or an admin token (admin)."""
    if (args.tenant is None) == (args.admin_key_id is None):
        raise UsageError("name a tenant (--tenant NAME) or an admin token (--admin-key-id ID), one of them")
    with ledger_from_flags(args) as ledger:
        key_id = ledger.revoke_token(args.tenant, args.admin_key_id)
    if args.json:
        print_json({"tenant": args.tenant, "revoked_key_id": key_id})
    else:
        print(f"token {key_id} revoked; every server refuses it within a second")
    return 0


def _open_store(args: argparse.Namespace) -> Ledger:
    """The ledger file or database of --db (default: the embedded file) as its admin, with --history-key."""
    path = args.db if args.db and is_postgresql(args.db) else Path(args.db) if args.db else default_ledger_path()
    if isinstance(path, Path) and not path.exists():
        raise UsageError(f"no ledger file at {path}; give the file or URL dpfleet ledger serve --db uses")
    return Ledger(path, caller=ADMIN, history_key_file=_history_key(args))


def _history_key(args: argparse.Namespace) -> HistoryKeySource | None:
    """The history key's source of --history-key, --history-key-env or --history-key-command (None: the default)."""
    return history_key_source(args.history_key, args.history_key_env, args.history_key_command)


@ledger_command
def run_head(args: argparse.Namespace) -> int:
    """Print the history's head signed with the history key or --signing-key, for the operator to keep elsewhere."""
    signing_key = load_signing_key(args.signing_key) if args.signing_key is not None else None
    with _open_store(args) as ledger:
        head = ledger.head(signing_key)
    print_json(head.to_dict())
    return 0


@ledger_command
def run_new_signing_key(args: argparse.Namespace) -> int:
    """Write a new Ed25519 key to sign heads with, and its public key beside it."""
    public_path = new_signing_key(args.out)
    print(f"wrote the signing key {args.out} (mode 0600; keep it from the database's administrator) and its public "
          f"key {public_path} (give it to tenants: dpfleet ledger verify --head FILE --public-key {public_path})")
    return 0


@ledger_command
def run_verify(args: argparse.Namespace) -> int:
    """Check the history's hash chain and replay every dataset's history; exit 1 on any finding."""
    head = None
    if args.head is not None:
        try:
            head = SignedHead.from_dict(json.loads(Path(args.head).read_text()))
        except ValueError as error:
            raise UsageError(f"--head {args.head}: not the JSON dpfleet ledger head prints ({error})") from None
    if args.public_key is not None and head is None:
        raise UsageError("--public-key checks a head's signature: give the head too (--head FILE)")
    public_key = load_public_key(args.public_key) if args.public_key is not None else None
    path = args.db or default_ledger_path()
    with _open_store(args) as ledger:
        verification = ledger.verify(head, full=args.full, head_public_key=public_key)
    if args.json:
        print_json(verification.to_dict())
    else:
        for finding in verification.findings:
            print(finding)
        outcome = f"{len(verification.findings)} finding(s)" if verification.findings else "no findings"
        extends = "" if head is None else f"; checked against the head of {head.entries} entries signed at {head.at}"
        replayed = "all replayed" if verification.replayed == verification.entries else (
            f"{verification.replayed} replayed after the last verified entry")
        print(
            f"{outcome} in {verification.entries} history entries (every hash checked, {replayed}) and "
            f"{verification.datasets} datasets of "
            f"{shown_location(str(path))}{extends}; "
            f"head hash {verification.head_hash} (keep dpfleet ledger head's signed head elsewhere to notice a "
            "history cut or rewritten)"
        )
    return 1 if verification.findings else 0
