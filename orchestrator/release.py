"""The run's one door out: every line it prints and every field it writes, declared once with its class.

Whatever a run prints (its log, through `line`), writes (config.json,
metrics.jsonl, summary.json, a checkpoint, an export's model card and the
files of its Hugging Face folder, an audit, text a model generated, through
`record`) or sends to the ledger (through `record` too) is declared
here, with who may read it (docs/threat-model.md's table of outputs is
`declaration_table`). An output that nobody declared raises
`UndeclaredOutput` instead of leaving, and so does a run-private one; an
owner-only diagnostic leaves only when the flag that shows it was given.
`observe` lets a test list every output of a run, and `undeclared_lines`
finds printed lines that matched no declared template (a print that went
around this door, or a library's line nobody looked at).
"""

from __future__ import annotations

import re
import string
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    """What an output is, which says who may read it."""

    CONFIG = "public configuration"
    METADATA = "public metadata"
    NOISY = "noisy release or its post-processing"
    OWNER = "owner-only diagnostic, behind a flag"
    PRIVATE = "run-private, never written"


class UndeclaredOutput(RuntimeError):
    """An output that is not declared here, or may not leave: a bug in dpfleet, never in the user's input."""


@dataclass(frozen=True)
class Line:
    """A line of a run's log: its name, its template (str.format fields), its class and why it may leave.

    `source` is who prints it: "run" (through `line`), or a library or a
    worker whose line reaches the driver's output ("ray", "worker").
    """

    name: str
    template: str
    kind: Kind
    why: str
    source: str = "run"
    # A table's rows, printed as lines of their own: each row starts with one of these labels.
    row_labels: tuple[str, ...] = ()

    def pattern(self) -> re.Pattern:
        """A regular expression that a printed instance of this line (of a table, one row) matches."""
        if self.row_labels:
            labels = "|".join(re.escape(label) for label in self.row_labels)
            return re.compile(rf"(?:{labels})[^\n]*?(?: {{2,}}\S[^\n]*|-+)\Z")
        parts = []
        for literal, field, _, _ in string.Formatter().parse(self.template):
            parts.append(re.escape(literal))
            if field is not None:
                parts.append(".*?")
        return re.compile("".join(parts) + r"\Z", re.DOTALL)


@dataclass(frozen=True)
class Field:
    """A key of a written record (`artifact`): its class and why it may leave. A key ending in `*` is a prefix."""

    artifact: str
    key: str
    kind: Kind
    why: str

    def covers(self, key: str) -> bool:
        """Whether this declaration is the one of `key`."""
        return key.startswith(self.key[:-1]) if self.key.endswith("*") else key == self.key


_C, _M, _N, _O, _P = Kind.CONFIG, Kind.METADATA, Kind.NOISY, Kind.OWNER, Kind.PRIVATE
_PLAN = "from the config and the public N, before any example is read"
_OPERATION = "an event of the cluster (a node, an actor, the ledger), not of the data"

