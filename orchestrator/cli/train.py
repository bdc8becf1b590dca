"""`dpfleet train`: run DP-SGD from a config file with command-line overrides."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from accounting.accountants import labelled_epsilon
from accounting.ledger.scheduling import PRIORITY_RANGE
from accounting.ledger.errors import BudgetExceeded, FailedPrecondition, NotFound, PermissionDenied
from accounting.ledger.validation import delta_warning
from orchestrator import checks, release
from orchestrator.config import GROUPS, TrainConfig, documented_keys, load_config
from orchestrator.cli.display import format_table, print_json, show_progress
from orchestrator.errors import BudgetRefusedError, LedgerTimeoutError, ShardTimeoutError, UsageError
from orchestrator.ledger_session import (
    JobLedger,
    bind_dataset_content,
    block_declarations,
    check_declared_blocks,
    ensure_embedded_dataset,
    filter_basis,
    is_embedded,
    job_fits_now,
    ledger_dataset_name,
    name_origin,
    new_job_id,
    open_ledger,
    reservation_gone,
    resumed_job_id,
    takes_phrase,
)
from orchestrator.stopping import stopped_as_interrupted
from workers.sources import read_first

if TYPE_CHECKING:
    from orchestrator.trainer import Trainer


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    """The arguments of `train`; its help ends with the config keys."""
    train.description = (
        "Train with DP-SGD. Without a cluster address a local Ray starts in-process;\n"
        "RAY_ADDRESS, when set, is used instead. Progress bars are shown when stderr is a terminal;\n"
        "elsewhere each epoch is one line."
    )
    train.epilog = config_keys_help()
    train.formatter_class = argparse.RawDescriptionHelpFormatter
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="TOML file with the run's keys (see examples/)")
    source.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest intact checkpoint")
    add_override_flags(train)
    add_job_ledger_flags(train)
    train.add_argument("--non-private-train-loss", action="store_true",
                       help="also print and record the loss on the first training examples after each epoch; it "
                            "reads training rows and is NOT private")
    train.add_argument("--non-private-mia", action="store_true",
                       help="after training, run a loss-threshold membership-inference attack and report its "
                            "AUC and TPR at 1%% FPR (training examples against held-out test examples); it reads "
                            "training rows and is NOT private")
    for old, new in (("--show-train-loss", "--non-private-train-loss"), ("--mia", "--non-private-mia")):
        train.add_argument(old, nargs=0, action=RenamedFlag, new_flag=new, help=f"refused: it is now {new}")
    train.add_argument("--show-values", action="store_true",
                       help="quote the rows that break a rule, how many, and their values in errors about the data, "
                            "and how many rows check_data = \"lenient\" drops (by default they name the file, column "
                            "and rule only); it reads private rows and is NOT private: for the data's owners "
                            "(docs/training.md)")
    train.add_argument("--no-progress", action="store_true",
                       help="hide the progress bars (shown only when stderr is a terminal)")
    train.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    train.add_argument("--overwrite", action="store_true",
                       help="start the run even though its run_dir holds a finished run, whose summary and files "
                            "it replaces (without it, such a run_dir is refused)")
    train.set_defaults(handler=f"{__name__}:run_train")


# The config keys `dpfleet train` takes as flags too; a length given either way replaces the file's.
OVERRIDES = ("workers", "epochs", "steps", "run_dir", "seed")


def add_override_flags(train: argparse.ArgumentParser) -> None:
    """A flag for each key of ``OVERRIDES`` (``--run-dir`` for ``run_dir``), its help and range from its declaration.

    The value stays a string: the config's check reads it, as it reads the file's.
    """
    length = train.add_mutually_exclusive_group()
    documented = {key.name: key for key in documented_keys()}
    for name in OVERRIDES:
        meaning = f"{documented[name].meaning} ({documented[name].valid}; overrides the config)".replace("`", "")
        (length if name in ("epochs", "steps") else train).add_argument(
            f"--{name.replace('_', '-')}", help=meaning.replace("%", "%%"))


class RenamedFlag(argparse.Action):
    """A flag that now has a name saying its output is not private: refused with the new name."""

    def __init__(self, *args, new_flag: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} reads training rows and prints what it finds, which is not private; it is "
                     f"now {self.new_flag}, which says so")


def add_job_ledger_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say which ledger and dataset a training job charges, and whether it waits in the queue."""
    parser.add_argument("--ledger", metavar="HOST:PORT[,HOST:PORT...]",
                        help="privacy ledger server, or servers of one database to fail over between "
                             "(default: the config's ledger, DPFLEET_LEDGER, else embedded)")
    parser.add_argument("--token", help="ledger token (default: DPFLEET_TOKEN)")
    parser.add_argument("--dataset-name", help="the dataset's name in the ledger (default: the config's dataset)")
    parser.add_argument("--plan", metavar="NAME",
                        help="run as the next job of this pre-registered plan (dpfleet ledger plan register): paid "
                             "for when the plan was registered, admitted without the filter if its events are those "
                             "the plan declared for it")
    parser.add_argument("--wait-for-budget", action="store_true",
                        help="when the plan does not fit the dataset's budget now, wait in its queue until the "
                             "ledger's scheduling policy admits it (instead of exiting with status 3)")
    parser.add_argument("--max-wait", metavar="SECONDS",
                        help="with --wait-for-budget: give up (exit 3) after waiting this long (default: no limit)")
    parser.add_argument("--priority", default="0",
                        help="with --wait-for-budget: the job's priority in the queue, higher first "
                             "(-1000 to 1000, default 0)")


