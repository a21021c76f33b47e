"""The Hindsight trainer: one top-down PPO loop over samples leased from the policy server.

    hindsight-train --policy-url http://127.0.0.1:8100 --admin-api-key K --model-path DIR --out-dir runs/a --steps 100
    torchrun --nproc-per-node 2 -m trainer.cli --samples-file s.jsonl --model-path DIR --out-dir runs/b   # DDP (gloo on CPU)
    torchrun --nproc-per-node 2 -m trainer.cli ... --parallel fsdp2                                     # FSDP2 shards

Each step (docs/CONTRACTS.md "Trainer"; issue 6):
  1. rank 0 leases up to batch_size samples, waiting up to lease_wait_s for at least min_batch (holding partial
     leases meanwhile; nothing leased = no step), broadcasts them; samples already trained (a
     re-leased duplicate) and samples that break the contract are logged and trained with mask 0.
  2. RL advantages r - b (trainer/baselines.py: a running baseline by default, optional /std) are computed on
     the WHOLE batch on every rank, so DDP ranks agree; samples with no learning term in the mode get mask 0
     (a lease with none is no step); each minibatch is split across ranks, then into micro-batches.
  3. old log-probs (eval mode, no grad): recomputed by the trainer before any update (or the rollout's, a setting, except for
     ``constrained`` samples, which always use the recomputation); they serve the PPO ratio and the OPD
     term teacher - old. The train-vs-rollout gap is measured on unconstrained samples only. The same pass gives
     the rollout importance weights w = exp(old - rollout) (``--rollout-correction none|tis|mis``, cap
     ``--rollout-is-cap``; trainer/rollout_correction.py) that correct the PPO term for the client's sampling
     temperature and for stale weights, constrained samples included; with ``--logprob-temperature sample`` the
     PPO log-probs are taken at each sample's own temperature. Then AReaL process-reward shaping (trainer/prm.py: flags
     or ``--prm-config``) folds each sample's ``token_rewards`` into its normalised outcome advantage;
     samples without token_rewards stay unshaped. The lease's PRM metrics window is logged with the step.
  4. ppo_epochs x minibatches optimizer steps of PPO-clip (0.2 / 0.28) with token- or sequence-mean over the
     minibatch's VALID tokens (global denominators, so micro-batching and sharding do not change the loss;
     the loss is multiplied by world size because DDP averages gradients).
  5. every save_every steps: checkpoint (HF safetensors + tokenizer) -> ack the leases it contains ->
     POST /admin/weights/update {model_path, weight_version=str(step)}.
Resume: the latest complete checkpoint is loaded (weights, optimizer, baseline, recent sample ids), its
unacked leases are re-acked, and its weights are pushed to the engine. Unacked leases of a crashed step
return to the server's pool; recently trained sample ids are refused if they come back.

Differences from the prior system (openclaw-rl-notes.md §6, §9, §15): a baseline exists, every objective
runs in every configuration, masked samples never dilute the step, no reference model is loaded when its
KL coefficient is 0, and the train-vs-rollout log-prob gap is logged. ``--parallel fsdp2`` shards the model
(trainer/parallel.py); every rank then takes part in the checkpoint's full-state gather.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.chat import load_tokenizer
from trainer.advantages import RunningMean, rl_sample_advantages
from trainer.batch import Batch, check_sample, collate
from trainer.checkpoint import latest_checkpoint, load_optimizer, load_trainer_state, read_acked_step, save_checkpoint, write_acked_step
from trainer.metrics import MetricsLogger
from trainer.objective import (OLD_STAT_KEYS, STAT_KEYS, OldLogprobs, carries_learning_term, micro_loss, new_stats, old_logprobs,
                               outcome_advantages, shape, shaping_mask)
from trainer import parallel
from trainer.policy_client import (FileSampleSource, Lease, PolicyClient, PolicyRejected, SampleSource, SourceExhausted,
                                   TrainerError, collect_leases)
from trainer.prm import resolve_prm_config
from trainer.rollout_correction import is_metrics, sample_temperature
from trainer.settings import TrainConfig

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- compute init
def compute_init() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def broadcast(obj: Any, world: int) -> Any:
    """Rank 0's object on every rank (pickled over the process group)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def make_source(cfg: TrainConfig) -> SampleSource:
    if cfg.samples_file:
        return FileSampleSource(cfg.samples_file, Path(cfg.out_dir) / "file_source_state.json")
    if cfg.policy_url:
        return PolicyClient(cfg.policy_url, cfg.admin_api_key, timeout_s=cfg.http_timeout_s, deadline_s=cfg.http_deadline_s,
                            weight_sync_timeout_s=cfg.weight_sync_timeout_s)
    raise ValueError("one of policy_url or samples_file is required")