LINES: tuple[Line, ...] = (
    Line("seeded", "seeded: not for production use (seed {seed})", _C, "the config's seed, which makes the run public"),
    Line("run_start", "dpfleet: {model} on {data} ({size}), {steps} steps, q={sampling_rate}, sigma={sigma}, "
         "C={clip_norm}, {workers} worker(s){resuming}", _M, _PLAN),
    Line("epoch", "epoch {epoch}: {figures}, epsilon {epsilon} ({label}, delta={delta})", _N,
         "the released model's test figures; ε from the events"),
    Line("epoch_train_loss", "epoch {epoch}: {figures}, epsilon {epsilon} ({label}, delta={delta}), train loss "
         "{train_loss} (NOT private: read from training rows)", _O, "--non-private-train-loss asked for it"),
    Line("progress", "epsilon so far {epsilon}", _M, "the progress bar's figure (steps done, ε; never a time)"),
    Line("stopped_early", "stopped early after step {step} of {steps}: test {metric} did not improve for {patience} "
         "evaluation(s); the steps not run are not charged", _N, "decided by the released test figures only"),
    Line("local_ray_shards", "local Ray: this machine stands in for every shard's resources ({resources})", _C,
         "the shards' declared resources"),
    Line("local_ray_retry", "local Ray did not start in time (try {attempt} of {attempts}); trying again", _M,
         _OPERATION),
    Line("workers_devices", "gradient workers on {devices}", _M, _OPERATION),
    Line("engine", "clipping engine, per layer: {layers}", _M, "decided on synthetic examples of the data's shape"),
    Line("parquet_row_by_row", "reading Parquet rows one by one (slow for large tables): {reason}", _C,
         "the config's keys that keep planned batches from the data, or that Ray is a cluster; never a row"),
    Line("aggregation_for_planned_batches", 'aggregation = "auto" takes the driver path, which reads the Parquet '
         "rows through planned batches; the model's size would choose the collective path, which reads them one "
         'by one (plan_ahead_steps = "off" lets it)', _C, "the config and the model's parameter count"),
    Line("worker_replaced", "worker {index} is gone; replacing it and recomputing its shard", _M, _OPERATION),
    Line("collective_start", "collective path: {ranks} ranks over {backend} at {address}", _M, _OPERATION),
    Line("collective_rank_lost", "step {step}: collective rank(s) {lost} lost; replacing them, re-forming the group "
         "and running the {replayed} step(s) since the restore point at step {restore_step} again, with the same "
         "samples and noise", _M, _OPERATION),
    Line("shard_start", "shard {shard}: {dataset} part {part} of {parts} on {resources}, {workers} worker(s), "
         "{examples} examples", _M, "a silo's example count, which the plan's public N adds up"),
    Line("secure_aggregation", "secure aggregation: {detail}", _C, _PLAN),
    Line("silo_noise", "noise in the silos: {detail}", _C, _PLAN),
    Line("shard_recompute", "step {step}: recomputing the part of {slots} on its replacement", _M, _OPERATION),
    Line("shard_unmasked_without", "step {step}: unmasking the sum without {slots}, from the other silos' shares "
         "of its masking key; its sum counts as zero for this step", _M, _OPERATION),
    Line("shard_lost", "step {step}: {slots} is lost; {then} (on_shard_loss = {policy})", _M, _OPERATION),
    Line("shard_placed_again", "step {step}: {slots} placed again", _M, _OPERATION),
    Line("shard_back", "step {step}: {slots} is up again and takes part from this step", _M, _OPERATION),
    Line("lenient_drops", 'check_data = "lenient" dropped {detail}', _O,
         "counts of private rows, shown only with --show-values"),
    Line("outputs_beyond_classes", "warning: the model gives {outputs} outputs per example and the data {data} has "
         "{classes} classes (labels 0..{last}): cross_entropy takes one output per class, and the extra outputs "
         "learn only to be unlikely; give the model's last layer {classes} outputs", _C,
         "the model's output width and the classes the data declares (a built-in's, class folders, num_classes)"),
    Line("classes_from_outputs", "note: the dataset declares no num_classes, so the model's {outputs} outputs number "
         "its classes (labels 0..{last}); if its labels have fewer classes (e.g. 0/1), set the dataset's "
         "num_classes and give the model's last layer one output per class", _C,
         "the model's output width and the config's dataset keys, never a label"),
    Line("lenient_drops_hidden", 'check_data = "lenient" drops rows that fail {detail}', _C,
         "the config's rules, never how many rows they drop"),
    Line("ledger_registered", "registered dataset {dataset} in the embedded ledger with budget epsilon {epsilon} "
         "at delta {delta} (first use; dpfleet ledger status shows it){origin}", _C,
         "the config's budget, and the config's train location where the name comes from it"),
    Line("ledger_registered_block", "registered block {block} of {dataset} in the embedded ledger with budget "
         "epsilon {epsilon} (first use)", _C, "the config's blocks"),
    Line("ledger_reserved", "ledger: reserved {steps} steps on {dataset}{blocks} (reservation {reservation}); "
         "this job takes {takes}; its own privacy: ε {epsilon} ({accountant}, δ {delta})", _M,
         _PLAN + "; the budget's remaining ε before and after the ledger admitted it"),
    Line("ledger_continuing", "ledger: continuing under reservation {reservation}", _M, "the checkpoint's binding"),
    Line("ledger_reserved_again", "ledger: reservation {previous} {how} with {charged} of {steps} steps charged; "
         "reserved the other {remaining} (reservation {reservation}); they take {takes}; the run's own privacy: "
         "ε {epsilon} ({accountant}, δ {delta})", _M,
         "the checkpoint's binding and the blocks charged, which the charge clock's schedule sets; " + _PLAN +
         "; the budget's remaining ε before and after the ledger admitted it"),
    Line("ledger_unreachable", "ledger unreachable while {what}; retrying for up to {seconds} s (no step runs "
         "uncharged)", _M, _OPERATION),
    Line("ledger_reachable", "ledger reachable again; carrying on", _M, _OPERATION),
    Line("ledger_waiting", "ledger: waiting for budget on {dataset} ({queue}): position {position}, {reason}; "
         "{seconds} s so far{deadline}", _M, "the queue's position and reason, from the ledger's budgets"),
    Line("ledger_admitted", "ledger: admitted after {seconds} s in the queue ({reason})", _M,
         "the queue's reason, from the ledger's budgets"),
    Line("summary_table", "{table}", _N, "the summary's declared fields and the ledger's budget after the run",
         row_labels=("summary ", "-", "test ", "epsilon (", "delta ", "steps ", "steps (", "noise multiplier (",
                     "wall seconds ", "samples/s ", "run dir ", "ledger: ", "ran without ",
                     "membership inference ")),
    Line("delta_warning", "warning: {warning}", _C, "δ against the public N"),
    Line("audit_canaries", "audit: {canaries} {mode} canaries{owning} at indices {first}..{last} of the sampler's "
         "{size}, each in the dataset with probability 1/2", _C, "the canaries are made up, not training rows"),
    Line("tokenize_written", "dpfleet data tokenize: wrote {path}: {examples} examples for {task}, input_ids of "
         "{max_length} token ids (padded with {pad}) and {labels}", _M,
         "the output's path and layout, and its number of rows, which training treats as the public N"),
    Line("tokenize_truncated", "{truncated} of {examples} examples had more than {max_length} tokens and were cut to "
         "{max_length}", _O, "a count over private text, for the data's owner, who runs dpfleet data tokenize"),
    Line("tokenize_label_names", "the text labels are numbered in sorted order: {names}; the model takes "
         "num_labels = {count}", _O, "the labels' names, read from private rows, for the data's owner, who runs "
         "dpfleet data tokenize"),
    Line("tokenize_dataset", "train on it with: dataset = {{ {table} }}, where {test} is the test split tokenized "
         "the same way", _C, "the output's path and the dataset keys that read it"),
    Line("ray_started", "{time}INFO worker.py:{line} -- Started a local Ray instance.{rest}", _M, _OPERATION,
         "ray"),
    Line("ray_token", "{time}INFO authentication_token_setup.py:{line} -- {rest}", _M, _OPERATION, "ray"),
    Line("engine_fallback", "({actor} pid={pid}) {where}: UserWarning: {engine} clipping engine: {detail}", _M,
         "the engine's choice, made on synthetic examples of the data's shape", "worker"),
    Line("engine_fallback_source", "({actor} pid={pid})   warnings.warn({rest}", _M,
         "the line of dpfleet's code that warned", "worker"),
    Line("data_download", "({actor} pid={pid}) dpfleet: {detail}", _M,
         "where a built-in data set comes from (a public file)", "worker"),
)

