"""The Hindsight trainer: one top-down PPO loop over samples leased from the policy server.

    HINDSIGHT_TRAIN_ADMIN_API_KEY=K hindsight-train --policy-url http://127.0.0.1:30000 --model-path DIR --out-dir runs/a --steps 100
    torchrun --nproc-per-node 2 -m trainer.cli --samples-file s.jsonl --model-path DIR --out-dir runs/b   # DDP (gloo on CPU)
    torchrun --nproc-per-node 2 -m trainer.cli ... --parallel fsdp2                                     # FSDP2 shards

Each step (docs/CONTRACTS.md "Trainer"):
  1. ``collect_leases``: rank 0 leases up to batch_size samples, waiting up to lease_wait_s for at least
     min_batch (holding partial leases meanwhile; nothing leased = no step), and broadcasts them.
  2. ``admit``: samples already trained (a re-leased duplicate), samples that break the contract and samples
     older than ``max_staleness`` weight versions are logged and trained with mask 0.
     A batch with no gradient (no sample carries a learning term in the mode, no trained token, or every
     advantage 0) is no step: no optimizer step, checkpoint or publish; its leases are acked at once and it is
     counted (``skipped_steps`` in metrics.jsonl, one line in skipped_steps.jsonl). Adam's state is untouched.
  3. ``update_policy``: one PPO update (trainer/update.py): advantages on the whole batch, old log-probs and
     rollout importance weights before any update (trainer/old_pass.py), process-reward shaping,
     ppo_epochs x minibatches optimizer steps of PPO-clip with global token denominators.
  4. every save_every steps ``save_and_publish``: checkpoint (HF safetensors + tokenizer) -> ack the leases it
     contains -> POST /admin/weights/update {model_path, weight_version=str(step), parent_version, samples}.
     A push the server defers (a version is on trial as canary) leaves the weights unpublished until the next
     checkpoint; a push refused because its parent was rolled back reloads the restored version's weights on
     every rank (Adam's moments cleared: they followed the rejected path) and trains on from there. Pruning keeps
     the newest keep_checkpoints checkpoints and those a rollback can restore (trainer/lineage.py).
  5. ``log_step``: the update's metrics, timings and the PRM metrics windows of the leases since the last step.

Resume: the latest complete checkpoint is loaded (weights, optimizer, baseline, recent sample ids), its
unacked leases are re-acked, and its weights are pushed to the engine. Unacked leases of a crashed step
return to the server's pool; recently trained sample ids are refused if they come back.

Setup (process group, sample source, policy and optimizer) is trainer/start.py.

Design choices: a baseline exists, every objective runs in every configuration, masked samples never dilute
the step, no reference model is loaded when its KL coefficient is 0, and the train-vs-rollout log-prob gap is
logged. ``--parallel fsdp2`` shards the model (trainer/parallel.py); every rank then takes part in the
checkpoint's full-state gather.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.records import Sample
from trainer import parallel
from trainer.advantages import RunningMean
from trainer.batch import check_sample
from trainer.checkpoint import (
    latest_checkpoint,
    load_optimizer,
    load_trainer_state,
    read_acked_step,
    save_checkpoint,
    write_acked_step,
)
from trainer.lease_client import (
    Lease,
    PolicyRejected,
    PublishDeferred,
    SampleSource,
    SourceExhausted,
    TrainerError,
    WeightsRolledBack,
    collect_leases,
)
from trainer.lease_client.samples import SetAside, staleness, typed_samples
from trainer.lineage import RunLineage
from trainer.metrics import MetricsLogger
from trainer.objective import carries_learning_term
from trainer.prm import resolve_prm_config
from trainer.settings import UNBOUNDED_STEPS, TrainConfig
from trainer.start import broadcast, compute_init, load_policy, make_source, reload_weights
from trainer.update import train_on_batch

logger = logging.getLogger(__name__)


SKIPPED_STEPS_FILE = "skipped_steps.jsonl"  # one line per batch that had no gradient (trainer/report reads it)


def rolled_back_problem(sample: Sample) -> str | None:
    """Why a sample made by a rolled-back weight version is not trained (None for any other sample).

    Its tokens were sampled by weights the server rejected and the trainer no longer holds (it reloaded the
    restored version): off-policy by a distance no version count measures (a discarded branch), and its reward
    scores a policy already judged worse. It is trained with mask 0 and acked, so it is never leased again."""
    if sample.rolled_back:
        return f"made by rolled-back weight version {sample.weight_version}"
    return None


# ----------------------------------------------------------------------------- one admitted batch
@dataclass
class AdmittedBatch:
    """The samples of one step's leases, admitted (``Trainer.admit``); ``invalid[i]``: sample i is trained with mask 0 (contract break, duplicate).
    ``set_aside``: leased JSON off the Sample schema, never trained (acked with its lease, counted invalid)."""

    samples: list[Sample]
    invalid: list[bool]
    n_stale: int = 0  # of the invalid ones, set aside as older than max_staleness weight versions
    set_aside: list[SetAside] = field(default_factory=list)

    @property
    def n_samples(self) -> int:
        """Every sample the leases held, set-aside ones included."""
        return len(self.samples) + len(self.set_aside)

    @property
    def n_invalid(self) -> int:
        """Samples not trained for a contract break or as duplicates, set-aside ones included."""
        return sum(self.invalid) + len(self.set_aside)

    def has_learning_term(self, cfg: TrainConfig) -> bool:
        """False when no sample can move the weights (a step would only apply Adam's momentum)."""
        return not all(
            bad or not carries_learning_term(s, cfg) for s, bad in zip(self.samples, self.invalid, strict=True)
        )


@dataclass
class PrmWindows:
    """PRM metrics windows (rollout/prm_*) of leases not yet logged. A lease with nothing trainable carries
    its window over to the next logged step (a later window's value wins for a key both have)."""

    values: dict[str, float] = field(default_factory=dict)
    count: int = 0

    def add(self, window: dict[str, float]) -> None:
        self.values.update(window)
        self.count += 1

    def drain(self) -> dict[str, float]:
        """The folded windows plus ``prm_metrics_windows`` (how many); {} when none arrived."""
        drained = {**self.values, "prm_metrics_windows": self.count} if self.count else {}
        self.values, self.count = {}, 0
        return drained


# ----------------------------------------------------------------------------- the run
class TrainingRun:
    """One training run on this rank: the policy, the loop state a checkpoint saves, and (rank 0) the source."""

    def __init__(
        self, cfg: TrainConfig, source: SampleSource | None, rank: int, world: int, device: torch.device
    ) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.out_dir = Path(cfg.out_dir)
        if rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": world}, indent=2))
        self.checkpoint = latest_checkpoint(self.out_dir)
        self.policy = load_policy(cfg, self.checkpoint, device, world)
        self.baseline_window = cfg.baseline_window if cfg.baseline == "window" else 0
        self.running = RunningMean(momentum=cfg.running_mean_momentum, window=self.baseline_window)
        self.trained_ids: deque[str] = deque(maxlen=cfg.remember_sample_ids)
        self.step = self.last_saved = 0
        self.pending_leases: list[str] = []  # leased since the last checkpoint; acked right after the next one
        self.skipped_steps = 0  # batches with no gradient since this process started (skipped_steps.jsonl: all)
        self.stale_samples = 0  # samples set aside by max_staleness since this process started
        self.prm_windows = PrmWindows()
        self.lineage = RunLineage.load(self.out_dir)  # the next push's parent (trainer/lineage.py)
        resume_leases = self.restore(self.checkpoint) if self.checkpoint is not None else []
        self.metrics = MetricsLogger(self.out_dir, enabled=rank == 0)
        self.source = source
        restored = None
        if rank == 0:
            self.source = source or make_source(cfg)
            if self.checkpoint is not None:
                restored = self.finish_interrupted_save(self.checkpoint, resume_leases)
        if self.checkpoint is not None:
            self.reload_if(broadcast(restored, world))
        self.bar = None
        if rank == 0 and cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=None if cfg.steps == UNBOUNDED_STEPS else cfg.steps,
                initial=self.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            )
        self.idle_since = self.last_step_end = time.monotonic()
        self.update_time_s = 0.0  # the last update_policy call alone; step_time_s counts the whole step

    def restore(self, ckpt: Path) -> list[str]:
        """Optimizer, step, baseline and recent sample ids from ``ckpt``; returns the leases it contains."""
        state = load_trainer_state(ckpt)
        try:
            load_optimizer(ckpt, self.policy.opt, model=self.policy.model, parallel=self.cfg.parallel, world=self.world)
        except ValueError as exc:  # e.g. an fsdp2 checkpoint resumed with --parallel ddp: never reset Adam silently
            raise TrainerError(f"cannot resume from {ckpt}: {exc}") from exc
        self.step = self.last_saved = int(state["step"])
        self.running = RunningMean.from_state(
            state.get("running_mean"), momentum=self.cfg.running_mean_momentum, window=self.baseline_window
        )
        self.trained_ids.extend(state.get("trained_sample_ids", []))
        logger.info("resumed from %s (step %d, %d remembered sample ids)", ckpt, self.step, len(self.trained_ids))
        return list(state.get("leases", []))

    @property
    def leader_source(self) -> SampleSource:
        """The sample source, which only rank 0 holds (the other ranks never lease, ack or push)."""
        if self.source is None:
            raise RuntimeError("only rank 0 talks to the sample source")
        return self.source

    def finish_interrupted_save(self, ckpt: Path, leases: list[str]) -> str | None:
        """Rank 0: re-ack the checkpoint's leases when the crash fell between checkpoint and ack, then push its weights."""
        if read_acked_step(self.out_dir) < self.step:
            for lease_id in leases:
                try:
                    self.leader_source.ack(lease_id)
                except PolicyRejected as exc:
                    logger.warning(
                        "re-ack of lease %s after resume refused (%s); its samples are in %s", lease_id, exc, ckpt
                    )
            write_acked_step(self.out_dir, self.step)
        reload = self.lineage.reload_due(self.step)
        if reload is not None:  # the checkpoint holds weights off the rejected path
            return reload
        if self.cfg.weight_sync and self.cfg.sync_on_resume:
            return self.publish(ckpt)
        return None

    def publish(self, ckpt: Path) -> str | None:
        """Rank 0: push ``ckpt`` as version str(step) with its lineage; returns the checkpoint to reload when the
        server rolled back the version these weights descend from (None otherwise)."""
        version, checkpoint = str(self.step), str(ckpt.resolve())
        try:
            sync = self.leader_source.update_weights(checkpoint, version, self.lineage.push_lineage())
        except PublishDeferred as exc:
            logger.warning("weights of step %d not published now (%s); the next checkpoint tries again", self.step, exc)
            return None
        except WeightsRolledBack as exc:
            logger.warning("%s: reloading %s", exc, exc.live.checkpoint)
            self.lineage.remember_restored(self.out_dir, exc.live.version, exc.live.checkpoint, self.step)
            return exc.live.checkpoint
        # A canary (or an answer that does not say): the live version it descends from stays restorable.
        self.lineage.remember_push(self.out_dir, version, checkpoint, on_trial=sync.state != "live")
        logger.info("weights of step %d pushed: %s", self.step, sync)
        return None

    def reload_if(self, checkpoint: str | None) -> None:
        """Every rank: restart from the restored weights (``checkpoint``) after a rollback, if there was one."""
        if checkpoint is not None:
            reload_weights(self.policy, checkpoint, self.world)
            logger.warning("step %d: weights reloaded from %s; optimizer moments cleared", self.step, checkpoint)

    def collect_leases(self) -> tuple[list[Lease], bool]:
        """(leases, stop) on every rank: rank 0 leases from live traffic (lease_client.collect_leases); stop when
        the source is exhausted or nothing came for idle_timeout_s."""
        leases: list[Lease] = []
        stop = False
        if self.rank == 0:
            try:
                leases = collect_leases(
                    self.leader_source, self.cfg.batch_size, self.cfg.min_batch_size, self.cfg.lease_wait_s
                )
            except SourceExhausted as exc:
                logger.info("%s; stopping", exc)
                stop = True
            idle_timeout_s = self.cfg.idle_timeout_s
            if not stop and not leases and idle_timeout_s > 0 and time.monotonic() - self.idle_since > idle_timeout_s:
                logger.info("no sample for %.0fs; stopping", idle_timeout_s)
                stop = True
        leases, stop = broadcast((leases, stop), self.world)
        if leases:
            self.idle_since = time.monotonic()
        return leases, stop

    def admit(self, leases: list[Lease]) -> AdmittedBatch:
        """The leases' samples with contract breaks and already-trained duplicates marked invalid (and logged);
        the leases join the ones the next checkpoint acks, on every rank so all ranks agree on when to persist."""
        # The JSON edge: each leased object is read into a Sample once; one off the schema is set aside.
        samples: list[Sample] = []
        set_aside: list[SetAside] = []
        for lease in leases:
            typed, aside = typed_samples(lease.samples)
            samples.extend(typed)
            set_aside.extend(aside)
        for off in set_aside:
            logger.warning("sample %s not trained: %s", off.sample_id, off.reason)
        reasons: list[str | None] = []
        stale: list[bool] = []
        for sample in samples:
            why = check_sample(sample, shaping=self.cfg.shaping) or rolled_back_problem(sample)
            too_old = None if why else self.staleness_problem(sample)
            reasons.append(why or too_old)
            stale.append(too_old is not None)
        self.stale_samples += sum(stale)
        for lease in leases:
            if lease.prm_metrics:  # the server's PRM window for these samples; logged with the next trained step
                self.prm_windows.add(lease.prm_metrics)
        seen = set(self.trained_ids)
        duplicate = [str(s.sample_id) in seen for s in samples]
        for sample, why, dup in zip(samples, reasons, duplicate, strict=True):
            if why or dup:
                logger.warning(
                    "sample %s not trained: %s", sample.sample_id, why or "already trained (re-leased duplicate)"
                )
        self.pending_leases.extend(lease.lease_id for lease in leases)
        self.lineage.unpublished.add(
            str(s.sample_id) for s, why, dup in zip(samples, reasons, duplicate, strict=True) if not (why or dup)
        )
        return AdmittedBatch(
            samples,
            [bool(why) or dup for why, dup in zip(reasons, duplicate, strict=True)],
            n_stale=sum(stale),
            set_aside=set_aside,
        )

    def staleness_problem(self, sample: Sample) -> str | None:
        """Why ``sample`` is too old to train, or None: it was generated more than ``max_staleness`` weight
        versions before the weights this step updates (version = the trainer's step; -1 = no bound). A samples
        file is offline data: its versions are not this trainer's, so it has no bound. This trainer publishes
        every version after the engine's initial weights, so a non-integer version is those: version 0."""
        k = self.cfg.max_staleness
        if k < 0 or self.cfg.samples_file:
            return None
        age = staleness(sample, self.step, initial_version=0)
        if age is None or age <= k:
            return None
        return (
            f"stale: weight version {sample.weight_version!r} is {age} versions behind {self.step} (max_staleness {k})"
        )

    def update_policy(self, batch: AdmittedBatch) -> dict[str, Any] | None:
        """One PPO update on ``batch``; remembers its trained sample ids and checks DDP replicas still agree.
        None when the batch has no gradient (trainer.update.train_on_batch): nothing changed but the baseline."""
        started = time.monotonic()
        policy = self.policy
        stats = train_on_batch(
            policy.wrapped,
            policy.model,
            policy.ref_model,
            policy.opt,
            batch.samples,
            batch.invalid,
            self.cfg,
            self.running,
            self.rank,
            self.world,
            self.device,
            policy.eos_id,
        )
        self.update_time_s = time.monotonic() - started
        if stats is None:
            return None
        self.trained_ids.extend(
            str(s.sample_id) for s, bad in zip(batch.samples, batch.invalid, strict=True) if not bad
        )
        fsdp = self.cfg.parallel == "fsdp2" and self.world > 1
        if self.world > 1 and self.cfg.check_ddp_sync and not fsdp:
            spread = parallel.weight_checksum_spread(policy.model, self.world)
            stats["ddp_weight_spread"] = spread
            if spread != 0.0:
                raise TrainerError(f"DDP replicas diverged at step {self.step}: checksum spread {spread}")
        return stats

    def save_due(self) -> bool:
        return self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps

    def save_and_publish(self) -> None:
        """Checkpoint -> ack its leases -> push weights; rank 0 does the I/O, every rank waits for it."""
        path = restored = None  # rank 0's, broadcast to every rank below
        started = time.monotonic()
        policy, cfg = self.policy, self.cfg
        model_state, optim_state = parallel.gather_for_checkpoint(
            policy.model, policy.opt, cfg.parallel, self.world
        )  # collective (fsdp2)
        if self.rank == 0:
            state = {
                "leases": list(self.pending_leases),
                "trained_sample_ids": list(self.trained_ids),
                "running_mean": self.running.state_dict(),
            }
            path = save_checkpoint(
                self.out_dir,
                self.step,
                policy.model,
                policy.opt,
                cfg.model_path,
                state,
                keep=cfg.keep_checkpoints,
                protect=self.lineage.restorable(),  # a rollback can send the trainer and the engines back to these
                model_state=model_state,
                optim_state=optim_state,
                optim_format=parallel.optimizer_format(cfg.parallel, self.world),
            )
            for lease_id in self.pending_leases:
                try:
                    self.leader_source.ack(lease_id)
                except PolicyRejected as exc:
                    if exc.status_code != 409:
                        raise
                    # Expired while we trained: its samples went back to ready; when they are leased
                    # again they are recognised as trained (sample ids in this checkpoint) and skipped.
                    logger.warning("lease %s expired before its ack (%s)", lease_id, exc)
            write_acked_step(self.out_dir, self.step)
            saved = time.monotonic()
            restored = self.publish(path) if cfg.weight_sync else None
            logger.info(
                "step %d saved to %s (%.2fs), acked %d lease(s), publish took %.2fs",
                self.step,
                path,
                saved - started,
                len(self.pending_leases),
                time.monotonic() - saved,
            )
        self.pending_leases.clear()
        path, restored = broadcast((path, restored), self.world)
        self.checkpoint, self.last_saved = path, self.step
        self.reload_if(restored)

    def skip_step(self, leases: list[Lease], batch: AdmittedBatch) -> None:
        """A batch with no gradient: count it, append it to skipped_steps.jsonl and ack its leases.

        Nothing else changes: the step counter, the weights, Adam's moments and step count and the published
        weight version stay as they were (the baseline has seen the rewards, as after a real step). The leases
        are acked at once when every trained step is checkpointed (a lease never waits for a checkpoint that
        may be many skipped batches away, and expires meanwhile); after an unsaved step they stay with the
        next checkpoint's leases, since a re-leased duplicate among them was trained only in that step."""
        self.skipped_steps += 1
        if self.step > self.last_saved:
            ids: set[str] = set()
        else:
            ids = {lease.lease_id for lease in leases}
            self.pending_leases = [lease_id for lease_id in self.pending_leases if lease_id not in ids]
        if self.rank != 0:
            return
        # The trained step's ack above, for a skipped step's leases (each logs its own case of a late ack).
        for lease_id in sorted(ids):
            try:
                self.leader_source.ack(lease_id)
            except PolicyRejected as exc:
                if exc.status_code != 409:
                    raise
                logger.warning("lease %s of a skipped step expired before its ack (%s)", lease_id, exc)
        record = {
            "after_step": self.step,
            "n_samples": batch.n_samples,
            "n_invalid": batch.n_invalid,
            "n_stale": batch.n_stale,
            "weight_versions": sorted({str(s.weight_version) for s in batch.samples}),
        }
        with open(self.out_dir / SKIPPED_STEPS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("no gradient in %d sample(s): step skipped (%d so far)", batch.n_samples, self.skipped_steps)

    def log_step(self, stats: dict[str, Any], batch: AdmittedBatch) -> None:
        """Write the step's metrics (rank 0) with its timings and the PRM windows since the last logged step."""
        now = time.monotonic()
        step_time_s = now - self.last_step_end  # lease, update, checkpoint and weight sync
        self.last_step_end = now
        stats.update(
            step_time_s=step_time_s,
            train_time_s=self.update_time_s,
            tokens_per_s=stats["n_tokens"] / max(step_time_s, 1e-9),
            lr=self.cfg.lr,
            weight_versions=sorted({str(s.weight_version) for s in batch.samples}),
            n_stale=batch.n_stale,
            stale_samples=self.stale_samples,
            skipped_steps=self.skipped_steps,
            # the update saw only the samples that fit the schema; the ones set aside count too
            n_samples=batch.n_samples,
            n_invalid=batch.n_invalid,
        )
        stats.update(self.prm_windows.drain())
        self.metrics.log(self.step, stats)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{stats['loss']:.4f}", reward=f"{stats['reward_mean']:.3f}")

    def finish(self) -> dict[str, Any]:
        """Persist (or, with nothing new trained, just ack) what is still pending; close the logs."""
        if self.pending_leases and self.step > self.last_saved:
            self.save_and_publish()
        elif self.pending_leases:
            # Leases that held only duplicates/invalid samples since the last save: nothing new to persist.
            if self.rank == 0:
                for lease_id in self.pending_leases:
                    self.leader_source.ack(lease_id)
            self.pending_leases.clear()
        if self.bar is not None:
            self.bar.close()
        self.metrics.close()
        checkpoint = str(self.checkpoint) if self.checkpoint else None
        return {"step": self.step, "checkpoint": checkpoint, "rank": self.rank, "world_size": self.world}


# ----------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, source: SampleSource | None = None) -> dict[str, Any]:
    """Train until cfg.steps (or the source runs dry / stays idle); returns the final step and checkpoint."""
    cfg = resolve_prm_config(cfg)  # --prm-config: shaping from the policy server's PRM YAML
    cfg.check_consistency()
    rank, world, device = compute_init()
    torch.manual_seed(cfg.seed)
    run = TrainingRun(cfg, source, rank, world, device)
    while run.step < cfg.steps:
        leases, stop = run.collect_leases()
        if stop:
            break
        if not leases:  # an empty wait is no step (no checkpoint, no weight push)
            continue
        batch = run.admit(leases)
        stats = run.update_policy(batch) if batch.has_learning_term(cfg) else None
        if stats is None:  # no gradient: no optimizer step, checkpoint or publish; the leases are acked now
            run.skip_step(leases, batch)
            continue
        run.step += 1
        if run.save_due():
            run.save_and_publish()
        run.log_step(stats, batch)
    return run.finish()
