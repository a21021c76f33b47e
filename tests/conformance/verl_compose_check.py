"""Compose each given verl ``main_ppo`` command line with verl's own Hydra config and validate it (verl's venv).

    python verl_compose_check.py '<json list of {"overrides": [...], "validate": bool}>'

Prints one JSON line per command line: ``{"ok": true, "manager": ..., "nnodes": ...}`` or ``{"ok": false,
"error": ...}``. Run by tests/conformance/test_verl_ray_recipe.py in the venv of tests/conformance/make_verl_venv.sh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import verl.trainer.main_ppo as main_ppo
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf


def check(overrides: list[str], validate: bool) -> dict[str, object]:
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).with_name("config")), version_base=None):
        try:
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
            if validate:  # what main_ppo.main runs before it starts Ray (a complete command line only)
                main_ppo.validate_config(
                    config=cfg,
                    use_reference_policy=main_ppo.need_reference_policy(cfg),
                    use_critic=main_ppo.need_critic(cfg),
                )
        except Exception as exc:  # whatever verl raises is the finding: reported to the test with its message
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    rollout = cfg.actor_rollout_ref.rollout
    return {
        "ok": True,
        "manager": OmegaConf.select(rollout, "agent.agent_loop_manager_class"),
        "n": rollout.n,
        "use_v1": cfg.trainer.use_v1,
        "test_freq": cfg.trainer.test_freq,
        "val_before_train": cfg.trainer.val_before_train,
    }


if __name__ == "__main__":
    for command in json.loads(sys.argv[1]):
        print(json.dumps(check(command["overrides"], command["validate"])), flush=True)  # the test reads stdout