# What a run writes, by artifact. The run-private keys are declared too, so that one that reappears fails.
FIELDS: tuple[Field, ...] = (
    Field("config.json", "*", _C, "the run's configuration: documented config keys only"),
    *(Field("metrics.jsonl", key, kind, why) for key, kind, why in (
        ("epoch", _M, _PLAN), ("step", _M, _PLAN), ("epsilon", _M, "ε of the events, " + _PLAN),
        ("test_*", _N, "the released model on test data"),
        ("train_loss_non_private", _O, "--non-private-train-loss asked for it")
    )),
    *(Field("summary.json", key, kind, why) for key, kind, why in (
        ("test_*", _N, "the released model on test data"),
        *((key, _C, "the config") for key in (
            "loss", "delta", "accountant", "clip_norm", "batch_size", "model", "workers", "noise_placement",
            "mechanism", "sampler", "band_width", "planned_steps", "seeded", "dataset")),
        *((key, _M, _PLAN) for key in (
            "epsilon", "epsilon_label", "epsilon_rigorous", "steps", "noise_multiplier", "sampling_rate", "epochs",
            "dataset_size", "events", "privacy_unit", "users", "row_epsilon", "rows_per_person", "user_epsilon",
            "participations", "prefix_rmse", "dp_sgd_prefix_rmse_same_epsilon", "driver_noise_epsilon",
            "driver_noise_epsilon_label", "driver_noise_epsilon_rdp", "shards")),
        ("final_clip_norm", _N, "adapted by noisy counts only"),
        ("stopped_early", _N, "decided by the released test figures only"),
        ("reservation_id", _M, _OPERATION),
        ("shard_outages", _M, _OPERATION),
        ("wall_seconds", _M, "the last start's training time, over all its steps"),
        ("samples_per_second", _M, "steps times the expected batch size over wall_seconds"),
        *((key, _M, "a mean over every step of the last start: one example moves it by its own compute time "
                    "over the steps, far below the timing jitter") for key in (
            "driver_seconds_per_step", "worker_seconds_per_step", "wait_seconds_per_step")),
        ("membership_inference_non_private", _O, "--non-private-mia asked for it"),
        ("dataset_remaining_epsilon", _M, "the ledger's budget after the run"),
        ("driver_bytes_per_step", _P, "counts the sample's indices: the realised batch sizes"),
    )),
    *(Field("checkpoint", key, kind, why) for key, kind, why in (
        ("version", _M, "the file format"), ("binding", _M, "the config, the data's identity, N, the reservation"),
        ("run_id", _M, "a random name"), ("step", _M, _PLAN), ("events", _M, _PLAN),
        ("metrics", _N, "the rows of metrics.jsonl"), ("charged_blocks", _M, _PLAN),
        ("clip_norm", _N, "adapted by noisy counts only"), ("shard_outages", _M, _OPERATION),
        ("noise_multiplier", _M, _PLAN),
        ("module_folder", _M, "the folder on the driver that the model's module was imported from"),
        *((key, _N, "a function of the noisy updates (a released model's state)") for key in (
            "model", "optimizer", "lr_scheduler", "ema_weights", "optimizer_slices")),
        ("step_times", _P, "timings of the steps between two checkpoints track their batch sizes"),
        ("wall_seconds", _P, "the time between two checkpoints tracks their batch sizes"),
    )),
    *(Field("model card", key, _M if key != "test_metrics" else _N, "the export's guarantee and how to load it")
      for key in ("format", "dpfleet_version", "weights", "model", "dataset", "privacy", "test_metrics",
                  "warnings")),
    *(Field("export folder", name, kind, why) for name, kind, why in (
        ("model.safetensors", _N, "the released model (its moving average with ema_decay), merged or fully "
                                  "fine-tuned: every tensor of it and nothing else"),
        ("adapter_model.safetensors", _N, "the released LoRA factors and a classifier's new head, nothing of the "
                                          "frozen base or of the checkpoint"),
        ("config.json", _C, "the pretrained model's configuration from its folder, with the task's head"),
        ("generation_config.json", _C, "the pretrained model's generation defaults from its folder"),
        ("adapter_config.json", _C, "the config's adapter table and the pretrained model's folder"),
        ("model-card.json", _M, "the model card, whose keys are declared as the model card's"),
        *((name, _C, "the tokenizer of the pretrained model's folder, as it was given") for name in (
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
            "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
            "chat_template.jinja", "chat_template.json")),
    )),
    Field("generated text", "text", _N, "post-processing of the released model: the tokens it sampled after the "
                                        "user's prompt"),
    *(Field("audit.json", key, _N if key in ("test_accuracy",) else _M,
            "the canaries' scores: the released model on made-up examples, and the plan") for key in (
        "epsilon_lower", "epsilon_upper", "confidence", "delta", "canaries", "guesses", "correct", "guesses_in",
        "guesses_out", "guess_counts_tried", "mode", "rows_per_canary", "privacy_unit", "statistic",
        "epsilon_upper_person", "epsilon_upper_person_accountant", "verdict", "canary_membership", "membership",
        "test_accuracy", "steps", "sampling_rate", "noise_multiplier", "clip_norm", "run_dir", "scores_png")),
    *(Field("ledger", key, _M, why) for key, why in (
        ("fits", "the job's plan of events, asked about before Ray loads (nothing is held), " + _PLAN),
        ("reserve", "the job's plan of events, " + _PLAN),
        ("enqueue", "the job's plan of events and priority, " + _PLAN),
        ("register_plan", "the plan of events of each job of a pre-registered plan, fixed before any runs, "
                          + _PLAN),
        ("commit", "a block of the plan, sent on a clock fixed before the first step (orchestrator/charge_clock.py)"),
        ("release", "the job's end: the steps that did not run"),
        ("bind_content", "the SHA-256 of each training file, which names the files, not a row: the ledger gives "
                         "one budget to the same files under any dataset name"),
    )),
)

