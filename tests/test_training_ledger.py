"""Training charges the ledger: reserve before the first step, charge before compute, survive outages and crashes."""

import io
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from scipy.stats import spearmanr

from accounting.events import SampledGaussian
from accounting.ledger.admission import AdmissionRule, RdpTally, fits_budget
from accounting.ledger.client import RemoteLedger
from accounting.ledger.store import open_embedded_ledger
from orchestrator.cli import main
from orchestrator.charge_clock import ChargeClock
from orchestrator.checkpoint import checkpoint_files, checkpoint_step
from orchestrator.config import build_config
from orchestrator.errors import LedgerTimeoutError
from orchestrator.trainer import Trainer
from servers import DPFLEET, REPOSITORY, TINY_JOB, free_port, start_serve_process, tiny_job_epsilon

ADMIN_TOKEN = "admin-token-for-training-tests-0123"


def write_config(tmp_path, extra, name="job.toml"):
    path = tmp_path / name
    path.write_text(TINY_JOB + extra)
    return str(path)


def test_embedded_ledger_charges_exactly_what_dpfleet_eps_reports(local_ray, worker_pool, tmp_path, capsys):
    config = write_config(tmp_path, f'steps = 25\nrun_dir = "{tmp_path / "run"}"\nseed = 1\n')
    assert main(["train", "--config", config, "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eps", "--dataset-size", "600", "--batch-size", "30", "--noise-multiplier", "1.0",
                 "--steps", "25", "--delta", "1e-5", "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)["epsilon"]
    with open_embedded_ledger() as ledger:
        status = ledger.get_budget("mnist")
        (job,) = ledger.list_jobs()
    assert status.spent_epsilon == pytest.approx(reported, rel=1e-9) == pytest.approx(summary["epsilon"], rel=1e-9)
    assert job.state == "released" and job.committed_steps == 25
    assert summary["dataset_remaining_epsilon"] == pytest.approx(status.remaining_epsilon)


def test_a_job_that_does_not_fit_is_refused_before_it_trains(tmp_path, capsys):
    run_dir = tmp_path / "refused"
    config = write_config(tmp_path, f'steps = 500\ndataset_budget_epsilon = 1.0\nrun_dir = "{run_dir}"\n')
    assert main(["train", "--config", config, "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert "left at δ=1e-05" in err and "this job needs ε" in err
    assert not (run_dir / "metrics.jsonl").exists()


def test_two_jobs_on_one_dataset_compose_below_the_sum_of_their_epsilons(local_ray, worker_pool, tmp_path, capsys):
    starts = []
    for name in ("first", "second"):
        config = write_config(tmp_path, f'steps = 20\nrun_dir = "{tmp_path / name}"\n', f"{name}.toml")
        assert main(["train", "--config", config, "--no-progress"]) == 0
        starts += [line for line in capsys.readouterr().out.splitlines() if line.startswith("ledger: reserved")]
    with open_embedded_ledger() as ledger:
        status = ledger.get_budget("mnist")
        first_job, second_job = ledger.list_jobs("mnist", charges=True)
    assert status.spent_epsilon < 2 * tiny_job_epsilon(20)
    assert status.spent_epsilon == pytest.approx(tiny_job_epsilon(40), rel=1e-6)
    # The first job takes the RDP-to-(ε, δ) conversion's offset from the budget (default ε 10) with its own steps;
    # the second, of the same plan, only what its divergence adds: less than the offset alone.
    rule = AdmissionRule.for_budget(10.0, 1e-5)
    plan = RdpTally.of(SampledGaussian(30 / 600, 1.0, 20))
    first, second = rule.epsilon(plan), rule.epsilon(plan + plan) - rule.epsilon(plan)
    assert second < rule.epsilon(RdpTally.of(SampledGaussian(30 / 600, 1.0, 1))) < first
    own = f"its own privacy: ε {tiny_job_epsilon(20):.3g} (pld, δ 1e-05)"
    assert (f"; this job takes ε {first:.3g} of the budget (remaining 10 → {10 - first:.3g}); {own}"
            in starts[0]), starts
    assert (f"; this job takes ε {second:.3g} of the budget (remaining {10 - first:.3g} → {10 - first - second:.3g});"
            f" {own}" in starts[1]), starts
    assert [job.charges[0].charged_epsilon for job in (first_job, second_job)] == pytest.approx([first, second])
    assert first + second == pytest.approx(status.spent_epsilon_filter)


@pytest.fixture
def ledger_server(tmp_path):
    """A real `dpfleet ledger serve` on a fixed loopback port, with tenant 'acme' owning dataset 'digits'."""
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN)
    port = free_port()
    db_path = tmp_path / "ledger.db"
    process, address = start_serve_process(db_path, token_file, port)
    with RemoteLedger(address, ADMIN_TOKEN) as admin:
        token = admin.create_tenant("acme").token
    with RemoteLedger(address, token) as acme:
        acme.create_dataset("digits", 50.0, 1e-5)
    server = {"process": process, "address": address, "token": token, "db": db_path, "token_file": token_file,
              "port": port}
    yield server
    server["process"].terminate()
    server["process"].wait(timeout=30)


def start_training(tmp_path, ray_address, extra, *flags, log=None):
    """`dpfleet train` in a process of its own; its output goes to a pipe, or to the open file `log`.

    It joins the Ray at `ray_address` (the module's) rather than start one. A pipe nobody reads fills up and stalls
    the run: tests that do not read the output pass a log file.
    """
    return subprocess.Popen(
        [*DPFLEET, "train", "--config", write_config(tmp_path, extra), "--no-progress", *flags],
        cwd=REPOSITORY, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_ADDRESS": ray_address},
    )


def wait_for_line(process, fragment, timeout=180):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if fragment in line:
            return seen
    pytest.fail(f"never saw {fragment!r}; output: {''.join(seen)[-3000:]}")


def test_a_ledger_outage_pauses_training_which_then_completes(local_ray, tmp_path, ledger_server):
    run_dir = tmp_path / "outage"
    training = start_training(
        tmp_path, local_ray, f'steps = 100\ncommit_every = 5\ncommit_interval = 1\ndataset_name = "digits"\n'
        f'run_dir = "{run_dir}"\nledger = "{ledger_server["address"]}"\nledger_timeout = 120\n', "--token",
        ledger_server["token"],
    )
    # 20 steps an epoch, a block of 5 steps a second: after epoch 1, most of the 20 charges remain to fall into the
    # outage.
    wait_for_line(training, "epoch 1:")
    ledger_server["process"].send_signal(signal.SIGKILL)
    ledger_server["process"].wait(timeout=30)
    time.sleep(5.0)
    ledger_server["process"], _ = start_serve_process(ledger_server["db"], ledger_server["token_file"],
                                                      ledger_server["port"])
    output, _ = training.communicate(timeout=600)
    assert training.returncode == 0, output[-3000:]
    assert "ledger unreachable" in output and "ledger reachable again" in output
    with RemoteLedger(ledger_server["address"], ledger_server["token"]) as acme:
        (job,) = acme.list_jobs()
        assert job.committed_steps == 100 and job.state == "released"
        assert acme.get_budget("digits").spent_epsilon == pytest.approx(tiny_job_epsilon(100), rel=1e-9)


def test_kill_9_of_the_driver_then_resume_charges_every_step_once(local_ray, tmp_path, ledger_server):
    run_dir = tmp_path / "crash"
    extra = (f'steps = 80\ncommit_every = 10\ncheckpoint_every = 10\ndataset_name = "digits"\nrun_dir = "{run_dir}"\n'
             f'ledger = "{ledger_server["address"]}"\nseed = 3\n')
    log_path = tmp_path / "crash.log"
    with open(log_path, "w") as log:
        training = start_training(tmp_path, local_ray, extra, "--token", ledger_server["token"], log=log)
        deadline = time.monotonic() + 300
        while not any(checkpoint_step(path) >= 30 for path in checkpoint_files(run_dir)):
            assert training.poll() is None and time.monotonic() < deadline, (
                "training ended or stalled before it could be killed: " + log_path.read_text()[-3000:])
            time.sleep(0.2)
        training.send_signal(signal.SIGKILL)
        training.wait(timeout=30)
    with RemoteLedger(ledger_server["address"], ledger_server["token"]) as acme:
        (job,) = acme.list_jobs()
    last_checkpoint_step = checkpoint_step(checkpoint_files(run_dir)[-1])
    # Charged before compute: at least every step that ran; the charge clock may have charged blocks ahead.
    assert last_checkpoint_step <= job.committed_steps, (job, checkpoint_files(run_dir), log_path.read_text()[-3000:])
    resumed = subprocess.run(
        [*DPFLEET, "train", "--resume", str(run_dir), "--no-progress", "--json", "--token", ledger_server["token"]],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": local_ray},
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 80 and summary["reservation_id"] == job.reservation_id
    with RemoteLedger(ledger_server["address"], ledger_server["token"]) as acme:
        jobs = acme.list_jobs()
        spent = acme.get_budget("digits").spent_epsilon
    assert len(jobs) == 1 and jobs[0].committed_steps == 80
    assert tiny_job_epsilon(80) - 1e-9 <= spent <= tiny_job_epsilon(80 + 10) + 1e-9


def test_the_charge_clock_charges_on_its_own_schedule_and_hands_a_failed_charge_to_the_steps():
    class FailsAtBlock2(CommitTimes):
        def charge(self, sequence, events):
            if sequence == 2:
                raise LedgerTimeoutError("the ledger stayed unreachable")
            super().charge(sequence, events)

    blocks = [(sequence, SampledGaussian(0.05, 1.0, 5)) for sequence in range(1, 5)]
    ledger = FailsAtBlock2()
    offsets = [0.01 * tick for tick in range(4)]
    clock = ChargeClock(ledger, blocks, offsets).start()
    clock.wait_for(1)
    with pytest.raises(LedgerTimeoutError, match="stayed unreachable"):
        clock.wait_for(3)
    assert [sequence for sequence, _ in ledger.charges] == [1]  # nothing after the failed block
    ahead = CommitTimes()
    clock = ChargeClock(ahead, blocks, offsets).start()
    clock.wait_for(4)  # no step waited for blocks 1 to 3: the clock charged them anyway, in order
    assert [sequence for sequence, _ in ahead.charges] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="block 0 is not on this clock"):
        clock.wait_for(0)


class BatchTimedTrainer(Trainer):
    """A trainer whose steps take longer the more examples they hold, as a step's compute does, only more so."""

    def _draw_sample(self, step):
        sample = super()._draw_sample(step)
        self.realised_sizes = {**getattr(self, "realised_sizes", {}), step: len(sample[0])}
        return sample

    def _step(self, workers):
        super()._step(workers)
        # About 30 ± 5 examples a step: 0 to 1.2 s more, far above what a loaded machine adds to a step at random.
        time.sleep(0.08 * max(0, self.realised_sizes[self.step - 1] - 25))


class CommitTimes:
    """A ledger session that notes when each block is charged."""

    reservation_id = "commit-times"

    def __init__(self):
        self.charges = []

    def charge(self, sequence, events):
        self.charges.append((sequence, time.monotonic()))


def test_commit_times_do_not_follow_the_realised_batch_sizes(local_ray, worker_pool, tmp_path):
    # Charged when the steps reach each block, the gaps between commits are the steps' times: rho 0.84 here.
    config = build_config({"dataset": "mnist", "model": "gdp_cnn", "workers": 1, "batch_size": 30,
                           "train_subset": 600, "test_subset": 100, "steps": 30, "noise_multiplier": 1.0,
                           "seed": 4, "commit_every": 1, "commit_interval": 0.1, "run_dir": str(tmp_path / "run")})
    trainer = BatchTimedTrainer(config, show_progress=False, out=io.StringIO())
    trainer.ledger = CommitTimes()
    trainer.run()
    sequences, times = zip(*trainer.ledger.charges)
    assert list(sequences) == list(range(30))
    gaps = np.diff(times)
    sizes = np.asarray([trainer.realised_sizes[step] for step in range(29)])
    assert sizes.std() > 0
    # By rank, as the steps that evaluate or checkpoint are slow whatever their size. Independent of the sizes,
    # |rho| exceeds 0.6 over 29 gaps with probability below 0.1%.
    assert abs(spearmanr(gaps, sizes).statistic) < 0.6, (gaps, sizes)


def test_train_with_non_private_mia_reports_the_membership_attack_labelled_not_private(local_ray, worker_pool, tmp_path,
                                                                                     capsys):
    config = write_config(tmp_path, f'steps = 10\nrun_dir = "{tmp_path / "mia"}"\ndelta = 0.01\n')
    assert main(["train", "--config", config, "--no-progress", "--non-private-mia", "--json"]) == 0
    out, err = capsys.readouterr()
    # With N known, a delta above 1/N is warned about before the run.
    assert "warning: delta 0.01 is above 1/N = 0.00167 for a dataset of 600 rows" in err
    attack = json.loads(out.strip().splitlines()[-1])["membership_inference_non_private"]
    assert 0.0 <= attack["auc"] <= 1.0 and 0.0 <= attack["tpr_at_1pct_fpr"] <= 1.0
    assert attack["members"] == 600 and attack["nonmembers"] == 1000


@pytest.mark.parametrize("old, new", [("--mia", "--non-private-mia"),
                                      ("--show-train-loss", "--non-private-train-loss")])
def test_the_old_names_of_non_private_outputs_are_refused_with_the_name_that_says_so(tmp_path, capsys, old, new):
    config = write_config(tmp_path, f'steps = 10\nrun_dir = "{tmp_path / "old"}"\n')
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--config", config, old])
    assert stopped.value.code == 2
    assert f"{old} reads training rows and prints what it finds, which is not private; it is now {new}" in (
        capsys.readouterr().err)
    assert not (tmp_path / "old").exists()


def test_a_job_that_waits_for_budget_trains_once_the_ledger_admits_it(local_ray, worker_pool, tmp_path, monkeypatch):
    step = SampledGaussian(30 / 600, 1.0, 1)  # TINY_JOB's step
    rule = AdmissionRule.for_budget(10.0, 1e-5)
    # The longest holder that leaves no room for 20 steps of the job, found by bisection over its steps.
    fits = lambda steps: fits_budget(rule.epsilon(RdpTally.of(step.with_steps(steps))), 10.0)  # noqa: E731
    low, high = 1, 1_000_000
    while high - low > 1:
        low, high = ((low + high) // 2, high) if fits((low + high) // 2) else (low, (low + high) // 2)
    with open_embedded_ledger() as ledger:
        ledger.create_dataset("mnist", 10.0, 1e-5)
        holder = ledger.reserve("mnist", "holder", step.with_steps(low - 10))
    config = write_config(tmp_path, f'steps = 20\nrun_dir = "{tmp_path / "waited"}"\n')
    said, say = [], Trainer.say
    monkeypatch.setattr(Trainer, "say", lambda trainer, text: (said.append(text), say(trainer, text)))
    with open_embedded_ledger() as ledger:
        releaser = threading.Timer(3.0, ledger.release, args=(holder.reservation_id,))
        releaser.start()
        assert main(["train", "--config", config, "--no-progress", "--wait-for-budget", "--max-wait", "600"]) == 0
        releaser.join()
        (job,) = [job for job in ledger.list_jobs("mnist") if job.job_id != "holder"]
        assert job.state == "released" and job.committed_steps == 20
        assert [entry.action for entry in ledger.history("mnist")][-4:-2] == ["release", "reserve"]
    assert said[0].startswith("ledger: waiting for budget on 'mnist' (q-") and "position 1, needs" in said[0]
    assert said[1].startswith("ledger: admitted after")


def test_ctrl_c_after_a_checkpoint_then_resume_charges_every_step_once_and_exports(local_ray, worker_pool, tmp_path,
                                                                                   capsys, monkeypatch):
    run_dir = tmp_path / "stopped"
    config = write_config(tmp_path, f'steps = 60\ncommit_every = 10\ncommit_interval = 1\ncheckpoint_every = 10\n'
                                    f'run_dir = "{run_dir}"\nseed = 3\n')
    save = Trainer._save_checkpoint

    def save_then_interrupt(trainer):
        save(trainer)
        if trainer.step == 10:
            raise KeyboardInterrupt  # Ctrl-C, once the checkpoint of step 10 is in place

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_save_checkpoint", save_then_interrupt)
        assert main(["train", "--config", config, "--no-progress"]) == 130
    assert "dpfleet train: interrupted" in capsys.readouterr().err
    with open_embedded_ledger() as ledger:
        (stopped,) = ledger.list_jobs()
    # The stop released the unrun steps and kept the charged ones: the blocks the steps reached, and any the charge
    # clock (a block a second) charged ahead of them.
    assert stopped.state == "released" and 10 <= stopped.committed_steps < 60, stopped
    assert main(["train", "--resume", str(run_dir), "--no-progress", "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert (f"ledger: reservation {stopped.reservation_id} was released with {stopped.committed_steps} of 60 steps "
            f"charged; reserved the other {60 - stopped.committed_steps} (reservation {summary['reservation_id']})"
            in out), out
    # The new reservation takes the rest's rise in the filter's ε over what the first one charged, not its offset.
    rule, step = AdmissionRule.for_budget(10.0, 1e-5), SampledGaussian(30 / 600, 1.0, 1)
    charged = rule.epsilon(RdpTally.of(step.with_steps(stopped.committed_steps)))
    rest = rule.epsilon(RdpTally.of(step.with_steps(60))) - charged
    assert (f"; they take ε {rest:.3g} of the budget (remaining {10 - charged:.3g} → {10 - charged - rest:.3g}); the "
            f"run's own privacy: ε {tiny_job_epsilon(60):.3g} (pld, δ 1e-05)") in out, out
    with open_embedded_ledger() as ledger:
        first, resumed = ledger.list_jobs()
        spent = ledger.get_budget("mnist").spent_epsilon
    assert first.reservation_id == stopped.reservation_id and first.committed_steps == stopped.committed_steps
    assert resumed.reservation_id == summary["reservation_id"]
    assert resumed.job_id.startswith(f"{stopped.job_id}.resumed-")
    # Every step charged once: the resumed run ran the charged steps after its checkpoint without charging them again.
    assert resumed.state == "released" and first.committed_steps + resumed.committed_steps == 60 == summary["steps"]
    assert summary["epsilon"] == pytest.approx(tiny_job_epsilon(60), rel=1e-9)
    # Within the charge clock's bound (a block ahead of the steps), and here exactly: no step was left charged unrun.
    assert summary["epsilon"] - 1e-9 <= spent <= tiny_job_epsilon(60 + 10)
    assert spent == pytest.approx(summary["epsilon"], rel=1e-6)
    weights = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(weights), "--json"]) == 0
    privacy = json.loads(capsys.readouterr().out.splitlines()[-1])["privacy"]
    assert privacy["finished"] is True and privacy["steps"] == 60 and privacy["epsilon"] == summary["epsilon"]
