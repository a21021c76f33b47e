"""The trainer side of process rewards: which AReaL shaping applies, from flags or the PRM YAML.

Role: turn ``--prm-config YAML`` (the same file the policy server gets) into the trainer's shaping settings,
so both sides read one file and cannot disagree. The file is parsed ONLY by ``prm``'s loader
(``load_prm_config``: pydantic, its validation rules, ``PRMConfigError`` naming each broken key).

Contract (docs/SCORERS.md; AReaL's advantage shaping):

- ``prm.advantage_shaping.mode`` -> ``shaping`` (additive | gvpo | process_weighted), its ``negative_scale``,
  ``zero_penalty``, ``zero_eps`` -> ``shaping_negative_scale``, ``shaping_zero_penalty``, ``shaping_eps``;
  ``actor.mask_no_eos_with_zero`` -> ``mask_no_eos_with_zero``.
- Shaping is on only when scoring is active (``prm.enabled`` and an enabled scorer) and
  ``actor.token_rewards_as_adv`` is true (AReaL applies shaping only in that mode; the loader already rejects
  ``false`` while scorers are active). Otherwise ``shaping`` is ``none``: samples carry no token_rewards.
- A flag given on the command line that contradicts the file (a value other than the flag's default and other
  than the file's) is an error, never silently overridden. Resolving twice is a no-op.
- Without ``--prm-config`` the flags alone decide (``--shaping``, ``--shaping-*``, ``--mask-no-eos-with-zero``).

Where it applies (trainer/objective.py): after the outcome advantage (RL baseline and optional std
normalisation over the whole batch, OPD/combine terms), on tokens of samples that carry ``token_rewards``
with loss mask 1; samples without ``token_rewards`` keep their outcome advantage (unshaped).
"""

from __future__ import annotations

from typing import Any

from trainer.settings import TrainConfig

# TrainConfig field -> how it is read from the validated file config.
_FROM_FILE = {
    "shaping_negative_scale": lambda fc: fc.prm.advantage_shaping.negative_scale,
    "shaping_zero_penalty": lambda fc: fc.prm.advantage_shaping.zero_penalty,
    "shaping_eps": lambda fc: fc.prm.advantage_shaping.zero_eps,
    "mask_no_eos_with_zero": lambda fc: fc.actor.mask_no_eos_with_zero,
}


def shaping_from_file(path: str) -> dict[str, Any]:
    """The TrainConfig values the PRM YAML at ``path`` implies (raises ``PRMConfigError``, a ValueError)."""
    from prm import load_prm_config

    fc = load_prm_config(path)
    on = fc.prm.active and fc.actor.token_rewards_as_adv
    values = {name: get(fc) for name, get in _FROM_FILE.items()}
    values["shaping"] = fc.prm.advantage_shaping.mode if on else "none"
    return values


def resolve_prm_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its shaping settings taken from ``cfg.prm_config`` (unchanged without one)."""
    if not cfg.prm_config:
        return cfg
    values = shaping_from_file(cfg.prm_config)
    defaults = {name: field.default for name, field in TrainConfig.model_fields.items()}
    conflicts = [
        f"--{name.replace('_', '-')} {getattr(cfg, name)!r} contradicts {value!r} from the file"
        for name, value in values.items()
        if getattr(cfg, name) != defaults[name] and getattr(cfg, name) != value
    ]
    if conflicts:
        raise ValueError(f"--prm-config {cfg.prm_config}: " + "; ".join(conflicts))
    return cfg.model_copy(update=values)