# ----------------------------------------------------------------------------- one leased batch
def train_on_batch(ddp: torch.nn.Module, model: torch.nn.Module, ref_model: torch.nn.Module | None, opt: torch.optim.Optimizer,
                   samples: list[dict[str, Any]], invalid: list[bool], cfg: TrainConfig, running: RunningMean,
                   rank: int, world: int, device: torch.device, eos_id: int | None) -> dict[str, float]:
    B, M = len(samples), cfg.minibatches
    # (B,) presence flags of the whole batch: a sample that is not trained does not enter the baseline.
    no_eos = [cfg.mask_no_eos_with_zero and (not s.get("response_ids") or s["response_ids"][-1] != eos_id) for s in samples]
    trainable = torch.tensor([not bad and not ne and any(s["loss_mask"]) for s, bad, ne in zip(samples, invalid, no_eos)])
    # A sample with no learning term in this mode is trained with mask 0: it would only dilute the denominators.
    idle = [bad or not carries_learning_term(s, cfg) for s, bad in zip(samples, invalid)]
    rewards = torch.tensor([float(s["reward"]) if s.get("reward") is not None else 0.0 for s in samples])
    has_r = torch.tensor([bool(s.get("has_reward")) and s.get("reward") is not None for s in samples]) & trainable
    rl_adv = rl_sample_advantages(rewards, has_r, baseline=cfg.baseline, normalize=cfg.normalize_advantages, running=running)
    minibatches = [list(range(m, B, M)) for m in range(M)]

    # Plan: per minibatch, this rank's micro-batches (dummy zero-mask rows keep DDP backward counts equal).
    plan: list[tuple[float, float, list[tuple[Batch, list[int]]]]] = []
    for mb in minibatches:
        bmask = collate([samples[i] for i in mb], eos_id=eos_id, mask_no_eos=cfg.mask_no_eos_with_zero,
                        zero_mask=[idle[i] for i in mb]).mask
        num_tokens, num_seqs = float(bmask.sum()), float((bmask.sum(-1) > 0).sum())
        mine = mb[rank::world]
        n_micro = max(1, math.ceil(math.ceil(len(mb) / world) / cfg.micro_batch_size))
        micros = []
        for j in range(n_micro):
            idx = mine[j * cfg.micro_batch_size : (j + 1) * cfg.micro_batch_size]
            dummy = not idx
            idx = idx or [mb[0]]
            b = collate([samples[i] for i in idx], eos_id=eos_id, mask_no_eos=cfg.mask_no_eos_with_zero,
                        zero_mask=[dummy or idle[i] for i in idx]).to(device)
            micros.append((b, [-1] * len(idx) if dummy else idx))
        plan.append((num_tokens, num_seqs, micros))

    # Old log-probs before any update (trainer.objective.old_logprobs): PPO old log-probs at the loss temperature,
    # T = 1 old log-probs for the OPD term, the rollout importance weights and the train-vs-rollout gap.
    olds: list[list[OldLogprobs]] = []
    old_sums = dict.fromkeys(OLD_STAT_KEYS, 0.0)
    is_max = 0.0
    # per minibatch: valid tokens, samples after mis rejection; then tokens, samples with teacher top-K rows
    eff = torch.zeros(len(plan), 4, dtype=torch.float64)
    model.eval()  # a no-grad pass: no dropout in the old log-probs
    for k, (_, _, micros) in enumerate(plan):
        olds.append([old_logprobs(model, b, cfg) for b, _ in micros])
        for (b, _), o in zip(micros, olds[-1]):
            for key in OLD_STAT_KEYS:
                old_sums[key] += o.stats[key]
            is_max = max(is_max, o.stats["is_max"])
            tk = b.topk_valid * b.mask
            eff[k] += torch.tensor([float(b.mask.sum()), float((b.mask.sum(-1) > 0).sum()), float(tk.sum()),
                                    float((tk.sum(-1) > 0).sum())], dtype=torch.float64)
    model.train()
    if world > 1 and (cfg.rollout_correction == "mis" or cfg.topk_coef > 0):
        dist.all_reduce(eff)
    if cfg.rollout_correction == "mis":
        # Rejected tokens leave the denominators too (slime #657): the global counts after rejection, all ranks.
        plan = [(float(eff[k, 0]), float(eff[k, 1]), micros) for k, (_, _, micros) in enumerate(plan)]

    stats = new_stats()
    grad_norms = []
    for _ in range(cfg.ppo_epochs):
        for mb_i, ((num_tokens, num_seqs, micros), old_row) in enumerate(zip(plan, olds)):
            for j, ((b, idx), old) in enumerate(zip(micros, old_row)):
                raw = outcome_advantages(b, old.adv, rl_adv[torch.tensor([max(i, 0) for i in idx])].to(device), cfg)
                adv = shape(b, raw, cfg)
                tr_mask = shaping_mask(b)
                stats["adv_unshaped"] += float(raw.sum())
                stats["adv_unshaped_abs"] += float(raw.abs().sum())
                stats["tr_tokens"] += float(tr_mask.sum())
                stats["tr_sum"] += float((b.token_rewards * tr_mask).sum())
                last = j == len(micros) - 1
                with parallel.grad_sync(ddp, cfg.parallel, world, enabled=last):
                    loss, st = micro_loss(ddp, ref_model, b, old.pg, adv, cfg, num_tokens=num_tokens, num_seqs=num_seqs,
                                          is_weight=old.is_weight, num_topk_tokens=float(eff[mb_i, 2]),
                                          num_topk_seqs=float(eff[mb_i, 3]))
                    (loss * world).backward()  # DDP/FSDP2 average gradients over ranks; the shares are already global
                for k, v in st.items():
                    stats[k] += v
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
            grad_norms.append(parallel.grad_norm(gn))
            opt.step()
            opt.zero_grad(set_to_none=True)

    # Sum statistics over ranks; shares of the loss sum to the batch loss.
    vec = torch.tensor([stats[k] for k in STAT_KEYS] + [old_sums[k] for k in OLD_STAT_KEYS], dtype=torch.float64)
    vmax = torch.tensor([is_max], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(vec)
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX)
    s = dict(zip(STAT_KEYS, vec[: len(STAT_KEYS)].tolist()))
    o = dict(zip(OLD_STAT_KEYS, vec[len(STAT_KEYS) :].tolist()))
    gap_sum, gap_n, cgap_sum, cgap_n = o["gap_sum"], o["gap_n"], o["cgap_sum"], o["cgap_n"]
    is_out = is_metrics(o, float(vmax[0]), cfg.rollout_correction)
    n_upd = cfg.ppo_epochs * M
    ntok = max(s["tokens"], 1.0)
    has_any = bool(has_r.any())
    out = {
        "loss": s["loss"] / n_upd, "pg_loss": s["pg"] / n_upd,
        "clip_frac": s["clip"] / ntok, "approx_kl": s["approx_kl"] / ntok, "entropy": s["entropy"] / ntok,
        "adv_mean": s["adv"] / ntok, "adv_abs_mean": s["adv_abs"] / ntok,
        # Before process-reward shaping (equal to adv_* when shaping is off or no sample has token_rewards).
        "adv_unshaped_mean": s["adv_unshaped"] / ntok, "adv_unshaped_abs_mean": s["adv_unshaped_abs"] / ntok,
        "n_with_token_rewards": sum(s_.get("token_rewards") is not None for s_ in samples),
        "token_reward_mean": s["tr_sum"] / s["tr_tokens"] if s["tr_tokens"] else float("nan"),
        "shaped_tokens": int(s["tr_tokens"] / cfg.ppo_epochs) if cfg.shaping != "none" else 0,
        "train_rollout_lp_abs_diff": gap_sum / max(gap_n, 1.0),
        # Constrained samples are excluded from the gap above; their own mean |diff| is informational.
        "n_constrained": sum(bool(s_.get("constrained")) for s_ in samples),
        "constrained_rollout_lp_abs_diff": cgap_sum / cgap_n if cgap_n else float("nan"),
        "reward_mean": float(rewards[has_r].mean()) if has_any else float("nan"),
        "n_samples": B, "n_trained_samples": int(trainable.sum()), "n_invalid": int(sum(invalid)),
        "n_learning_samples": B - sum(idle), "rl_adv_nonzero": int((rl_adv != 0).sum()),
        "n_with_reward": int(has_r.sum()), "n_with_teacher": sum(bool(s_.get("has_teacher")) for s_ in samples),
        "n_tokens": int(s["tokens"] / cfg.ppo_epochs), "grad_norm": max(grad_norms),
        # Off-policy correction (rollout_is_* over valid tokens before mis rejection) and the samples' temperatures.
        **is_out,
        "n_with_sampling_params": sum(isinstance(s_.get("sampling_params"), dict) for s_ in samples),
        "sample_temperature_mean": sum(sample_temperature(s_) for s_ in samples) / max(B, 1),
    }
    if ref_model is not None:
        out["ref_kl"] = s["ref_kl"] / ntok
    if cfg.topk_coef > 0:
        out["topk_kl"] = s["topk_kl"] / ntok
    return out


