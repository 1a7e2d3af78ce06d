"""Training entry point for every launcher:

    python -m praisonai_accel.train CONFIG
    accelerate launch -m praisonai_accel.train CONFIG
    torchrun --nproc_per_node=N -m praisonai_accel.train CONFIG
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError, load_config
from .data import DataError
from .distributed import DistEnv, die_with_parent

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as if the signal had ended us, but with a checkpoint on disk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m praisonai_accel.train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="path to config.yaml")
    args = parser.parse_args(argv)
    env = DistEnv.from_environ()
    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .trainer import Preempted, train

    try:
        train(load_config(args.config))
    except (ConfigError, DataError) as exc:
        if env.local_rank == 0:  # every rank hits the same bad input; say it once
            print(f"error: {exc}", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return 2
    except Preempted as stop:
        if env.rank == 0:
            print(f"praisonai-accel: {stop}; re-run the same command to resume", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return PREEMPTED_EXIT_CODE
    _close_process_group(wait_for_others=True)
    return 0


def _close_process_group(wait_for_others: bool) -> None:
    """Without a final barrier + destroy, a rank can abort at interpreter exit.

    After an error the barrier is skipped: the other ranks may never reach it, and the
    launcher stops them once this rank exits.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait_for_others:
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