def check_run_dir_free(run_dir: str, overwrite: bool) -> None:
    """Refuse to start a run in a ``run_dir`` that holds a finished run (its summary.json), unless ``overwrite``."""
    if not overwrite and os.path.exists(os.path.join(run_dir, "summary.json")):
        raise UsageError(
            f"run_dir {run_dir!r} holds a finished run (its summary.json), which this run would overwrite; give "
            "another --run-dir, or add --overwrite to replace it (dpfleet.train: overwrite=True)"
        )


def check_queue_flags(args: argparse.Namespace) -> None:
    """Refuse --max-wait or --priority without --wait-for-budget."""
    if not args.wait_for_budget and (args.max_wait is not None or args.priority != "0"):
        raise UsageError("--max-wait and --priority are for a job that waits in the queue; add --wait-for-budget")


def config_keys_help(width: int = 100) -> str:
    """The config keys by group, each with its meaning and default, as `dpfleet train --help` ends."""
    lines = ["config keys (TOML), by group; docs/config-reference.md also gives each one's type and valid range:"]
    keys = documented_keys()
    column = max(24, max(len(item.name) for item in keys) + 1)
    for group in GROUPS:
        lines += ["", f"{group}:"]
        for item in keys:
            if item.group == group:
                text = f"{item.meaning} Default: {item.default}.".replace("`", "")
                lines += textwrap.wrap(text, width, initial_indent=f"  {item.name:<{column}}",
                                       subsequent_indent=" " * (column + 2), break_on_hyphens=False)
    return "\n".join(lines)


