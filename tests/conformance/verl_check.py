"""Run by the verl venv's python (tests/conformance/test_verl_adapter.py): verl 0.9.1's own code consumes
leased Hindsight samples, and every number is compared with one computed here by hand.

    python verl_check.py TINY_MODEL_DIR WORK_DIR [N]   # prints "verl checks passed: N" or fails; with N, then
                                                       # "verl live checks passed: M" against a running policy
                                                       # server holding N ready samples (HINDSIGHT_* env)

(One process for both: verl's imports alone are about 9 CPU-seconds.)

Samples are served by trainer.lease_client.FileSampleSource (the lease/ack semantics of the policy server's
admin API on a JSONL file), so the path under test is: lease -> typed Sample -> tensors -> verl's
AgentLoopOutput -> verl's AgentLoopWorker padding/stacking -> DataProto -> verl's reward extraction and its
GRPO / REINFORCE++ advantage code (ray_trainer.compute_advantage, core_algos) and its distillation layout.
The expected values are plain-Python arithmetic on the sample lists, never verl's or our tensor code.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import verl
import verl.trainer.config as verl_config
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator, kl_penalty
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.reward import extract_reward
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from engine.records import Sample
from trainer.adapters.verl_rollout import HindsightAgentLoopManager, HindsightVerlError, VerlLeaseSettings
from trainer.lease_client import FileSampleSource, SourceExhausted
from trainer.sample_tensors import sample_tensors

PROMPT_LEN, RESPONSE_LEN = 6, 5
CHECKS: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    CHECKS.append(name)


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def sample(i: int, prompt: list[int], resp: list[int], lp: list[float], **kw: object) -> dict:
    s = {
        "mode": kw.pop("mode", "rl"),
        "loss_mask": kw.pop("loss_mask", [1] * len(resp)),
        "reward": kw.get("reward"),
        "has_reward": kw.pop("reward", None) is not None,
        "has_teacher": "teacher_logprobs" in kw,
        "w_rl": 1.0,
        "w_opd": 1.0,
        "prompt_ids": prompt,
        "response_ids": resp,
        "rollout_logprobs": lp,
        "weight_version": kw.pop("weight_version", "2"),
        "sample_id": f"s{i}",
        "session_id": f"sess{i}",
        "turn_index": 0,
        "created_at": 1.0,
    }
    s.update(kw)
    return Sample.model_validate(s).to_json()


def config(model_dir: str):
    cfg = OmegaConf.load(Path(verl_config.__file__).with_name("_generated_ppo_trainer.yaml"))
    cfg.actor_rollout_ref.model.path = model_dir
    cfg.actor_rollout_ref.rollout.name = "sglang"
    cfg.actor_rollout_ref.rollout.prompt_length = PROMPT_LEN
    cfg.actor_rollout_ref.rollout.response_length = RESPONSE_LEN
    cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class = (
        "trainer.adapters.verl_rollout.HindsightAgentLoopManager"
    )
    return cfg


def prompts(n: int, step: int) -> DataProto:
    uid = np.array([f"u{step}-{i}" for i in range(n)], dtype=object)
    return DataProto.from_dict(non_tensors={"uid": uid}, meta_info={"global_steps": step})


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def reward_step(cfg, work: Path, pad: int) -> None:
    """require=reward: one opd-only and one over-long sample are set aside and replaced; GRPO / REINFORCE++."""
    rows = [
        sample(1, [5, 6, 7], [10, 11, 12], [-0.5, -1.0, -0.25], reward=1.0),
        sample(2, [5, 6], [13, 14], [-0.1, -0.2], reward=-1.0, weight_version="1"),
        sample(3, [8, 9], [15, 16, 17], [-0.3, -0.3, -0.3], mode="opd", teacher_logprobs=[-0.1, -0.2, -0.3]),
        sample(4, [1, 2, 3, 4, 5, 6, 7], [18], [-0.7], reward=1.0),  # 7 prompt ids > PROMPT_LEN
        sample(5, [8, 9, 10, 11], [15, 16, 17, 18], [-0.4] * 4, reward=1.0, token_rewards=[0.1, 0.0, 0.0, 0.2]),
        sample(6, [9], [19, 20], [-0.6, -0.9], reward=0.0, loss_mask=[1, 0]),
    ]
    write(work / "reward.jsonl", rows)
    src = FileSampleSource(work / "reward.jsonl", work / "reward.state")
    mgr = HindsightAgentLoopManager.create(
        config=cfg, llm_client=None, source=src, settings=VerlLeaseSettings(require="reward", lease_wait_s=0.0)
    )
    out = mgr.generate_sequences(prompts(4, step=3))
    kept = [rows[i] for i in (0, 1, 4, 5)]
    check(
        "set aside: the opd sample (no reward) and the over-long one",
        [a.sample_id for a in mgr.set_aside] == ["s3", "s4"],
        mgr.set_aside,
    )
    check(
        "set-aside reasons",
        "no reward" in mgr.set_aside[0].reason and "exceed" in mgr.set_aside[1].reason,
        mgr.set_aside,
    )
    b = out.batch
    check(
        "verl batch keys",
        {
            "prompts",
            "responses",
            "response_mask",
            "input_ids",
            "attention_mask",
            "position_ids",
            "rollout_log_probs",
            "rm_scores",
        }
        <= set(b.keys()),
        list(b.keys()),
    )
    check("no teacher fields without teacher rows", "teacher_logprobs" not in b.keys())  # noqa: SIM118
    for i, s in enumerate(kept):
        p, r = s["prompt_ids"], s["response_ids"]
        check(
            f"row {i} prompt left-padded",
            b["prompts"][i].tolist() == [pad] * (PROMPT_LEN - len(p)) + p,
            b["prompts"][i],
        )
        check(
            f"row {i} response right-padded",
            b["responses"][i].tolist() == r + [pad] * (RESPONSE_LEN - len(r)),
            b["responses"][i],
        )
        mask = s["loss_mask"] + [0] * (RESPONSE_LEN - len(r))
        check(f"row {i} response_mask = loss_mask", b["response_mask"][i].tolist() == mask, b["response_mask"][i])
        att = [0] * (PROMPT_LEN - len(p)) + [1] * (len(p) + len(r)) + [0] * (RESPONSE_LEN - len(r))
        check(f"row {i} attention_mask", b["attention_mask"][i].tolist() == att, b["attention_mask"][i])
        lp = s["rollout_logprobs"] + [0.0] * (RESPONSE_LEN - len(r))
        check(f"row {i} rollout_log_probs", close(b["rollout_log_probs"][i].tolist(), lp), b["rollout_log_probs"][i])
        want = [0.0] * RESPONSE_LEN
        want[len(r) - 1] += s["reward"]
        for t, v in enumerate(s.get("token_rewards") or []):
            want[t] += v
        check(
            f"row {i} rm_scores (reward on the last token + process rewards)",
            close(b["rm_scores"][i].tolist(), want),
            b["rm_scores"][i],
        )
    nt = out.non_tensor_batch
    check("sample ids travel", list(nt["hindsight_sample_id"]) == ["s1", "s2", "s5", "s6"], nt["hindsight_sample_id"])
    check(
        "staleness = step - weight version", list(nt["hindsight_staleness"]) == [1, 2, 1, 1], nt["hindsight_staleness"]
    )
    check("lease ids in meta_info", len(out.meta_info["hindsight"]["lease_ids"]) >= 1)
    check("timing from verl's own metrics code", "agent_loop/generate_sequences/mean" in out.meta_info["timing"])

    # As verl's fit does: the dataset batch's uid (one per prompt, rollout.n = 1) joined to the rollout output,
    # token_level_scores from rm_scores, token_level_rewards = scores (no KL in reward).
    data = out
    data.non_tensor_batch.update(prompts(4, step=3).non_tensor_batch)  # the union's only new key: uid
    scores, _ = extract_reward(data)
    data.batch["token_level_scores"] = scores
    data.batch["token_level_rewards"] = scores
    mask = [s["loss_mask"] + [0] * (RESPONSE_LEN - len(s["response_ids"])) for s in kept]
    totals = [s["reward"] + sum(s.get("token_rewards") or []) for s in kept]  # 1, -1, 1.3, 0

    # GRPO, one row per uid (live turns share no prompt): mean 0 / std 1 for a singleton -> A = score.
    adv = compute_advantage(data, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True).batch["advantages"]
    for i in range(4):
        check(f"GRPO singleton row {i}", close(adv[i].tolist(), [totals[i] * m for m in mask[i]]), adv[i])

    # GRPO over groups {s1, s2} and {s5, s6}: (score - mean) / (unbiased std + 1e-6).
    data.non_tensor_batch["uid"] = np.array(["a", "a", "b", "b"], dtype=object)
    adv = compute_advantage(data, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True).batch["advantages"]
    for g in ((0, 1), (2, 3)):
        xs = [totals[i] for i in g]
        mean = sum(xs) / 2
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 1)
        for i in g:
            want = [(totals[i] - mean) / (std + 1e-6) * m for m in mask[i]]
            check(f"GRPO grouped row {i}", close(adv[i].tolist(), want), (adv[i], want))

    # REINFORCE++ (gamma 1): return_t = sum of rewards from t on (masked tokens pass rewards through),
    # whitened over every trained token of the batch (unbiased variance, + 1e-8).
    algo = OmegaConf.create({"gamma": 1.0, "lam": 1.0})
    adv = compute_advantage(data, AdvantageEstimator.REINFORCE_PLUS_PLUS, config=algo).batch["advantages"]
    returns = []
    for s, m in zip(kept, mask, strict=True):
        rw = [0.0] * RESPONSE_LEN
        rw[len(s["response_ids"]) - 1] += s["reward"]
        for t, v in enumerate(s.get("token_rewards") or []):
            rw[t] += v
        run, row = 0.0, [0.0] * RESPONSE_LEN
        for t in reversed(range(RESPONSE_LEN)):
            new = rw[t] + run
            row[t] = new * m[t]
            run = new * m[t] + run * (1 - m[t])
        returns.append(row)
    vals = [returns[i][t] for i in range(4) for t in range(RESPONSE_LEN) if mask[i][t]]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals) * len(vals) / (len(vals) - 1)
    for i in range(4):
        want = [(returns[i][t] - mu) / math.sqrt(var + 1e-8) * mask[i][t] for t in range(RESPONSE_LEN)]
        check(f"REINFORCE++ row {i}", close(adv[i].tolist(), want, 1e-4), (adv[i], want))

    check("nothing acked before verl asks for the next step", src.acked == 0, src.acked)
    exhausted = False
    try:
        mgr.generate_sequences(prompts(1, step=4))
    except SourceExhausted:  # the file has no sample left: this step fails, but the previous one was acked
        exhausted = True
    check(
        "the next step's call acks the previous step (set-aside samples too)", exhausted and src.acked == 6, src.acked
    )
    try:
        mgr.generate_sequences(DataProto.from_dict(non_tensors={"uid": np.array(["x", "x"], dtype=object)}))
        check("repeated uids refused", False)
    except HindsightVerlError as exc:
        check("repeated uids refused (rollout.n must be 1)", "rollout.n=1" in str(exc))


def teacher_step(cfg, work: Path) -> None:
    """require=teacher: verl's distillation layout reads our teacher log-probs at the response positions."""
    rows = [
        sample(1, [5, 6, 7], [10, 11, 12], [-0.5, -1.0, -0.25], mode="opd", teacher_logprobs=[-0.2, -0.6, -0.5]),
        sample(2, [5, 6], [13, 14], [-0.1, -0.2], mode="opd", teacher_logprobs=[-0.3, -0.05]),
    ]
    write(work / "teacher.jsonl", rows)
    src = FileSampleSource(work / "teacher.jsonl", work / "teacher.state")
    mgr = HindsightAgentLoopManager.create(
        config=cfg, llm_client=None, source=src, settings=VerlLeaseSettings(require="teacher", lease_wait_s=0.0)
    )
    out = mgr.generate_sequences(prompts(2, step=2))
    b = out.batch
    check("teacher fields stacked", {"teacher_ids", "teacher_logprobs"} <= set(b.keys()), list(b.keys()))
    check("teacher step: rm_scores all 0 (no outcome term)", float(b["rm_scores"].abs().sum()) == 0.0)
    # verl's own unpadding (left_right_2_no_padding) then its response slicing (no_padding_2_padding), as its
    # distillation losses read the teacher log-probs.
    td = b.clone()
    td = left_right_2_no_padding(td)
    got = no_padding_2_padding(td["teacher_logprobs"], td).squeeze(-1)
    ids = no_padding_2_padding(td["teacher_ids"], td).squeeze(-1)
    for i, s in enumerate(rows):
        n = len(s["response_ids"])
        check(
            f"teacher row {i}: verl reads our teacher log-probs",
            close(got[i, :n].tolist(), s["teacher_logprobs"]),
            got[i],
        )
        check(f"teacher row {i}: against the sampled ids", ids[i, :n].tolist() == s["response_ids"], ids[i])
        # verl's k1 distillation estimator with the student at the rollout policy: student - teacher, which is
        # minus the OPD advantage of the lease client's tensors.
        st = sample_tensors(Sample.model_validate(s))
        k1 = kl_penalty(logprob=torch.tensor([s["rollout_logprobs"]]), ref_logprob=got[i : i + 1, :n], kl_penalty="k1")
        check(f"teacher row {i}: k1 = -(teacher - rollout)", close(k1[0].tolist(), (-st.opd_advantages).tolist()), k1)
    for lid in out.meta_info["hindsight"]["lease_ids"]:
        src.ack(lid)  # acked behind the manager's back: its own ack is then refused (as an expired lease's is)
    mgr.ack_pending()
    check("a refused ack is logged, not raised", mgr.pending == [] and src.acked == 2, src.acked)
    try:
        mgr.generate_sequences(
            DataProto.from_dict(non_tensors={"uid": np.array(["v"], dtype=object)}, meta_info={"validate": True})
        )
        check("validation refused", False)
    except HindsightVerlError as exc:
        check("validation batches refused", "test_freq" in str(exc))