# ----------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, source: SampleSource | None = None) -> dict[str, Any]:
    cfg = resolve_prm_config(cfg)  # --prm-config: shaping from the policy server's PRM YAML
    cfg.validate()
    rank, world, device = compute_init()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": world}, indent=2))

    from transformers import AutoModelForCausalLM

    ckpt = latest_checkpoint(out)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt or cfg.model_path), dtype=torch.float32).to(device)
    model.train()
    eos_id = load_tokenizer(cfg.model_path).eos_token_id
    ref_model = None
    if cfg.kl_coef > 0:  # never load (or run) a reference model whose term is multiplied by 0
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32).to(device).eval()
        ref_model.requires_grad_(False)
        ref_model = parallel.shard_frozen(ref_model, cfg.parallel, world)
    if cfg.parallel == "fsdp2" and world == 1:
        logger.info("--parallel fsdp2 with one process: nothing to shard, training the plain model")
    ddp = parallel.wrap(model, cfg.parallel, world)  # before the optimizer: fsdp2 replaces parameters by shards
    fsdp = cfg.parallel == "fsdp2" and world > 1
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    window = cfg.baseline_window if cfg.baseline == "window" else 0
    running = RunningMean(momentum=cfg.running_mean_momentum, window=window)
    trained_ids: deque[str] = deque(maxlen=cfg.remember_sample_ids)
    step, last_saved = 0, 0
    resume_leases: list[str] = []
    if ckpt is not None:
        st = load_trainer_state(ckpt)
        try:
            load_optimizer(ckpt, opt, model=model, parallel=cfg.parallel, world=world)
        except ValueError as exc:  # e.g. an fsdp2 checkpoint resumed with --parallel ddp: never reset Adam silently
            raise TrainerError(f"cannot resume from {ckpt}: {exc}") from exc
        step = last_saved = int(st["step"])
        running = RunningMean.from_state(st.get("running_mean"), momentum=cfg.running_mean_momentum, window=window)
        trained_ids.extend(st.get("trained_sample_ids", []))
        resume_leases = st.get("leases", [])
        logger.info("resumed from %s (step %d, %d remembered sample ids)", ckpt, step, len(trained_ids))

    metrics = MetricsLogger(out, enabled=rank == 0)
    if rank == 0:
        source = source or make_source(cfg)
        if ckpt is not None and read_acked_step(out) < step:
            for lease_id in resume_leases:  # the crash fell between checkpoint and ack
                try:
                    source.ack(lease_id)
                except PolicyRejected as exc:
                    logger.warning("re-ack of lease %s after resume refused (%s); its samples are in %s", lease_id, exc, ckpt)
            write_acked_step(out, step)
        if ckpt is not None and cfg.weight_sync and cfg.sync_on_resume:
            source.update_weights(str(ckpt.resolve()), str(step))

    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    pending: list[str] = []
    # PRM metrics windows (rollout/prm_*) from leases not yet logged. A window arrives with each lease that
    # returned samples; a lease with nothing trainable carries its window over to the next logged step (a
    # later window's value wins for a key both have; prm_metrics_windows says how many were folded).
    prm_window: dict[str, float] = {}
    prm_windows = 0
    idle_since = time.monotonic()
    t_last = time.monotonic()
    ckpt_path = ckpt

    def persist(at_step: int) -> Path:
        """Checkpoint -> ack its leases -> push weights; rank 0 does the I/O, every rank waits for it."""
        path = None
        t0 = time.monotonic()
        model_state, optim_state = parallel.gather_for_checkpoint(model, opt, cfg.parallel, world)  # collective (fsdp2)
        if rank == 0:
            state = {"leases": list(pending), "trained_sample_ids": list(trained_ids), "running_mean": running.state_dict()}
            path = save_checkpoint(out, at_step, model, opt, cfg.model_path, state, keep=cfg.keep_checkpoints,
                                   model_state=model_state, optim_state=optim_state,
                                   optim_format=parallel.optimizer_format(cfg.parallel, world))
            for lease_id in pending:
                try:
                    source.ack(lease_id)
                except PolicyRejected as exc:
                    if exc.status_code != 409:
                        raise
                    # Expired while we trained: its samples went back to ready; when they are leased
                    # again they are recognised as trained (sample ids in this checkpoint) and skipped.
                    logger.warning("lease %s expired before its ack (%s)", lease_id, exc)
            write_acked_step(out, at_step)
            t1 = time.monotonic()
            sync = source.update_weights(str(path.resolve()), str(at_step)) if cfg.weight_sync else {}
            logger.info("step %d saved to %s (%.2fs), acked %d lease(s), weights pushed in %.2fs %s",
                        at_step, path, t1 - t0, len(pending), time.monotonic() - t1, sync)
        pending.clear()
        return broadcast(path, world)

    while step < cfg.steps:
        # Live traffic: lease until min_batch samples are held or lease_wait_s ends (policy_client.collect_leases);
        # an empty wait is no step (no checkpoint, no weight push).
        leases: list[Lease] = []
        stop = False
        if rank == 0:
            try:
                leases = collect_leases(source, cfg.batch_size, cfg.min_batch_size, cfg.lease_wait_s)
            except SourceExhausted as exc:
                logger.info("%s; stopping", exc)
                stop = True
            if not stop and not leases:
                if cfg.idle_timeout_s > 0 and time.monotonic() - idle_since > cfg.idle_timeout_s:
                    logger.info("no sample for %.0fs; stopping", cfg.idle_timeout_s)
                    stop = True
        leases, stop = broadcast((leases, stop), world)
        if stop:
            break
        if not leases:
            continue
        idle_since = time.monotonic()
        samples = [s for lease in leases for s in lease.samples]
        reasons = [check_sample(s, shaping=cfg.shaping) for s in samples]
        for lease in leases:
            if lease.prm_metrics:  # the server's PRM window for these samples; logged with the next trained step
                prm_window.update(lease.prm_metrics)
                prm_windows += 1
        seen = set(trained_ids)
        dup = [str(s.get("sample_id")) in seen for s in samples]
        for s, why, d in zip(samples, reasons, dup):
            if why or d:
                logger.warning("sample %s not trained: %s", s.get("sample_id"), why or "already trained (re-leased duplicate)")
        invalid = [bool(w) or d for w, d in zip(reasons, dup)]
        pending.extend(lease.lease_id for lease in leases)  # on every rank, so all ranks agree on when to persist
        if all(bad or not carries_learning_term(s, cfg) for s, bad in zip(samples, invalid)):
            # Nothing to learn from (no step: Adam's momentum alone would still move the weights); the lease is
            # acked with the next checkpoint.
            continue
        step += 1
        t_train = time.monotonic()
        m = train_on_batch(ddp, model, ref_model, opt, samples, invalid, cfg, running, rank, world, device, eos_id)
        t_done = time.monotonic()
        trained_ids.extend(str(s.get("sample_id")) for s, bad in zip(samples, invalid) if not bad)
        if world > 1 and cfg.check_ddp_sync and not fsdp:
            spread = parallel.weight_checksum_spread(model, world)
            m["ddp_weight_spread"] = spread
            if spread != 0.0:
                raise TrainerError(f"DDP replicas diverged at step {step}: checksum spread {spread}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            ckpt_path, last_saved = persist(step), step
        now = time.monotonic()
        # tokens_per_s counts the whole step (lease, update, checkpoint, sync); train_time_s only the update.
        m.update(step_time_s=now - t_last, train_time_s=t_done - t_train, tokens_per_s=m["n_tokens"] / max(now - t_last, 1e-9), lr=cfg.lr,
                 weight_versions=sorted({str(s.get("weight_version")) for s in samples}))
        t_last = now
        if prm_windows:
            m.update(prm_window, prm_metrics_windows=prm_windows)
            prm_window, prm_windows = {}, 0
        metrics.log(step, m)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", reward=f"{m['reward_mean']:.3f}")
    if pending and step > last_saved:
        ckpt_path = persist(step)
    elif pending:
        # Leases that held only duplicates/invalid samples since the last save: nothing new to persist.
        if rank == 0:
            for lease_id in pending:
                source.ack(lease_id)
        pending.clear()
    if bar is not None:
        bar.close()
    metrics.close()
    return {"step": step, "checkpoint": str(ckpt_path) if ckpt_path else None, "rank": rank, "world_size": world}
