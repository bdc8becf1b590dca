"""`dpfleet ledger ...`: the privacy ledger from the command line.

Client commands talk to `--ledger HOST:PORT` (or DPFLEET_LEDGER) with
`--token` (or DPFLEET_TOKEN); with no address they open the embedded ledger
file ($DPFLEET_HOME/ledger.db or ~/.local/share/dpfleet/ledger.db) as its
local admin, whose own datasets live in the tenant 'local'.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Callable

from accounting.ledger.client import RemoteLedger
from accounting.ledger.core import ADMIN, BudgetExceeded, DatasetStatus, LedgerError, PrivacyLedger
from accounting.ledger.databases import is_postgresql, shown_location
from accounting.ledger.limits import AUTH_FAILURE_BURST, AUTH_FAILURE_RATE_PER_SECOND, CURVE_BURST, CURVE_RATE_PER_SECOND
from accounting.ledger.scheduling import POLICIES, SchedulingPolicy
from accounting.ledger.service import LedgerServer, serve
from accounting.ledger.store import Ledger, default_ledger_path, open_embedded_ledger
from orchestrator import checks
from orchestrator.cli.display import format_number, format_table, print_json
from orchestrator.errors import BudgetRefusedError, UsageError

_ADDRESS_HELP = (
    "ledger server HOST:PORT, or HOST:PORT,HOST:PORT for servers of one database to fail over between "
    "(default: $DPFLEET_LEDGER; without either, the embedded ledger file)"
)


def _ledger_command(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
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


def _open(args: argparse.Namespace) -> PrivacyLedger:
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


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger", help=_ADDRESS_HELP)
    parser.add_argument("--token", help="tenant or admin token (default: $DPFLEET_TOKEN)")
    parser.add_argument("--tls-ca", help="PEM file of the CA that signed the server's certificate (enables TLS)")
    parser.add_argument("--timeout", default="10", help="seconds to wait for each answer (default 10)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_scheduling_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument("--scheduling", choices=POLICIES,
                        help=f"how {whose} queue of waiting jobs is served: fcfs (in arrival order), dpf "
                             "(dominant-share fairness, PrivateKube) or dpack (packing by efficiency, DPack); "
                             "docs/ledger.md#the-queue")
    parser.add_argument("--unlock-jobs", help="dpf, dpack: unlock 1/N of the budget per arriving job (N >= 1)")
    parser.add_argument("--unlock-seconds",
                        help="dpf, dpack: unlock the budget linearly over this many seconds from the dataset's "
                             "creation")


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
    headers = [
        "reservation", "dataset", "blocks", "job", "state", "committed steps", "planned steps", "created", "lease ends",
    ]
    rows = [
        [
            job.reservation_id, job.dataset, " ".join(job.blocks), job.job_id,
            "lease expired" if job.lease_expired else job.state, job.committed_steps, job.planned_steps,
            job.created_at, job.expires_at or "",
        ]
        for job in jobs
    ]
    return format_table(headers, rows)


@_ledger_command
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

    def announce(server: LedgerServer) -> None:
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

    serve(
        args.db, args.host, port, admin_token, args.tls_cert, args.tls_key, announce=announce,
        http_port=http_port, metrics_port=metrics_port, scheduling=_scheduling(args),
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


@_ledger_command
def run_tenant_create(args: argparse.Namespace) -> int:
    """Create a tenant and print its token once."""
    with _open(args) as ledger:
        created = ledger.create_tenant(args.name)
    if args.json:
        print_json(created.to_dict())
    else:
        print(f"tenant {created.tenant} created. Its token, shown only now (keep it secret):\n{created.token}")
    return 0


@_ledger_command
def run_token_rotate(args: argparse.Namespace) -> int:
    """Replace a tenant's token, or the admin token of the call, and print the new one once."""
    if args.admin == (args.tenant is not None):
        raise UsageError("name a tenant (--tenant NAME) or ask for the admin token (--admin), one of them")
    with _open(args) as ledger:
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


@_ledger_command
def run_token_revoke(args: argparse.Namespace) -> int:
    """Revoke a tenant's token or an admin token (admin)."""
    if (args.tenant is None) == (args.admin_key_id is None):
        raise UsageError("name a tenant (--tenant NAME) or an admin token (--admin-key-id ID), one of them")
    with _open(args) as ledger:
        key_id = ledger.revoke_token(args.tenant, args.admin_key_id)
    if args.json:
        print_json({"tenant": args.tenant, "revoked_key_id": key_id})
    else:
        print(f"token {key_id} revoked; every server refuses it within a second")
    return 0