def run_job(args: argparse.Namespace) -> tuple[Trainer, dict, Any]:
    """The job `dpfleet train` runs, for it and for the Python API: (the trainer, its summary, the ledger's status).

    ``args.config`` is a TOML file's path, or a TrainConfig already checked (the API's).
    """
    check_queue_flags(args)
    options = {"show_progress": show_progress(args.no_progress, sys.stderr),
               "non_private_train_loss": args.non_private_train_loss, "show_values": args.show_values}
    try:
        if args.resume:
            from orchestrator.trainer import resume_trainer  # torch and Ray

            trainer = resume_trainer(args.resume, **options)
        else:
            config = args.config if isinstance(args.config, TrainConfig) else \
                load_config(args.config, {name: getattr(args, name) for name in OVERRIDES})
            check_run_dir_free(config.run_dir, args.overwrite)
            # The model on made-up examples of the data, before the ledger is asked and Ray loaded (this loads torch
            # only): a model that does not fit the data is refused at once, and the trainer takes it as checked.
            from orchestrator.preflight import checked_model

            checked = checked_model(config, functools.partial(print, flush=True))
            # The ledger is asked before Ray loads too: files another dataset holds (the same rows moved, say) are
            # refused at once, and a budget-based target ε reads the budget's filter.
            ledger = open_ledger(args.ledger or config.ledger, args.token)
            try:
                dataset = register_embedded(ledger, args.dataset_name, config, print)
                charge_epsilon = filter_basis(ledger, dataset, config.blocks) \
                    if config.target_epsilon_basis == "filter" else None
                refuse_what_does_not_fit(args, ledger, dataset, config)
            finally:
                ledger.close()
            # Ray loads with the trainer, once the config and the model are checked.
            from orchestrator.trainer import Trainer

            trainer = Trainer(config, charge_epsilon=charge_epsilon, checked=checked, **options)
    except ValueError as error:
        # Errors about the data name where and which rule; only the data's owners ask to see the value too.
        quoted = getattr(error, "with_values", None) if args.show_values else None
        raise UsageError(quoted or str(error)) from None
    try:
        return reserve_and_run(args, trainer)
    except BaseException:
        # A silo's workers, and their windows of rows, start with the trainer: they stop however the job ends.
        trainer.close()
        raise


def refuse_what_does_not_fit(args: argparse.Namespace, ledger, dataset: str, config: TrainConfig) -> None:
    """Before Ray loads, refuse (BudgetRefusedError, exit 3) a job whose plan the ledger would not admit now, in the
    words of a refused reservation; the reservation itself still decides.

    Only where the plan is known without the run: not with shards (their N comes from the silos), nor with
    --wait-for-budget (the job queues), nor with a target ε (its σ is calibrated once, by the trainer).
    """
    if config.shards or args.wait_for_budget or config.target_epsilon is not None or args.plan:
        return
    try:
        _, _, report, _ = job_fits_now(ledger, dataset, config)
        refused = next((check.refusal(dataset) for check in report.checks if not check.fits), None)
    except (BudgetExceeded, PermissionDenied, FailedPrecondition, NotFound) as error:
        refused = error
    if refused is not None:
        raise BudgetRefusedError(f"the ledger refused to start the job: {refused}{privacy_unit_note(args, config)}")


def reserve_and_run(args: argparse.Namespace, trainer: Trainer) -> tuple[Trainer, dict, Any]:
    """`run_job` once its trainer is made: reserve the budget, run, release; (the trainer, its summary, the status)."""
    config = trainer.config
    if args.non_private_mia and config.shards:
        raise UsageError("--non-private-mia scores training examples on the driver, and with shards the training "
                         "data stays on its nodes; leave --non-private-mia off")
    if args.non_private_mia and config.privacy_unit == "user":
        raise UsageError("--non-private-mia attacks single examples, and privacy_unit = \"user\" protects users; "
                         "leave --non-private-mia off")
    warning = delta_warning(config.delta, trainer.plan.dataset_size)
    if warning is not None:
        print(release.line("delta_warning", warning=warning), file=sys.stderr)
    try:
        trainer.ledger = job_ledger(args, trainer)
    except BudgetRefusedError as refused:
        raise BudgetRefusedError(f"{refused}{privacy_unit_note(args, config)}") from None
    try:
        summary = run_reserved(trainer)
        budget = trainer.ledger.status()
    finally:
        trainer.ledger.close()
    if args.non_private_mia:
        summary["membership_inference_non_private"] = _membership_inference(trainer)
    return trainer, summary, budget


