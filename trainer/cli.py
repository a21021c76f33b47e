"""``hindsight-train``: parse the command line (trainer/settings.py; the PRM file through trainer/prm.py),
configure logging once, run the loop.

    HINDSIGHT_TRAIN_ADMIN_API_KEY=K hindsight-train --policy-url URL --model-path DIR --out-dir DIR \
        [--steps N] [--batch-size B] [--lr F] [--config FILE] ...
    torchrun --nproc-per-node 2 -m trainer.cli ...      # DDP; rank 0 talks to the policy server

Exit status: 0 when the requested steps (or the sample file) are done, 2 on bad flags, 1 on a trainer
failure (policy server unreachable past its deadline, refused weight update, diverged replicas).
"""

from __future__ import annotations

import logging
import os
import sys

from engine.cli_settings import parse_cli
from trainer.lease_client import TrainerError
from trainer.prm import resolve_prm_config
from trainer.settings import DESCRIPTION, PROG, TrainConfig


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from flags > env > ``--config`` file > defaults, PRM file applied and validated; exits 2
    with the reason when invalid."""
    cfg = parse_cli(TrainConfig, argv, prog=PROG, description=DESCRIPTION)
    try:
        cfg = resolve_prm_config(cfg)
        cfg.check_consistency()
    except ValueError as exc:
        print(f"{PROG}: invalid configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from trainer.train import train

    try:
        result = train(cfg)
        import torch.distributed as dist

        if dist.is_initialized():
            # Every rank leaves its last collective before any rank tears the group down: a rank that
            # destroys it early closes gloo's sockets under a peer still inside an all-reduce (SIGABRT).
            dist.barrier()
    except TrainerError as exc:
        logging.getLogger("trainer").error("training stopped: %s", exc)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    logging.getLogger("trainer").info("done: %s", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