def _print_statuses(statuses: list[DatasetStatus], as_json: bool) -> None:
    if as_json:
        print_json({"datasets": [status.to_dict() for status in statuses]})
    else:
        print(_status_table(statuses))


@_ledger_command
def run_dataset_create(args: argparse.Namespace) -> int:
    """Create a dataset with its (epsilon, delta) budget."""
    epsilon = checks.positive_number("--epsilon", args.epsilon)
    delta = checks.open_unit_interval("--delta", args.delta)
    with _open(args) as ledger:
        status = ledger.create_dataset(args.name, epsilon, delta, args.privacy_unit, _scheduling(args))
    _print_statuses([status], args.json)
    return 0


@_ledger_command
def run_dataset_raise(args: argparse.Namespace) -> int:
    """Set a dataset's budget epsilon (admin)."""
    epsilon = checks.positive_number("--epsilon", args.epsilon)
    with _open(args) as ledger:
        status = ledger.raise_budget(args.name, epsilon)
    _print_statuses([status], args.json)
    return 0


@_ledger_command
def run_block_add(args: argparse.Namespace) -> int:
    """Add a block with its own budget to a dataset."""
    epsilon = checks.positive_number("--epsilon", args.epsilon)
    delta = None if args.delta is None else checks.open_unit_interval("--delta", args.delta)
    with _open(args) as ledger:
        status = ledger.add_block(args.dataset, args.name, epsilon, delta)
    _print_statuses([status], args.json)
    return 0


@_ledger_command
def run_quota_set(args: argparse.Namespace) -> int:
    """Give a tenant a quota on a dataset or one of its blocks (admin)."""
    epsilon = checks.positive_number("--epsilon", args.epsilon)
    with _open(args) as ledger:
        status = ledger.set_quota(args.dataset, args.tenant, epsilon, args.block)
    _print_statuses([status], args.json)
    return 0


@_ledger_command
def run_fits(args: argparse.Namespace) -> int:
    """Say whether a training config's job would be admitted now, what it costs and what would remain."""
    # Planning a job reads the data's size and imports torch; only this command pays for that.
    from orchestrator.cli.train import ledger_dataset_name
    from orchestrator.config import load_config
    from orchestrator.trainer import plan_run

    config = load_config(args.config, {})
    plan = plan_run(config)
    dataset = ledger_dataset_name(args, config)
    # The ledger the job would use: --ledger, else the config's, else DPFLEET_LEDGER (as dpfleet train does).
    args.ledger = args.ledger or config.ledger
    with _open(args) as ledger:
        planned, privacy_unit, rows_per_person = plan.ledger_plan(ledger.get_budget(dataset).privacy_unit)
        report = ledger.fits(dataset, planned, config.blocks, privacy_unit, rows_per_person)
    if args.json:
        print_json({**report.to_dict(), "steps": plan.steps, "sampling_rate": plan.sampling_rate})
    else:
        rows = [
            [check.budget, check.budget_epsilon, check.held_epsilon, check.needed_epsilon, check.remaining_epsilon,
             check.remaining_after_epsilon, "yes" if check.fits else "no"]
            for check in report.checks
        ]
        print(format_table(
            ["budget", "budget ε", "held ε", "job needs ε", "remaining ε now", "remaining ε after", "fits"], rows
        ))
        verdict = "fits" if report.fits else "does not fit"
        print(
            f"\nthe job ({plan.steps} steps at q = {format_number(plan.sampling_rate)}) {verdict} now; nothing was "
            "reserved. ε are the filters' at each budget's δ; another job may change the answer before this one runs."
        )
    return 0 if report.fits else 3


@_ledger_command
def run_status(args: argparse.Namespace) -> int:
    """Print budget, spent, reserved and remaining epsilon of one or every visible dataset."""
    with _open(args) as ledger:
        if args.dataset:
            statuses = [ledger.get_budget(args.dataset, args.no_wait)]
        else:
            statuses = ledger.list_datasets(args.no_wait)
    _print_statuses(statuses, args.json)
    return 0


@_ledger_command
def run_history(args: argparse.Namespace) -> int:
    """Print the newest changes to the ledger, oldest first."""
    limit = checks.integer_at_least("--limit", args.limit, 1)
    with _open(args) as ledger:
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
    return ", ".join(f"{key}={value}" for key, value in sorted(details.items()) if not isinstance(value, dict))