def privacy_unit_note(args: argparse.Namespace, config) -> str:
    """Why a refused job costs more than its own ε when its privacy unit is not its ledger dataset's ('' when they
    agree): the mismatch of units, named, and the two ways out."""
    ledger = open_ledger(args.ledger or config.ledger, args.token)
    dataset = ledger_dataset_name(args.dataset_name, config)
    try:
        dataset_unit = ledger.get_budget(dataset, pld_may_be_pending=True).privacy_unit
    except Exception:  # noqa: BLE001 - a dataset the ledger cannot show (absent, another tenant's): the refusal says it
        return ""
    finally:
        ledger.close()
    return unit_mismatch(config.privacy_unit, dataset, dataset_unit)


def unit_mismatch(job_unit: str, dataset: str, dataset_unit: str) -> str:
    """The note a refusal ends with when a job protecting ``job_unit`` meets a dataset budgeted per ``dataset_unit``."""
    if job_unit == dataset_unit:
        return ""
    if job_unit == "user":
        return (f". The privacy units differ: this job protects users (privacy_unit = \"user\") and the ledger's "
                f"dataset {dataset!r} is budgeted per example, so each row is charged at twice the clipped "
                "sensitivity, far above the run's own per-user ε. Charge a dataset created per user (dpfleet ledger "
                "dataset create NAME --privacy-unit user, then --dataset-name NAME), or train with "
                "privacy_unit = \"example\"")
    return (f". The privacy units differ: this job protects single examples and the ledger's dataset {dataset!r} is "
            "budgeted per user, so it is charged by group privacy over the rows one person may own. Bound them "
            "(user_id and max_examples_per_user), or train with privacy_unit = \"user\"")


def run_train(args: argparse.Namespace) -> int:
    """Validate the config (or find the run to resume), reserve budget, train, release the rest, report.

    SIGTERM and SIGHUP stop it as Ctrl-C does (`orchestrator.stopping`).
    """
    with stopped_as_interrupted(signal.SIGTERM, signal.SIGHUP):
        trainer, summary, budget = run_job(args)
    config = trainer.config
    if args.json:
        summary = {key: value for key, value in summary.items() if key != "events"}
        summary["dataset_remaining_epsilon"] = budget.remaining_epsilon
        print_json(release.record("summary.json", summary, shown={"membership_inference_non_private"}))
        return 0
    rows = [
        *[[f"test {name.replace('_', ' ')}", summary[f"test_{name}"]] for name in (*config.metrics, "loss")],
        # The label says how the figure was obtained where the accountant answered otherwise than by its own
        # method (the RDP bound of the silos' Skellam noise, or past PLD's practical range).
        [f"epsilon ({summary['accountant']}{'' if summary['epsilon_rigorous'] else ', approximate'})"
         if summary["epsilon_label"] in (summary["accountant"], f"{summary['accountant']} (approximate)")
         else f"epsilon ({summary['epsilon_label']})", summary["epsilon"]],
        ["delta", summary["delta"]],
        steps_row(summary),
        noise_row(config, summary),
        ["wall seconds", summary["wall_seconds"]],
        ["samples/s", summary["samples_per_second"]],
        ["run dir", config.run_dir],
        [f"ledger: {trainer.ledger.dataset!r} budget", f"epsilon {budget.budget_epsilon:g} at delta {budget.delta:g}"],
        ["ledger: spent (filter)", budget.spent_epsilon_filter],
        ["ledger: remaining", budget.remaining_epsilon],
        [f"ledger: spent ({budget.spent_epsilon_accountant}, non-adaptive)", budget.spent_epsilon],
    ]
    rows.extend(outage_rows(summary.get("shard_outages", [])))
    if args.non_private_mia:
        attack = summary["membership_inference_non_private"]
        rows.append(["membership inference AUC (NOT private)", attack["auc"]])
        rows.append(["membership inference TPR at 1% FPR (NOT private)", attack["tpr_at_1pct_fpr"]])
    print(release.line("summary_table", table=format_table(["summary", "value"], rows)))
    return 0


def steps_row(summary: dict) -> list:
    """The summary's steps row; a run that early stopping ended says so, with the steps it planned."""
    if summary.get("stopped_early"):
        return ["steps (stopped early; the rest released, not charged)", f"{summary['steps']} of "
                f"{summary['planned_steps']}"]
    return ["steps", summary["steps"]]