# Ray records each actor call's start and end (its state API, the dashboard's timeline) for anyone with access to the
# cluster, other jobs included; a step's calls take time that tracks their batch sizes, so the actors on a step's
# path are started with these options, and Ray records none of their calls.
UNRECORDED_BY_RAY = {"enable_task_events": False}

_LINES = {declared.name: declared for declared in LINES}
_observers: list[list[tuple[str, str]]] = []
_observers_lock = threading.Lock()


def _seen(artifact: str, name: str) -> None:
    with _observers_lock:
        for seen in _observers:
            seen.append((artifact, name))


@contextmanager
def observe() -> Iterator[list[tuple[str, str]]]:
    """Within this block, every released output as (artifact, name): ("log", line name) or (artifact, key)."""
    seen: list[tuple[str, str]] = []
    with _observers_lock:
        _observers.append(seen)
    try:
        yield seen
    finally:
        with _observers_lock:
            _observers.remove(seen)


def _may_leave(kind: Kind, what: str, shown: bool) -> None:
    if kind is Kind.PRIVATE:
        raise UndeclaredOutput(f"{what} is run-private and is never written or printed")
    if kind is Kind.OWNER and not shown:
        raise UndeclaredOutput(f"{what} is an owner-only diagnostic: it leaves only behind the flag that shows it")