@_ledger_command
def run_release(args: argparse.Namespace) -> int:
    """Free a reservation's unrun steps."""
    with _open(args) as ledger:
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


@_ledger_command
def run_jobs(args: argparse.Namespace) -> int:
    """List reservations, oldest first; with --queued, the jobs waiting for budget, by position."""
    if args.queued and args.active:
        raise UsageError("--queued lists waiting jobs and --active jobs holding budget; give one of them")
    with _open(args) as ledger:
        if args.queued:
            queued = ledger.list_queued(args.dataset)
        else:
            jobs = ledger.list_jobs(args.dataset, "active" if args.active else None)
    if args.queued:
        if args.json:
            print_json({"queued": [job.to_dict() for job in queued]})
        else:
            print(_queued_table(queued))
    elif args.json:
        print_json({"jobs": [job.to_dict() for job in jobs]})
    else:
        print(_jobs_table(jobs))
    return 0


@_ledger_command
def run_cancel(args: argparse.Namespace) -> int:
    """Take a waiting job out of its dataset's queue."""
    with _open(args) as ledger:
        queued = ledger.cancel_queued(args.queue_id)
    if args.json:
        print_json(queued.to_dict())
    else:
        print(f"{queued.queue_id} (job {queued.job_id} on {queued.dataset}): {queued.state}")
    return 0


@_ledger_command
def run_verify(args: argparse.Namespace) -> int:
    """Check the history's hash chain and replay every dataset's history; exit 1 on any finding."""
    path = args.db if args.db and is_postgresql(args.db) else Path(args.db) if args.db else default_ledger_path()
    if isinstance(path, Path) and not path.exists():
        raise UsageError(f"no ledger file at {path}; give the file or URL dpfleet ledger serve --db uses")
    with Ledger(path, caller=ADMIN) as ledger:
        verification = ledger.verify()
    if args.json:
        print_json(verification.to_dict())
    else:
        for finding in verification.findings:
            print(finding)
        outcome = f"{len(verification.findings)} finding(s)" if verification.findings else "no findings"
        print(
            f"{outcome} in {verification.entries} history entries and {verification.datasets} datasets of "
            f"{shown_location(str(path))}; "
            f"head hash {verification.head_hash} (keep it elsewhere to notice a history rewritten from the start)"
        )
    return 1 if verification.findings else 0