def noise_row(config, summary: dict) -> list:
    """The summary's noise multiplier row, saying which was fixed: σ itself, or a target ε that σ was chosen for."""
    if config.target_epsilon is None:
        return ["noise multiplier (fixed)", summary["noise_multiplier"]]
    return [f"noise multiplier (chosen for the fixed target epsilon {config.target_epsilon:g} over "
            f"{summary['steps']} steps)", summary["noise_multiplier"]]


def run_reserved(trainer: Trainer) -> dict:
    """Run a trainer that holds a reservation, then release the steps that did not run.

    A run that fails releases them too, so a failed job holds no budget; a
    run stopped at a resumable checkpoint (the ledger or a shard out of
    reach) keeps its reservation for `dpfleet train --resume`.
    """
    try:
        summary = trainer.run()
    except LedgerTimeoutError as error:
        raise LedgerTimeoutError(
            f"{error}. The run stopped before any uncharged step, at a checkpoint; "
            f"continue with: dpfleet train --resume {trainer.config.run_dir}"
        ) from None
    except ShardTimeoutError:
        raise
    except BaseException:
        trainer.ledger.release()
        raise
    trainer.ledger.release()
    return summary


def outage_rows(outages: list[dict]) -> list[list[str]]:
    """Summary rows naming the steps that ran without a shard (or without one of its workers)."""
    rows = []
    for outage in outages:
        who = f"shard {outage['shard']}" if outage["workers"] == 1 else \
            f"shard {outage['shard']} worker {outage['worker']} of {outage['workers']}"
        first, last = outage["first_step"], outage["last_step"]
        rows.append([f"ran without {who} ({outage['resources']})",
                     f"step {first}" if first == last else f"steps {first}-{last}"])
    return rows


def _membership_inference(trainer: Trainer, examples: int = 1000) -> dict:
    """Loss-threshold attack on the trained model: its training examples against test examples it never saw."""
    from orchestrator.membership import membership_report  # torch, for a flag that needs it

    config = trainer.config
    members = min(examples, trainer.plan.dataset_size)
    images, labels = read_first(config.dataset, "train", members, config.data_root)
    test_images, test_labels = read_first(config.dataset, "test", examples, config.data_root)
    return membership_report(trainer.model, images, labels, test_images, test_labels)


def job_ledger(args: argparse.Namespace, trainer: Trainer) -> JobLedger:
    """The job's reservation: a new one for the whole plan; for a resumed run, the one it holds, or, when that one
    is gone (released as a stopped run ends, or its lease ran out), a new one for the steps it did not charge."""
    config = trainer.config
    ledger = open_ledger(args.ledger or config.ledger, args.token)
    dataset = ledger_dataset_name(args.dataset_name, config)
    say = trainer.say
    if trainer.resumed_reservation_id is None:
        register_embedded(ledger, args.dataset_name, config, say)
        job = reserve_steps(args, trainer, ledger, dataset, new_job_id(config.run_dir))
        on_blocks = f" (blocks {', '.join(config.blocks)})" if config.blocks else ""
        say(release.line("ledger_reserved", steps=trainer.plan.steps, dataset=repr(dataset), blocks=on_blocks,
                         reservation=job.reservation_id, **cost_fields(trainer, job)))
        return job
    charged = trainer.resumed_reservation["dataset"]
    if charged is not None and charged != dataset:
        raise UsageError(
            f"the run in {config.run_dir!r} is charged to the ledger's dataset {charged!r} (reservation "
            f"{trainer.resumed_reservation_id}), not {dataset!r}; resume it with --dataset-name {charged}, or "
            "start a new run: dpfleet train --config FILE --run-dir NEW_DIR"
        )
    held = JobLedger.held(ledger, dataset, trainer.resumed_reservation_id, config.ledger_timeout, say)
    # The ledger, not the checkpoint, says what is charged: the clock may have charged blocks ahead of the steps.
    trainer.continue_charged(held.reservation_id, held.committed_steps)
    gone = reservation_gone(held)
    if gone is None or held.committed_steps == trainer.plan.steps:
        say(release.line("ledger_continuing", reservation=held.reservation_id))
        return JobLedger(ledger, dataset, held.reservation_id, config.ledger_timeout, say, held.plan)
    job = reserve_steps(args, trainer, ledger, dataset, resumed_job_id(held.job_id), held.committed_steps)
    say(release.line("ledger_reserved_again", previous=held.reservation_id, how=gone,
                     charged=held.committed_steps, steps=trainer.plan.steps,
                     remaining=trainer.plan.steps - held.committed_steps, reservation=job.reservation_id,
                     **cost_fields(trainer, job)))
    return job


