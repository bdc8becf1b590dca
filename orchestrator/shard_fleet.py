"""The workers of a sharded run: placed on their shards' nodes, replaced when lost, waited for or skipped.

Each (shard, worker) slot holds one `ShardWorker` actor with the shard's Ray
custom resources, so it can only run where the shard's data lives. An actor
that dies (its process, or its whole node) is replaced at once by a new actor
with the same resources; Ray places the replacement when a node with those
resources is there again. Until then the slot is lost, and the policy decides:
"wait" holds the step (up to shard_timeout), "skip" runs it without the shard.
A step's calls go through `orchestrator.aggregation`: the sums of a node's
workers are added on that node, so the driver receives one buffer per node.
With secure_aggregation each silo's one worker sends its masked sum to the
driver itself (``orchestrator.secure_aggregation``), and a silo lost during a
step counts as zero for that step under either policy.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import ray

from orchestrator import release
from orchestrator.aggregation import Gathered, NodeAggregation
from orchestrator.config import planned_batch_steps
from orchestrator.errors import ShardTimeoutError
from orchestrator.secure_aggregation import SecureAggregation
from workers.clipping import LayerClipNorms
from workers.keys import ORDER, SecretKey
from workers.sampling import SiloFixedOrder
from workers.secure_aggregation import deviating_coalition, parse_identity, registry_digest
from workers.shard_worker import ShardWorkerActor

Slot = tuple[int, int]  # (shard index, worker index within the shard)
POLL_SECONDS = 0.5
# How often a slot's new actor may fail to start on a node that has its resources before the error is raised.
FAILED_STARTS = 3
# How long closing waits for the workers to delete their windows' folders.
RELEASE_SECONDS = 30.0


class ShardFleet:
    """One ShardWorker actor per (shard, worker) of `config.shards`, and what to do when one is lost.

    `say` prints a line of the run's log; `actor` is the workers' Ray class
    (on the collective path, a shard's collective rank).
    """

    def __init__(self, config, say: Callable[[str], None], actor=ShardWorkerActor):
        self.config, self.say, self.actor = config, say, actor
        self.slots: list[Slot] = [(shard, worker) for shard, spec in enumerate(config.shards)
                                  for worker in range(spec.workers)]
        self.actors: dict[Slot, ray.actor.ActorHandle] = {}
        # A slot's readiness probe while its actor is not known to be up (example_count() of a new actor).
        self.probes: dict[Slot, ray.ObjectRef] = {}
        self.example_counts: dict[Slot, int] = {}
        self.sampling_rate: float | None = None
        self.total_steps: int | None = None
        # Under fixed-order participation: the driver's key each slot's order derives from, and s.
        self.order_key: SecretKey | None = None
        self.steps_per_epoch: int | None = None
        # The node each present slot's actor runs on, and the per-node reducers of the step's calls.
        self.nodes: dict[Slot, str] = {}
        self.aggregation: NodeAggregation | None = None
        self.secure: SecureAggregation | None = None
        # The shards' data identity, each silo's taken on its own node when the fleet starts (a run's binding).
        self.dataset_identity: dict | None = None

    # --- placement -----------------------------------------------------------

    def start(self) -> int:
        """Place every slot's actor and return N, the sum of the example counts the workers report.

        A shard whose resources are missing from the cluster for
        shard_timeout seconds is an error naming them.
        """
        for slot in self.slots:
            self._place(slot)
        missing = self._wait_for_placement()
        if missing:
            raise ShardTimeoutError(
                f"{self._describe(missing)} could not be placed within shard_timeout = "
                f"{self.config.shard_timeout:g} s; start a Ray node with those resources "
                "(ray start --address ... --resources ...) and try again"
            )
        for shard, spec in enumerate(self.config.shards):
            held = sum(self.example_counts[(shard, worker)] for worker in range(spec.workers))
            self.say(release.line("shard_start", shard=shard, dataset=spec.dataset, part=spec.part, parts=spec.parts,
                                  resources=dict(spec.resources), workers=spec.workers, examples=held))
        # Each silo reads its own files; the driver receives only their digests.
        identities = ray.get([self.actors[(shard, 0)].fingerprint.remote()
                              for shard in range(len(self.config.shards))])
        self.dataset_identity = {"source": [spec.dataset for spec in self.config.shards],
                                 **{f"shard {shard}": identity for shard, identity in enumerate(identities)}}
        dataset_size, config = sum(self.example_counts.values()), self.config
        if config.secure_aggregation:
            clip_bound = config.layer_clip_norms.total_norm if config.layer_clip_norms else config.clip_norm
            registry = silo_registry(config.shards)
            self.secure = SecureAggregation(len(config.shards), config.mask_share_threshold, clip_bound,
                                            dataset_size, registry)
            silos, threshold = len(config.shards), config.mask_share_threshold
            self.say(release.line("secure_aggregation", detail=(
                f"{silos} silos, threshold {threshold}: a step survives up to "
                f"{silos - threshold} dropouts; a driver that follows the protocol learns only the total of each "
                f"step's survivors while it colludes with up to {threshold - 1} silos, one that deviates from it "
                f"while it colludes with up to {deviating_coalition(silos, threshold)}; fixed point on Z_2^64 at "
                f"scale 2^{int(np.log2(self.secure.scale))} "
                f"(sums up to {self.secure.value_bound:g} per coordinate)")))
            self.say(release.line("secure_aggregation", detail=(
                f"round keys signed by the silos' registered identities (registry sha256 "
                f"{registry_digest(registry)})" if registry is not None else
                "no silo identities registered: the silos trust the driver to relay their "
                "round keys unchanged (give each shard `identity` and `identity_key_file`, docs/silos.md)")))
        return dataset_size

    def set_sampling_rate(self, sampling_rate: float, total_steps: int, order_key: SecretKey | None = None,
                          steps_per_epoch: int | None = None) -> None:
        """Tell every worker, and every later replacement, the common rate q and the run's steps.

        With `order_key` (a correlated mechanism's fixed-order participation)
        each worker takes its examples in a fixed order instead, one slice of
        its `steps_per_epoch` a step (`workers.sampling.SiloFixedOrder`): the
        order derives from PRF(order_key, "order", shard, worker), so a
        replacement takes the same examples at the same steps and no example
        takes part twice in an epoch. A worker of a Parquet shard starts
        gathering its first window then.
        """
        self.sampling_rate, self.total_steps = sampling_rate, total_steps
        self.order_key, self.steps_per_epoch = order_key, steps_per_epoch
        ray.get([self._set_sampling(slot) for slot in self.present()])

    def _set_sampling(self, slot: Slot) -> ray.ObjectRef:
        """Send `slot`'s actor the run's sampling: q, the steps and, under fixed order, its own order."""
        actor = self.actors[slot]
        if self.order_key is None:
            return actor.set_sampling_rate.remote(self.sampling_rate, self.total_steps)
        fixed_order = SiloFixedOrder(self.order_key.derive(ORDER, *slot), self.steps_per_epoch)
        return actor.set_sampling_rate.remote(self.sampling_rate, self.total_steps, fixed_order)

    def _place(self, slot: Slot) -> None:
        """Start a (new) actor for `slot` on its shard's resources; it is lost until its probe answers."""
        config = self.config
        shard, worker = slot
        spec = config.shards[shard]
        # No restarts by Ray: a lost actor is replaced here, where the policy decides what the step does meanwhile.
        actor = self.actor.options(
            **release.UNRECORDED_BY_RAY, num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker,
            resources=dict(spec.resources), max_restarts=0,
        ).remote(
            spec, shard, worker, config.seed, config.model_spec, config.max_physical_batch,
            threads=config.cpus_per_worker, data_root=config.data_root, engine=config.engine, loss=config.loss,
            train_transforms=config.train_transforms, augmentations_per_example=config.augmentations_per_example,
            plan_ahead_steps=planned_batch_steps(config),
        )
        self.actors[slot] = actor
        if self.sampling_rate is not None:
            # Calls from one caller run in order on an actor: this lands before the step that follows.
            self._set_sampling(slot)
        self.probes[slot] = actor.example_count.remote()

    def _wait_for_placement(self) -> set[Slot]:
        """Wait until every lost slot's actor answers; return the slots still lost after shard_timeout.

        The clock runs only while some lost slot's resources are missing
        from the cluster: once a node with them is there, the new actor is
        placed and is only starting (loading its data), which is waited out.
        """
        missing_seconds = 0.0
        failed_starts: dict[Slot, int] = {}
        while self.probes:
            before = time.monotonic()
            ready, _ = ray.wait(list(self.probes.values()), num_returns=len(self.probes), timeout=POLL_SECONDS)
            self._collect(ready, failed_starts)
            if self.probes and not self._placeable(self.probes):
                missing_seconds += time.monotonic() - before
                if missing_seconds >= self.config.shard_timeout:
                    break
        return set(self.probes)

    def _placeable(self, slots) -> bool:
        """Whether the cluster has, in total, what each of `slots` needs (its shard's resources and CPUs, GPUs)."""
        cluster = ray.cluster_resources()
        for shard, _ in slots:
            needs = {**self.config.shards[shard].resources, "CPU": self.config.cpus_per_worker}
            if self.config.gpus_per_worker:
                needs["GPU"] = self.config.gpus_per_worker
            if any(cluster.get(name, 0.0) < amount for name, amount in needs.items()):
                return False
        return True

    def _collect(self, ready: list[ray.ObjectRef], failed_starts: dict[Slot, int]) -> None:
        """Mark the slots whose probe answered as present; a probe that failed places the slot again.

        A new actor that keeps failing where its resources are (its data will
        not load, say) raises its error after FAILED_STARTS tries.
        """
        for slot, probe in list(self.probes.items()):
            if probe not in ready:
                continue
            try:
                count = ray.get(probe)
            except ray.exceptions.RayActorError:
                if self._placeable([slot]):
                    failed_starts[slot] = failed_starts.get(slot, 0) + 1
                    if failed_starts[slot] >= FAILED_STARTS:
                        raise
                self._place(slot)
                continue
            known = self.example_counts.setdefault(slot, count)
            if count != known:
                raise RuntimeError(
                    f"{self._describe({slot})} now holds {count} examples, not the {known} it held when the run "
                    "started; N and so q would change: restore the shard's data and resume"
                )
            try:
                self.nodes[slot] = ray.get(self.actors[slot].node_id.remote())
            except ray.exceptions.RayActorError:
                self._place(slot)
                continue
            del self.probes[slot]

    def present(self) -> list[Slot]:
        """The slots whose actor is up, in slot order."""
        return [slot for slot in self.slots if slot not in self.probes]

    def present_actors(self) -> list[ray.actor.ActorHandle]:
        """The actors that are up, for evaluation and reports."""
        return [self.actors[slot] for slot in self.present()]

    def close(self) -> None:
        """Stop every actor (placed or still waiting for its node), freeing the silos' CPUs for the next run."""
        if self.aggregation is not None:
            self.aggregation.close()
        # A Parquet shard's worker deletes its windows' folders first (one still waiting for its node has none).
        releases = [self.actors[slot].release.remote() for slot in self.present()]
        ray.wait(releases, num_returns=len(releases), timeout=RELEASE_SECONDS)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        self.probes.clear()

    # --- a step ------------------------------------------------------------

    def wait_for_all(self, step: int) -> None:
        """Before a ledger charge in "wait" mode: make sure every shard is up, else stop (ShardTimeoutError)."""
        self._find_lost(self.present(), step)
        self._wait_or_stop(step)

    def clipped_sums(
        self, weights: ray.ObjectRef, step: int, clip_norm: float | LayerClipNorms, noise_multiplier: float = 0.0
    ) -> tuple[Gathered, list[Slot]]:
        """The present workers' clipped sums for step `step` (0-based), one per node, and the slots that had none.

        With the noise in the silos, `noise_multiplier` is the step's σ, of
        which each silo adds its share before masking.

        Every sum is followed by its raw count of examples left out for a
        non-finite gradient. A node whose sum failed has each of its workers
        checked: one that answers is called again on its own; one that is lost
        is handled by the policy. "wait": a worker lost during the step is
        replaced and its sum recomputed (with a seed, from the same sample);
        the step ends in ShardTimeoutError when the replacement cannot be
        placed within shard_timeout. "skip": lost workers take no part, and
        a replacement that is up by the next step rejoins then.
        """
        waiting = self.config.on_shard_loss == "wait"
        if self.probes:
            if waiting:
                self._wait_or_stop(step)
            else:
                self._rejoin(step)
        if self.aggregation is None:
            self.aggregation = NodeAggregation()
        if self.secure is not None:
            return self._secure_sum(weights, step, clip_norm, noise_multiplier), sorted(self.probes)
        gathered = Gathered()
        pending, one_by_one = self.present(), False
        while pending:
            present = {slot: self.actors[slot] for slot in self.present()}
            if not one_by_one:
                self.aggregation.place(present, self.nodes)
            calls = {slot: (step, clip_norm) for slot in pending}
            # Recomputed parts go to their workers one by one: a node's new reducer would take longer to start.
            result = self.aggregation.gather(self.aggregation.run(present, self.nodes, "sampled_clipped_grad_sum",
                                                                  weights, calls, {}, direct=one_by_one))
            gathered.add(result)
            self.aggregation.forget(result.failed)
            lost = self._find_lost(result.failed, step)
            pending, one_by_one = [slot for slot in result.failed if slot not in lost], True
            if lost and waiting:
                self._wait_or_stop(step)
                self.say(release.line("shard_recompute", step=step + 1, slots=self._describe(lost)))
                pending = sorted(result.failed)
        return gathered, sorted(self.probes)

    def _secure_sum(self, weights: ray.ObjectRef, step: int, clip_norm: float | LayerClipNorms,
                    noise_multiplier: float) -> Gathered:
        """The unmasked float64 sum of the silos that answered step `step`, as the one part of a Gathered.

        The silos that are up run the step's keying round first. A silo lost
        during the step (or the keying) is handled by the policy and its sum
        counts as zero for this step.
        """
        present = {slot: self.actors[slot] for slot in self.present()}
        while set(present) != set(self.secure.keyed):
            try:
                self.secure.key(present, step)
            except ray.exceptions.RayActorError:
                lost = self._find_lost(list(present), step)
                present = {slot: actor for slot, actor in present.items() if slot not in lost}
        share = self.secure.noise_share_variance(noise_multiplier)
        result = self.aggregation.gather(self.aggregation.run(present, self.nodes, "masked_clipped_grad_sum",
                                                              weights,
                                                              {slot: (step, clip_norm, share) for slot in present},
                                                              {}, direct=True))
        dropped = sorted(result.failed)
        lost = self._find_lost(dropped, step)
        if set(dropped) - lost:
            raise RuntimeError(f"{self._describe(set(dropped) - lost)} failed step {step + 1} but still answers: "
                               "its masked sum is missing; see the worker's log")
        if dropped:
            self.say(release.line("shard_unmasked_without", step=step + 1, slots=self._describe(set(dropped))))
        total = self.secure.total(result.parts, step)
        return Gathered([total], [], result.slowest_worker_seconds, result.wait_seconds, result.values_in,
                        result.bytes_in)

    def _find_lost(self, slots: list[Slot], step: int) -> set[Slot]:
        """Which of `slots` are lost: their actor does not answer; each is handled by the policy (`_lost`)."""
        pings = {slot: self.actors[slot].ping.remote() for slot in slots}
        lost = set()
        for slot, ping in pings.items():
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError:
                self._lost(slot, step)
                lost.add(slot)
        return lost

    def _lost(self, slot: Slot, step: int) -> None:
        policy = self.config.on_shard_loss
        then = (f"waiting up to shard_timeout = {self.config.shard_timeout:g} s for a replacement" if policy == "wait"
                else "steps run without it until a replacement is up")
        self.say(release.line("shard_lost", step=step + 1, slots=self._describe({slot}), then=then,
                              policy=repr(policy)))
        self._place(slot)

    def _wait_or_stop(self, step: int) -> None:
        lost = set(self.probes)
        if not lost:
            return
        missing = self._wait_for_placement()
        if missing:
            raise ShardTimeoutError(f"{self._describe(missing)} could not be placed again within shard_timeout = "
                                    f"{self.config.shard_timeout:g} s")
        self.say(release.line("shard_placed_again", step=step + 1, slots=self._describe(lost)))

    def _rejoin(self, step: int) -> None:
        lost = set(self.probes)
        ready, _ = ray.wait(list(self.probes.values()), num_returns=len(self.probes), timeout=0)
        self._collect(ready, {})
        back = lost - set(self.probes)
        if back:
            self.say(release.line("shard_back", step=step + 1, slots=self._describe(back)))

    def _describe(self, slots: set[Slot]) -> str:
        """A log phrase naming the slots' shards, workers and resources."""
        names = []
        for shard, worker in sorted(slots):
            spec = self.config.shards[shard]
            names.append(f"shard {shard} ({dict(spec.resources)})" if spec.workers == 1
                         else f"shard {shard} worker {worker} of {spec.workers} ({dict(spec.resources)})")
        return ", ".join(names)


def extend_outages(outages: list[dict], step: int, missing: list[Slot], shards) -> None:
    """Extend each missing (shard, worker) slot's outage in `outages` to step `step` (0-based).

    An outage names the shard, the worker within it (of the shard's
    `workers`: with several, the others' examples still took part) and
    1-based steps, inclusive. `shards` is the config's shard list.
    """
    for shard, worker in missing:
        open_outage = next((outage for outage in reversed(outages)
                            if (outage["shard"], outage["worker"]) == (shard, worker)), None)
        if open_outage is not None and open_outage["last_step"] == step:
            open_outage["last_step"] = step + 1
        else:
            spec = shards[shard]
            outages.append({"shard": shard, "worker": worker, "workers": spec.workers,
                            "resources": dict(spec.resources), "first_step": step + 1, "last_step": step + 1})


def silo_registry(shards) -> tuple[bytes, ...] | None:
    """The silos' Ed25519 public identities in shard order (`ShardSpec.identity`), or None when none has one."""
    identities = [shard.identity for shard in shards]
    return None if identities[0] is None else tuple(parse_identity(identity) for identity in identities)