def add_ledger_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `ledger` and its commands on the top-level subcommands."""
    ledger = subparsers.add_parser(
        "ledger",
        help="the global privacy ledger: budgets, jobs, history, server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = ledger.add_subparsers(dest="ledger_command", required=True, metavar="COMMAND")

    serve_parser = commands.add_parser(
        "serve",
        help="serve a ledger file over gRPC",
        description="Serve a ledger file over gRPC until SIGTERM or SIGINT; "
        "prints 'listening on HOST:PORT' when ready, then 'page on URL' and 'metrics on URL' for --http-port "
        "and --metrics-port.",
    )
    serve_parser.add_argument(
        "--db", required=True,
        help="the SQLite ledger file (created if missing), or a postgresql://USER@HOST:PORT/DATABASE URL "
        "that several servers may share",
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve_parser.add_argument("--port", default="50051", help="port to listen on; 0 picks a free one (default 50051)")
    serve_parser.add_argument("--admin-token-file", help="file holding the admin token (default: $DPFLEET_ADMIN_TOKEN)")
    serve_parser.add_argument(
        "--http-port",
        help="also serve the read-only web page (budgets, burn-down, jobs) on this port, behind the same tokens; "
        "0 picks a free one (default: no page)",
    )
    serve_parser.add_argument(
        "--metrics-port",
        help="also serve Prometheus metrics at /metrics on this port (send the token as 'Authorization: Bearer'); "
        "0 picks a free one (default: no metrics)",
    )
    serve_parser.add_argument("--tls-cert", help="PEM certificate of the server (with --tls-key)")
    serve_parser.add_argument("--tls-key", help="PEM private key of the server (with --tls-cert)")
    serve_parser.add_argument("--json", action="store_true", help="announce the address as JSON")
    _add_scheduling_flags(serve_parser, "a dataset created without --scheduling: its")
    serve_parser.add_argument(
        "--curve-processes", default="1",
        help="processes that compute RDP curves (80-400 ms each) beside the server, so that no request waits for "
        "another tenant's curve on the GIL; 0 computes them in the request threads (default 1)",
    )
    serve_parser.add_argument(
        "--curves-per-second", default=str(CURVE_RATE_PER_SECOND),
        help="each tenant's costly requests: one per RDP curve of a mechanism the server has not seen (80-400 ms "
        f"of CPU each), and one more per fits; refilled at this rate (default {CURVE_RATE_PER_SECOND:g})",
    )
    serve_parser.add_argument(
        "--curve-burst", default=f"{CURVE_BURST:g}",
        help=f"each tenant's costly requests at once before the rate applies (default {CURVE_BURST:g}, a plan of "
        "the most distinct mechanisms a plan may have)",
    )
    serve_parser.add_argument(
        "--auth-failures-per-second", default=str(AUTH_FAILURE_RATE_PER_SECOND),
        help="failed authentications per peer address, refilled at this rate; beyond them the peer is refused "
        f"without a look at its token (default {AUTH_FAILURE_RATE_PER_SECOND:g})",
    )
    serve_parser.add_argument(
        "--auth-failure-burst", default=f"{AUTH_FAILURE_BURST:g}",
        help=f"failed authentications per peer address at once before the rate applies (default {AUTH_FAILURE_BURST:g})",
    )
    serve_parser.set_defaults(handler=run_serve)

    tenant = commands.add_parser("tenant", help="tenants (admin)").add_subparsers(
        dest="tenant_command", required=True, metavar="COMMAND"
    )
    tenant_create = tenant.add_parser("create", help="create a tenant and print its token once (admin)")
    tenant_create.add_argument("name", help="tenant name: 1-128 letters, digits, '.', '_' or '-'")
    _add_client_flags(tenant_create)
    tenant_create.set_defaults(handler=run_tenant_create)

    token = commands.add_parser("token", help="rotate and revoke tenant and admin tokens").add_subparsers(
        dest="token_command", required=True, metavar="COMMAND"
    )
    token_rotate = token.add_parser(
        "rotate",
        help="replace a tenant's token (admin, or the tenant itself) or the admin token of the call (--admin) "
        "with a new one, printed once; the old one stops working on every server within a second",
    )
    token_rotate.add_argument("--tenant", help="the tenant whose token to replace")
    token_rotate.add_argument("--admin", action="store_true", help="replace the admin token this call is made with")
    _add_client_flags(token_rotate)
    token_rotate.set_defaults(handler=run_token_rotate)
    token_revoke = token.add_parser(
        "revoke",
        help="revoke a tenant's token, or an admin token by its key id (admin); every server refuses it within "
        "a second",
    )
    token_revoke.add_argument("--tenant", help="the tenant whose token to revoke (it can do nothing until rotated)")
    token_revoke.add_argument(
        "--admin-key-id", help="the key id of the admin token to revoke (as rotate and the history show it)"
    )
    _add_client_flags(token_revoke)
    token_revoke.set_defaults(handler=run_token_revoke)

    dataset = commands.add_parser("dataset", help="datasets and their budgets").add_subparsers(
        dest="dataset_command", required=True, metavar="COMMAND"
    )
    dataset_create = dataset.add_parser("create", help="create a dataset with an (epsilon, delta) budget")
    dataset_create.add_argument("name", help="dataset name (admins: TENANT/NAME)")
    dataset_create.add_argument("--epsilon", required=True, help="budget epsilon over the life of the data, > 0")
    dataset_create.add_argument(
        "--delta", required=True, help="budget delta, in (0, 1); usually below 1/(dataset size)"
    )
    dataset_create.add_argument(
        "--privacy-unit", choices=("example", "user"), default="example",
        help="what the budget protects: one row (example, the default) or one person with all its rows (user); "
        "an example-level job is charged on a user-level dataset by group privacy, given max_examples_per_user",
    )
    _add_scheduling_flags(dataset_create, "the dataset's")
    _add_client_flags(dataset_create)
    dataset_create.set_defaults(handler=run_dataset_create)
    dataset_raise = dataset.add_parser("raise", help="set a dataset's budget epsilon (admin)")
    dataset_raise.add_argument("name", help="dataset name (admins: TENANT/NAME)")
    dataset_raise.add_argument(
        "--epsilon", required=True, help="new budget epsilon; not below what is committed and reserved"
    )
    _add_client_flags(dataset_raise)
    dataset_raise.set_defaults(handler=run_dataset_raise)

    block = commands.add_parser("block", help="blocks of a dataset, each with its own budget").add_subparsers(
        dest="block_command", required=True, metavar="COMMAND"
    )
    block_add = block.add_parser(
        "add", help="add a block (e.g. one day of data) with its own epsilon budget to a dataset (owner or admin)"
    )
    block_add.add_argument("dataset", help="dataset name (admins: TENANT/NAME)")
    block_add.add_argument("name", help="block name: 1-128 letters, digits, '.', '_' or '-' (e.g. 2026-11-23)")
    block_add.add_argument("--epsilon", required=True, help="the block's budget epsilon, > 0")
    block_add.add_argument("--delta", help="the block's budget delta, in (0, 1) (default: the dataset's)")
    _add_client_flags(block_add)
    block_add.set_defaults(handler=run_block_add)

    quota = commands.add_parser("quota", help="tenants' quotas on datasets and blocks (admin)").add_subparsers(
        dest="quota_command", required=True, metavar="COMMAND"
    )
    quota_set = quota.add_parser(
        "set", help="give a tenant a quota on a dataset or block: an extra filter on its own use (admin)"
    )
    quota_set.add_argument("dataset", help="dataset name, TENANT/NAME")
    quota_set.add_argument("tenant", help="the tenant the quota is for")
    quota_set.add_argument("--epsilon", required=True, help="the tenant's quota epsilon, > 0, at the budget's delta")
    quota_set.add_argument(
        "--block", help="only this block (default: the dataset, and each block without a quota of its own)"
    )
    _add_client_flags(quota_set)
    quota_set.set_defaults(handler=run_quota_set)

    fits = commands.add_parser(
        "fits",
        help="would a training config's job be admitted now? its cost and what would remain; reserves nothing",
        description="Plan the job of a training config as dpfleet train would, and ask the ledger whether every "
        "budget it would be charged to (the dataset's or each block's, and the tenant's quotas) admits it now. "
        "Reserves nothing. Exits 0 when it fits, 3 when it does not.",
    )
    fits.add_argument("--config", required=True, help="the training config (TOML) to plan")
    fits.add_argument("--dataset-name", help="the dataset's name in the ledger (default: as dpfleet train names it)")
    _add_client_flags(fits)
    fits.set_defaults(handler=run_fits)

    status = commands.add_parser("status", help="budget, spent, reserved and remaining epsilon per dataset")
    status.add_argument("--dataset", help="only this dataset")
    status.add_argument(
        "--no-wait",
        action="store_true",
        help="answer at once: while the PLD epsilon of new commits is computed (0.1-1 s), "
        "show their RDP epsilon as spent, marked (rdp)",
    )
    _add_client_flags(status)
    status.set_defaults(handler=run_status)

    history = commands.add_parser("history", help="every change to the ledger: who, when, what")
    history.add_argument("--dataset", help="only changes to this dataset")
    history.add_argument("--limit", default="1000", help="show the newest N changes (default 1000)")
    _add_client_flags(history)
    history.set_defaults(handler=run_history)

    release = commands.add_parser("release", help="free a reservation's unrun steps (e.g. of a job that died)")
    release.add_argument("reservation_id", help="the reservation, as listed by dpfleet ledger jobs")
    _add_client_flags(release)
    release.set_defaults(handler=run_release)

    verify = commands.add_parser(
        "verify",
        help="check the history's hash chain and replay every dataset's admissions, tally and commits",
        description="Check that each history entry carries the hash of the one before it, and replay every "
        "dataset's history from its events: each admission and commit against the dataset's rule, and the "
        "replayed RDP tally and committed events against the dataset's row. Prints each finding with its "
        "dataset and entry; exits 1 when there is any.",
    )
    verify.add_argument("--db", help="the ledger file or postgresql:// URL (default: the embedded ledger file)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify.set_defaults(handler=run_verify)

    jobs = commands.add_parser("jobs", help="reservations, oldest first")
    jobs.add_argument("--dataset", help="only jobs on this dataset")
    jobs.add_argument("--active", action="store_true", help="only jobs still holding budget")
    jobs.add_argument("--queued", action="store_true",
                      help="the jobs waiting for budget instead: position, priority, deadline and why each waits")
    _add_client_flags(jobs)
    jobs.set_defaults(handler=run_jobs)

    cancel = commands.add_parser("cancel", help="take a waiting job out of its dataset's queue")
    cancel.add_argument("queue_id", help="the queued job, as listed by dpfleet ledger jobs --queued")
    _add_client_flags(cancel)
    cancel.set_defaults(handler=run_cancel)
