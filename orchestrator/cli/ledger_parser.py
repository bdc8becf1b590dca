"""`dpfleet ledger ...`: the privacy ledger from the command line.

Client commands talk to `--ledger HOST:PORT` (or DPFLEET_LEDGER) with
`--token` (or DPFLEET_TOKEN); with no address they open the embedded ledger
file ($DPFLEET_HOME/ledger.db or ~/.local/share/dpfleet/ledger.db) as its
local admin, whose own datasets live in the tenant 'local'.
"""

from __future__ import annotations

import argparse

from accounting.ledger.limits import AUTH_FAILURE_BURST, AUTH_FAILURE_RATE_PER_SECOND, CURVE_BURST, CURVE_RATE_PER_SECOND
from accounting.ledger.operations import OPERATIONS
from accounting.ledger.scheduling import POLICIES
from accounting.ledger.validation import PRIVACY_UNITS

# Each command's handler, imported only when the command runs: the parser needs none of the ledger's modules.
_HANDLERS = "orchestrator.cli.ledger:"
_ADDRESS_HELP = (
    "ledger server HOST:PORT, or HOST:PORT,HOST:PORT for servers of one database to fail over between "
    "(default: $DPFLEET_LEDGER; without either, the embedded ledger file)"
)


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger", help=_ADDRESS_HELP)
    parser.add_argument("--token", help="tenant or admin token (default: $DPFLEET_TOKEN)")
    parser.add_argument("--tls-ca", help="PEM file of the CA that signed the server's certificate (enables TLS)")
    parser.add_argument("--timeout", default="10", help="seconds to wait for each answer (default 10)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_history_key_flag(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument(
        "--history-key",
        help="the file of the key the history is chained with (default: ledger-history.key in $DPFLEET_HOME or "
        "~/.local/share/dpfleet, created on first use); every server of one database needs the same",
    )


def _add_history_key_sources(parser: argparse.ArgumentParser) -> None:
    """The history key from one of a file, an environment variable or a command (docs/ledger.md)."""
    sources = parser.add_mutually_exclusive_group()
    _add_history_key_flag(sources)
    sources.add_argument(
        "--history-key-env", metavar="VAR",
        help="take the history key from this environment variable instead (64 hex digits, as in the key file)",
    )
    sources.add_argument(
        "--history-key-command", metavar="CMD",
        help="take the history key from what this command prints instead, such as a secrets manager's client "
        "(64 hex digits; run without a shell, its words split as a POSIX shell would; a failure stops the command)",
    )


def _add_store_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", help="the ledger file or postgresql:// URL (default: the embedded ledger file)")