def reserve_steps(
    args: argparse.Namespace, trainer: Trainer, ledger, dataset: str, job_id: str, start: int = 0,
) -> JobLedger:
    """Reserve the plan's steps from `start` on as job `job_id`, through the budgets' filters (waiting in the queue
    with --wait-for-budget), once the files the run reads are checked to be those the dataset or its blocks hold."""
    config = trainer.config
    if config.blocks:
        check_declared_blocks(ledger.get_budget(dataset, pld_may_be_pending=True), config.blocks,
                              block_declarations(config), config.user_id)
    else:
        bind_dataset_content(ledger, dataset, trainer.training_file_digests)
    plan_for_unit = functools.partial(trainer.plan.ledger_plan, start=start)
    if args.plan is not None:
        if args.wait_for_budget or config.blocks:
            raise UsageError("a job of a pre-registered plan was paid for with its plan: it neither waits for budget "
                             "nor runs on blocks; leave out --wait-for-budget and the config's blocks")
        return JobLedger.reserve(ledger, dataset, job_id, plan_for_unit, config.ledger_timeout, trainer.say,
                                 config.ledger_lease, plan=args.plan)
    if args.wait_for_budget:
        return JobLedger.wait_for_budget(
            ledger, dataset, job_id, plan_for_unit, config.ledger_timeout, trainer.say, config.ledger_lease,
            config.blocks, checks.integer_in_range("--priority", args.priority, *PRIORITY_RANGE),
            checks.positive_number("--max-wait", args.max_wait) if args.max_wait is not None else None,
        )
    return JobLedger.reserve(
        ledger, dataset, job_id, plan_for_unit, config.ledger_timeout, trainer.say, config.ledger_lease, config.blocks
    )


def cost_fields(trainer: Trainer, job: JobLedger) -> dict[str, str]:
    """The start line's words on what the job costs: what its reservation took from each budget's remaining ε as
    the ledger admitted it (`takes_phrase`), and the whole run's own ε by the run's accountant."""
    config = trainer.config
    epsilon, shown = labelled_epsilon(trainer.report.accountant, trainer.plan.planned_events, config.delta)
    if job.plan is not None:
        taken = f"nothing more (plan {job.plan!r} paid for it when it was registered)"
    else:
        taken = takes_phrase([(charge.block, charge.admitted_epsilon, charge.remaining_before_epsilon)
                              for charge in job.charges()])
    return {"takes": taken, "epsilon": f"{epsilon:.3g}", "accountant": shown, "delta": f"{config.delta:g}"}


def register_embedded(ledger, dataset_name: str | None, config, say) -> str:
    """The dataset's ledger name (`ledger_dataset_name` of --dataset-name); in the embedded ledger, the dataset and
    its chosen blocks are registered on first use."""
    dataset = ledger_dataset_name(dataset_name, config)
    if is_embedded(ledger):
        ensure_embedded_dataset(ledger, dataset, config.dataset_budget_epsilon, config.delta, config.privacy_unit, say,
                                config.blocks, block_declarations(config), config.user_id, config.dataset,
                                name_origin(dataset_name, config), config.dataset_plan_share)
    return dataset