def live_step(model_dir: str, n: int) -> None:
    """A running policy server (HINDSIGHT_POLICY_URL / HINDSIGHT_ADMIN_KEY) holds ``n`` ready samples judged from
    live sessions: the manager, configured from the environment as in a verl run, leases them over HTTP."""
    import httpx

    cfg = config(model_dir)
    cfg.actor_rollout_ref.rollout.prompt_length = 1024
    cfg.actor_rollout_ref.rollout.response_length = 32
    mgr = HindsightAgentLoopManager.create(config=cfg, llm_client=None)
    check("settings from the environment", mgr.settings.require == "reward" and mgr.settings.lease_wait_s == 5.0)
    out = mgr.generate_sequences(prompts(n, step=1))
    admin = httpx.Client(
        base_url=os.environ["HINDSIGHT_POLICY_URL"],
        headers={"Authorization": f"Bearer {os.environ['HINDSIGHT_ADMIN_KEY']}"},
        timeout=30,
        trust_env=False,
    )
    rows = admin.get("/v1/samples", params={"status": "leased", "limit": 100}).json()["samples"]
    leased = {r["sample_id"]: r["sample"] for r in rows}
    ids = list(out.non_tensor_batch["hindsight_sample_id"])
    check("the step holds the n leased samples", sorted(ids) == sorted(leased) and len(ids) == n, (ids, list(leased)))
    b = out.batch
    P = b["prompts"].shape[1]
    for i, sid in enumerate(ids):
        s = leased[sid]
        p, r = s["prompt_ids"], s["response_ids"]
        check(f"live row {i}: prompt", b["input_ids"][i, P - len(p) : P].tolist() == p)
        check(f"live row {i}: response", b["responses"][i, : len(r)].tolist() == r)
        check(f"live row {i}: loss mask", b["response_mask"][i, : len(r)].tolist() == s["loss_mask"])
        check(
            f"live row {i}: rollout log-probs",
            close(b["rollout_log_probs"][i, : len(r)].tolist(), s["rollout_logprobs"]),
        )
        want = [0.0] * len(r)
        want[-1] = s["reward"]
        check(
            f"live row {i}: reward {s['reward']} on the last token", close(b["rm_scores"][i, : len(r)].tolist(), want)
        )
        check(
            f"live row {i}: the engine's weight version",
            out.non_tensor_batch["hindsight_weight_version"][i] == s["weight_version"],
        )
    data = out
    data.non_tensor_batch.update(prompts(n, step=1).non_tensor_batch)
    data.batch["token_level_rewards"] = extract_reward(data)[0]
    adv = compute_advantage(data, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True).batch["advantages"]
    for i, sid in enumerate(ids):
        m = b["response_mask"][i].tolist()
        check(f"live row {i}: GRPO advantage = reward", close(adv[i].tolist(), [leased[sid]["reward"] * x for x in m]))
    stats = admin.get("/v1/samples/stats").json()["samples"]
    check("leased, not consumed, while verl trains", stats.get("leased") == n and stats.get("consumed", 0) == 0, stats)
    mgr.ack_pending()
    stats = admin.get("/v1/samples/stats").json()["samples"]
    check("consumed once acked", stats.get("consumed") == n and stats.get("leased", 0) == 0, stats)
    admin.close()


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_dir, work = sys.argv[1], Path(sys.argv[2])
    check("verl version", verl.__version__ == "0.9.1", verl.__version__)
    cfg = config(model_dir)
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    reward_step(cfg, work, pad)
    teacher_step(cfg, work)
    print(f"verl checks passed: {len(CHECKS)}", flush=True)
    if len(sys.argv) > 3:
        CHECKS.clear()
        live_step(model_dir, int(sys.argv[3]))
        print(f"verl live checks passed: {len(CHECKS)}")


if __name__ == "__main__":
    main()
