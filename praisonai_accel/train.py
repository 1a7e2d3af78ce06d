"""Training entry point for every launcher:

    python -m praisonai_accel.train CONFIG
    accelerate launch -m praisonai_accel.train CONFIG
    torchrun --nproc_per_node=N -m praisonai_accel.train CONFIG
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .config import ConfigError, load_config
from .data import DataError
from .distributed import DistEnv, die_with_parent
from .errors import first_line

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as if the signal had ended us, but with a checkpoint on disk
PUBLISH_FAILED_EXIT_CODE = 4  # trained and saved, but a push or an Ollama create failed


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
        config = load_config(args.config)
        publisher = _hub_publisher(config, env)
        summary = train(config, publisher)
    except (ConfigError, DataError) as exc:
        if env.local_rank == 0:  # every rank hits the same bad input; say it once
            print(f"error: {exc}", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return 2
    except KeyboardInterrupt:
        if env.rank == 0:
            print("praisonai-accel: interrupted; re-run the same command to resume from the last checkpoint", file=sys.stderr)
        return 130
    except Preempted as stop:
        if env.rank == 0:
            print(f"praisonai-accel: {stop}; re-run the same command to resume", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return PREEMPTED_EXIT_CODE
    _close_process_group(wait_for_others=True)
    # From here on only rank 0 works, and no other rank waits for it.
    problems = publish_after_training(config, publisher, Path(summary["final_model_dir"])) if env.rank == 0 else []
    for problem in problems:
        print(f"error: {problem} (the trained model is safe in {summary['final_model_dir']})", file=sys.stderr)
    return PUBLISH_FAILED_EXIT_CODE if problems else 0


def _hub_publisher(config, env: DistEnv):
    if not config.push_to_hub or env.rank != 0:
        return None
    from .hub import HubPublisher

    return HubPublisher(config)


def publish_after_training(config, publisher, final_dir: Path) -> list[str]:
    """Wait for Hub uploads, then create the Ollama model; returns one line per failure."""
    problems = publisher.wait() if publisher is not None else []
    if config.ollama_model:
        from .ollama_publish import publish

        try:
            modelfile = publish(final_dir, config.ollama_model, ollama_base=config.ollama_base, push=config.ollama_push)
            print(f"praisonai-accel: created Ollama model {config.ollama_model} (Modelfile: {modelfile})", file=sys.stderr)
        except Exception as exc:  # server down, refused, missing base files: report, keep the model
            problems.append(f"ollama: could not create {config.ollama_model}: {type(exc).__name__}: {first_line(exc, '')}")
    return problems


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


def _exit(code: int) -> None:
    """Under DDP, leave without interpreter teardown: gloo's threads can call std::terminate there
    ("terminate called without an active exception"), turning a finished run into SIGABRT."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