def _add_scheduling_flags(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument("--scheduling", choices=POLICIES,
                        help=f"how {whose} queue of waiting jobs is served: fcfs (in arrival order), dpf "
                             "(dominant-share fairness, PrivateKube) or dpack (packing by efficiency, DPack); "
                             "docs/ledger.md#the-queue")
    parser.add_argument("--unlock-jobs", help="dpf, dpack: unlock 1/N of the budget per arriving job (N >= 1)")
    parser.add_argument("--unlock-seconds",
                        help="dpf, dpack: unlock the budget linearly over this many seconds from the dataset's "
                             "creation")


def _command_group(commands: argparse._SubParsersAction, name: str, help: str) -> argparse._SubParsersAction:
    """A command that only groups others (`dpfleet ledger NAME COMMAND`): its subcommands."""
    return commands.add_parser(name, help=help).add_subparsers(
        dest=f"{name}_command", required=True, metavar="COMMAND"
    )


def _add_listener_port_flag(parser: argparse.ArgumentParser, flag: str, serves: str, default: str) -> None:
    """A port the server also serves `serves` on, beside gRPC (`default` says what runs without the flag)."""
    parser.add_argument(
        flag, help=f"also serve {serves} on this port, behind the same tokens; 0 picks a free one (default: {default})"
    )


def _add_token_bucket_flags(
    parser: argparse.ArgumentParser, flags: tuple[str, str], counted: str, rate: float, burst: float,
    rate_help: str, burst_note: str = "",
) -> None:
    """The two flags of one rate limit (accounting.ledger.limits): the rate `counted` refill at, and the burst."""
    rate_flag, burst_flag = flags
    parser.add_argument(rate_flag, default=f"{rate:g}", help=f"{rate_help} (default {rate:g})")
    parser.add_argument(
        burst_flag, default=f"{burst:g}",
        help=f"{counted} at once before the rate applies (default {burst:g}{burst_note})",
    )


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    """`serve`: the server's listeners, TLS, admin token, history key, default scheduling and rate limits."""
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
    _add_listener_port_flag(serve_parser, "--http-port", "the read-only web page (budgets, burn-down, jobs)", "no page")
    _add_listener_port_flag(
        serve_parser, "--metrics-port",
        "Prometheus metrics at /metrics (send the token as 'Authorization: Bearer')", "no metrics",
    )
    serve_parser.add_argument("--tls-cert", help="PEM certificate of the server (with --tls-key)")
    serve_parser.add_argument("--tls-key", help="PEM private key of the server (with --tls-cert)")
    serve_parser.add_argument("--json", action="store_true", help="announce the address as JSON")
    _add_history_key_sources(serve_parser)
    serve_parser.add_argument(
        "--allow-key-beside-database", action="store_true",
        help="start though the history key file is in the SQLite file's folder or is the default one, where "
        "whoever writes the database as this user can read it (refused without this flag)",
    )
    _add_scheduling_flags(serve_parser, "a dataset created without --scheduling: its")
    serve_parser.add_argument(
        "--curve-processes", default="1",
        help="processes that compute RDP curves (milliseconds to 0.2 s each) beside the server, so that no request "
        "waits for another tenant's curve on the GIL; 0 computes them in the request threads (default 1)",
    )
    _add_token_bucket_flags(
        serve_parser, ("--curves-per-second", "--curve-burst"), "each tenant's costly requests",
        CURVE_RATE_PER_SECOND, CURVE_BURST,
        "each tenant's costly requests: one per RDP curve of a mechanism the server has not seen (milliseconds to "
        "0.2 s of CPU each), and one more per fits; refilled at this rate",
        ", a plan of the most distinct mechanisms a plan may have",
    )
    _add_token_bucket_flags(
        serve_parser, ("--auth-failures-per-second", "--auth-failure-burst"), "failed authentications per token key id",
        AUTH_FAILURE_RATE_PER_SECOND, AUTH_FAILURE_BURST,
        "failed authentications per token key id, refilled at this rate; beyond them a token of that key id is "
        "refused without a look at it",
    )
    serve_parser.set_defaults(handler=_HANDLERS + "run_serve")


def _add_tenant_and_token_commands(commands: argparse._SubParsersAction) -> None:
    """Tenants and the tokens they and the admins hold."""
    tenant = _command_group(commands, "tenant", "tenants (admin)")
    tenant_create = tenant.add_parser("create", help="create a tenant and print its token once (admin)")
    tenant_create.add_argument("name", help="tenant name: 1-128 letters, digits, '.', '_' or '-'")
    _add_client_flags(tenant_create)
    tenant_create.set_defaults(handler=_HANDLERS + "run_tenant_create")

    token = _command_group(commands, "token", "rotate and revoke tenant and admin tokens")
    token_rotate = token.add_parser(
        "rotate",
        help="replace a tenant's token (admin, or the tenant itself) or the admin token of the call (--admin) "
        "with a new one, printed once; the old one stops working on every server within a second",
    )
    token_rotate.add_argument("--tenant", help="the tenant whose token to replace")
    token_rotate.add_argument("--admin", action="store_true", help="replace the admin token this call is made with")
    _add_client_flags(token_rotate)
    token_rotate.set_defaults(handler=_HANDLERS + "run_token_rotate")
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
    token_revoke.set_defaults(handler=_HANDLERS + "run_token_revoke")


def _add_budget_commands(commands: argparse._SubParsersAction) -> None:
    """Datasets, their blocks and tenants' quotas on them."""
    dataset = _command_group(commands, "dataset", "datasets and their budgets")
    dataset_create = dataset.add_parser("create", help="create a dataset with an (epsilon, delta) budget")
    dataset_create.add_argument("name", help="dataset name (admins: TENANT/NAME)")
    dataset_create.add_argument(
        "--epsilon", required=True, help="budget epsilon over the life of the data, in [1e-6, 1e4]"
    )
    dataset_create.add_argument(
        "--delta", required=True, help="budget delta, in [1e-20, 0.1]; below 1/(dataset size)"
    )
    dataset_create.add_argument(
        "--dataset-size", help="rows (or people) in the dataset: warns when --delta is above 1/N"
    )
    dataset_create.add_argument(
        "--privacy-unit", choices=PRIVACY_UNITS, default=OPERATIONS["create_dataset"].default("privacy_unit"),
        help="what the budget protects: one row (example, the default) or one person with all its rows (user); "
        "an example-level job is charged on a user-level dataset by group privacy, given max_examples_per_user",
    )
    dataset_create.add_argument(
        "--plan-share", default=str(OPERATIONS["create_dataset"].default("plan_share")),
        help="share of the budget (epsilon and delta alike, 0 to 0.99) set aside for good as the pool that "
        "pre-registered plans are charged their PLD ε from (dpfleet ledger plan register); the filter admits "
        "single jobs within the rest (default 0: no pool)",
    )
    _add_scheduling_flags(dataset_create, "the dataset's")
    _add_client_flags(dataset_create)
    dataset_create.set_defaults(handler=_HANDLERS + "run_dataset_create")
    dataset_raise = dataset.add_parser("raise", help="set a dataset's budget epsilon (admin)")
    dataset_raise.add_argument("name", help="dataset name (admins: TENANT/NAME)")
    dataset_raise.add_argument(
        "--epsilon", required=True, help="new budget epsilon; not below what is committed and reserved"
    )
    _add_client_flags(dataset_raise)
    dataset_raise.set_defaults(handler=_HANDLERS + "run_dataset_raise")

    block = _command_group(commands, "block", "blocks of a dataset, each with its own budget")
    block_add = block.add_parser(
        "add", help="add a block (e.g. one day of data) with its own epsilon budget to a dataset (owner or admin)"
    )
    block_add.add_argument("dataset", help="dataset name (admins: TENANT/NAME)")
    block_add.add_argument("name", help="block name: 1-128 letters, digits, '.', '_' or '-' (e.g. 2026-11-23)")
    block_add.add_argument("--epsilon", required=True, help="the block's budget epsilon, > 0")
    block_add.add_argument("--delta", help="the block's budget delta, in (0, 1) (default: the dataset's)")
    block_add.add_argument(
        "--files", nargs="+", metavar="LOCATION",
        help="where the block's rows are: Parquet files or folders (local paths are made absolute); every byte "
             "is read here for the files' SHA-256 and row counts, and no other block may hold one of those files, "
             "under any name",
    )
    block_add.add_argument("--rows", metavar="FIRST:STOP",
                           help="the rows FIRST to STOP-1, in the order the block's files are read")
    block_add.add_argument("--partition", metavar="COLUMN=VALUE", help="the rows whose COLUMN is VALUE")
    block_add.add_argument(
        "--user-hash", metavar="BUCKET/BUCKETS",
        help="the rows of the people whose user id hashes to BUCKET of BUCKETS (SHA-256 of the canonical id: 7, "
             "7.0 and \"7\" are one person); a per-person dataset's blocks are declared by user id",
    )
    block_add.add_argument("--user-range", metavar="FIRST:STOP",
                           help="the rows of the people with integer user ids FIRST to STOP-1")
    block_add.add_argument("--user-id", metavar="COLUMN",
                           help="on a per-person dataset, the column naming each row's person: the block's files "
                                "are read for a keyed digest of each person, and no other block may hold one")
    _add_client_flags(block_add)
    block_add.set_defaults(handler=_HANDLERS + "run_block_add")

    quota = _command_group(commands, "quota", "tenants' quotas on datasets and blocks (admin)")
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
    quota_set.set_defaults(handler=_HANDLERS + "run_quota_set")


def _add_plan_commands(commands: argparse._SubParsersAction) -> None:
    """Pre-registered plans: jobs fixed before any runs, charged their PLD ε from a dataset's plan pool."""
    plan = _command_group(commands, "plan", "pre-registered plans, charged their PLD ε from a plan pool")
    register = plan.add_parser(
        "register",
        help="pre-register RUNS runs of a training config as a plan, charged its PLD ε from the plan pool now",
        description="Plan the job of a training config as dpfleet train would, and register RUNS runs of it (daily "
        "retrains, or repeats) as one plan, fixed before any runs. The dataset's plan pool is charged now the PLD "
        "ε of all of them composed; each then runs with dpfleet train --plan NAME, admitted without the filter. "
        "Runs that never start are not refunded. dpfleet tune registers its grid the same way. Exits 3 when the "
        "pool has too little left.",
    )
    register.add_argument("name", help="the plan's name: 1-128 letters, digits, '.', '_' or '-'")
    register.add_argument("--config", required=True, help="the training config (TOML) of each run")
    register.add_argument("--runs", default="1", help="how many runs of it the plan holds (default 1)")
    register.add_argument(
        "--delta", help="the plan's δ, taken from the pool's (default: a tenth of the pool's δ); its ε is the PLD "
        "ε of its runs at this δ",
    )
    register.add_argument("--dataset-name",
                          help="the dataset's name in the ledger (default: as dpfleet train names it)")
    _add_client_flags(register)
    register.set_defaults(handler="orchestrator.cli.ledger_plans:run_plan_register")
    listed = plan.add_parser("list", help="a dataset's plans: what each cost, and how many of its jobs started")
    listed.add_argument("dataset", help="dataset name (admins: TENANT/NAME)")
    _add_client_flags(listed)
    listed.set_defaults(handler=_HANDLERS + "run_plan_list")


def _add_fits_command(commands: argparse._SubParsersAction) -> None:
    """`fits`: would a training config's job be admitted now."""
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
    fits.set_defaults(handler="orchestrator.cli.ledger_fits:run_fits")


def _add_job_commands(commands: argparse._SubParsersAction) -> None:
    """What the ledger holds now and held before: status, history, jobs; and freeing a job's budget."""
    status = commands.add_parser("status", help="budget, spent, reserved and remaining epsilon per dataset")
    status.add_argument("--dataset", help="only this dataset")
    status.add_argument(
        "--no-wait",
        action="store_true",
        help="answer at once: while the PLD epsilon of new commits is computed (0.1-1 s), "
        "show their RDP epsilon as spent, marked (rdp)",
    )
    _add_client_flags(status)
    status.set_defaults(handler=_HANDLERS + "run_status")

    history = commands.add_parser("history", help="every change to the ledger: who, when, what")
    history.add_argument("--dataset", help="only changes to this dataset")
    limit = OPERATIONS["history"].default("limit")
    history.add_argument("--limit", default=str(limit), help=f"show the newest N changes (default {limit})")
    _add_client_flags(history)
    history.set_defaults(handler=_HANDLERS + "run_history")

    release = commands.add_parser("release", help="free a reservation's unrun steps (e.g. of a job that died)")
    release.add_argument("reservation_id", help="the reservation, as listed by dpfleet ledger jobs")
    _add_client_flags(release)
    release.set_defaults(handler=_HANDLERS + "run_release")

    jobs = commands.add_parser("jobs", help="reservations, oldest first")
    jobs.add_argument("--dataset", help="only jobs on this dataset")
    jobs.add_argument("--active", action="store_true", help="only jobs still holding budget")
    jobs.add_argument("--queued", action="store_true",
                      help="the jobs waiting for budget instead: position, priority, deadline and why each waits")
    _add_client_flags(jobs)
    jobs.set_defaults(handler=_HANDLERS + "run_jobs")

    cancel = commands.add_parser("cancel", help="take a waiting job out of its dataset's queue")
    cancel.add_argument("queue_id", help="the queued job, as listed by dpfleet ledger jobs --queued")
    _add_client_flags(cancel)
    cancel.set_defaults(handler=_HANDLERS + "run_cancel")


def _add_audit_commands(commands: argparse._SubParsersAction) -> None:
    """Checks of the history (verify) and its signed head to keep elsewhere (head), on the store itself."""
    verify = commands.add_parser(
        "verify",
        help="check the history's hash chain and replay every dataset's admissions, tally and commits",
        description="Check that each history entry carries the hash of the one before it, and replay every "
        "dataset's history from its events: each admission and commit against the dataset's rule, and the "
        "replayed RDP tally and committed events against the dataset's row. Every hash is checked each time; the "
        "replays start from the state the last verify that found nothing kept (HMAC-checked, at an entry whose "
        "hash it recorded), so they cost what was recorded since; --full replays from the first entry. Prints "
        "each finding with its dataset and entry; exits 1 when there is any.",
    )
    _add_store_flag(verify)
    verify.add_argument(
        "--head", help="a head file dpfleet ledger head printed earlier: also check that the history still extends "
        "it (no entry cut from the tail, none rewritten)"
    )
    verify.add_argument(
        "--public-key", help="with --head: the PEM public key (FILE.pub of dpfleet ledger signing-key new) its "
        "Ed25519 signature must be by; a head signed otherwise, HMAC included, is a finding"
    )
    verify.add_argument(
        "--full", action="store_true", help="replay every entry from the first, not from the last verified one"
    )
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_history_key_sources(verify)
    verify.set_defaults(handler=_HANDLERS + "run_verify")

    head = commands.add_parser(
        "head",
        help="print the history's head (entries, last hash, time) signed with the history key or an Ed25519 key",
        description="Print the history's head as JSON: how many entries, the last entry's hash and the time, "
        "signed (HMAC-SHA-256) with the history key, or with --signing-key by an Ed25519 key whose public key "
        "tenants hold. Keep it somewhere the ledger's database administrator cannot write; dpfleet ledger verify "
        "--head FILE (--public-key PUB for an Ed25519 head) then tells whether entries were cut from the tail "
        "since, or the history rewritten.",
    )
    _add_store_flag(head)
    _add_history_key_sources(head)
    head.add_argument("--signing-key", help="sign with this Ed25519 private key (PEM, from dpfleet ledger "
                      "signing-key new) instead of the history key, for anyone with its public key to check")
    head.set_defaults(handler=_HANDLERS + "run_head")

    signing_keys = _command_group(commands, "signing-key", "the Ed25519 key that signs heads for tenants to check")
    new_key = signing_keys.add_parser(
        "new", help="write a new Ed25519 key to sign heads with, and its public key",
        description="Write a new Ed25519 private key to OUT (PEM, mode 0600; never over an existing file) and its "
        "public key to OUT.pub. Keep OUT where the ledger's database administrator cannot read it; give OUT.pub to "
        "tenants, who check the heads dpfleet ledger head --signing-key OUT signs with it.",
    )
    new_key.add_argument("out", metavar="OUT", help="the private key's file; the public key goes to OUT.pub")
    new_key.set_defaults(handler=_HANDLERS + "run_new_signing_key")


def _add_rekey_command(commands: argparse._SubParsersAction) -> None:
    """`rekey`: the history chained under the key and sealed, explicitly, on the store itself."""
    rekey = commands.add_parser(
        "rekey",
        help="chain the history under the history key and seal it, recording it in the history",
        description="Check the history, then chain every entry under --history-key and seal the schema version "
        "and head under it, recording a history entry. A file of an older schema version is migrated, as "
        "opening it would; one of this version is checked under the key it was chained with (--from-key; "
        "default the same key, to seal again a history whose kept state was lost). Whatever the check finds (a "
        "chain that does not hold, a file that is not what its schema version wrote) is refused unless "
        "--accept-findings, which records it in the history, where verify reports it from then on. Opening a "
        "ledger never does this by itself.",
    )
    _add_store_flag(rekey)
    _add_history_key_flag(rekey)
    rekey.add_argument("--from-key", help="the file of the key the history is chained with now, when it is "
                       "another than --history-key's")
    rekey.add_argument("--accept-findings", action="store_true",
                       help="chain and seal the history as it is, though the check found something, and record "
                       "what it found")
    rekey.set_defaults(handler="orchestrator.cli.ledger_rekey:run_rekey")


def add_ledger_arguments(ledger: argparse.ArgumentParser) -> None:
    """The `ledger` commands and their arguments."""
    ledger.description = __doc__
    ledger.formatter_class = argparse.RawDescriptionHelpFormatter
    commands = ledger.add_subparsers(dest="ledger_command", required=True, metavar="COMMAND")
    _add_serve_command(commands)
    _add_tenant_and_token_commands(commands)
    _add_budget_commands(commands)
    _add_plan_commands(commands)
    _add_fits_command(commands)
    _add_job_commands(commands)
    _add_audit_commands(commands)
    _add_rekey_command(commands)