def line(name: str, *, shown: bool = False, **fields) -> str:
    """The log line `name`, declared in LINES, with its fields filled in; `shown` when its owner's flag was given."""
    declared = _LINES.get(name)
    if declared is None or declared.source != "run":
        raise UndeclaredOutput(f"the log line {name!r} is not declared in orchestrator/release.py")
    _may_leave(declared.kind, f"the log line {name!r}", shown)
    _seen("log", name)
    return declared.template.format(**fields)


def field(artifact: str, key: str) -> Field | None:
    """The declaration of `key` in `artifact`, or None."""
    return next((declared for declared in FIELDS if declared.artifact == artifact and declared.covers(key)), None)


def record(artifact: str, values: Mapping, *, shown: frozenset[str] | set[str] = frozenset()) -> Mapping:
    """`values`, unchanged, once every key is declared for `artifact` and may leave (`shown`: the owner-only keys
    whose flags were given)."""
    for key in values:
        declared = field(artifact, key)
        if declared is None:
            raise UndeclaredOutput(f"{artifact} key {key!r} is not declared in orchestrator/release.py")
        _may_leave(declared.kind, f"{artifact} key {key!r}", key in shown)
        _seen(artifact, key)
    return values


def sent(artifact: str, key: str) -> None:
    """Declare that message `key` goes to `artifact` (the ledger) now; its contents are the proto's."""
    record(artifact, {key: None})


def matching_line(text: str) -> Line | None:
    """The declared line that printed `text`, or None."""
    return next((declared for declared in LINES if declared.pattern().match(text)), None)


def undeclared_lines(text: str) -> list[str]:
    """The lines of `text` (a run's output) that match no declared line."""
    return [printed for printed in text.splitlines() if printed.strip() and matching_line(printed) is None]


def declaration_table() -> str:
    """docs/threat-model.md's table of outputs: every declared line and field with its class."""
    rows = ["| output | what | class | why it may leave (or not) |", "|---|---|---|---|"]
    for declared in LINES:
        where = "log" if declared.source == "run" else f"log ({declared.source})"
        rows.append(f"| {where} | `{declared.name}` | {declared.kind.value} | {declared.why} |")
    for declared in FIELDS:
        rows.append(f"| {declared.artifact} | `{declared.key}` | {declared.kind.value} | {declared.why} |")
    return "\n".join(rows)
