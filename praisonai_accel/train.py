"""Training entry point for every launcher:

    python -m praisonai_accel.train CONFIG
    accelerate launch -m praisonai_accel.train CONFIG
    torchrun --nproc_per_node=N -m praisonai_accel.train CONFIG
    python -m praisonai_accel.train train --config CONFIG      (the PraisonAI seed's form)

Each rank writes everything it logs, tracebacks included, to output_dir/logs/rank-N.log; the console
gets setup facts, metrics and, when something fails, one line naming the log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from .config import ConfigError, load_config
from .data import DataError
from .distributed import VERBOSE_ENV, DistEnv, attempt_id, die_with_parent
from .errors import first_line

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as if the signal had ended us, but with a checkpoint on disk
PUBLISH_FAILED_EXIT_CODE = 4  # trained and saved, but a push or an Ollama create failed
FAILED_EXIT_CODE = 1

# Errors a rank sees when another rank has already died: its own line would only mislead.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "recvBytes", "NCCL communicator was aborted",
              "Socket Timeout", "failed to recv", "Connection refused")
_COLLECTIVE_TIMEOUT = ("a collective timed out after ddp_timeout: another rank is slower or stuck (its log says "
                       "where); raise ddp_timeout if it is only slow")
_HINTS = {
    "Expected to have finished reduction": (
        "DDP found parameters that received no gradient in this step (a vision tower or MoE experts unused by "
        "text-only data); set ddp_find_unused_parameters: true"),
    "mark a variable ready only once": (
        "a parameter was marked ready twice in one backward under DDP: reentrant gradient checkpointing with "
        "unused-parameter detection; leave ddp_find_unused_parameters unset, or use use_gradient_checkpointing: true"),
    "Timed out waiting": _COLLECTIVE_TIMEOUT,
    "collective operation timeout": _COLLECTIVE_TIMEOUT,  # NCCL's watchdog
    "CUDA out of memory": "out of GPU memory; lower per_device_train_batch_size or max_seq_length, or turn on "
                          "use_gradient_checkpointing",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m praisonai_accel.train", description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="CONFIG, or: train --config CONFIG")
    parser.add_argument("--config", help="path to config.yaml")
    args = parser.parse_args(argv)
    words = list(args.words)
    if words[:1] == ["train"]:
        words = words[1:]
    if args.config and not words:
        words = [args.config]
    if len(words) != 1:
        parser.error("expected one config file: CONFIG or train --config CONFIG")
    args.config = words[0]
    return args


_FILE_ONLY = logging.getLogger("praisonai_accel.file")  # to the rank's log file only, never the console
_FILE_ONLY.propagate = False
_FILE_ONLY.setLevel(logging.INFO)


def log_to_file(output_dir: Path, rank: int) -> Path | None:
    """Everything this rank logs goes to output_dir/logs/rank-N.log, at INFO level, whatever the console shows."""
    path = Path(output_dir) / "logs" / f"rank-{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, mode="a")
    except OSError:
        return None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    _FILE_ONLY.addHandler(handler)
    logging.captureWarnings(True)
    return path


def console_logging(rank: int) -> None:
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(console)
    root.setLevel(logging.INFO)


def _first_to_report(output_dir: Path) -> bool:
    """Ranks failing together (every rank hits the same DDP error) say it once: the first to claim this attempt's
    marker in the shared output_dir prints, the others only log."""
    attempt = attempt_id()
    try:
        os.close(os.open(Path(output_dir) / "logs" / f".reported-{attempt}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {first_line(exc, '')}".rstrip(": ")
    hint = next((hint for marker, hint in _HINTS.items() if marker in str(exc)), None)
    return hint or text


def return_freed_memory_promptly() -> None:
    """Serve allocations of 4 MiB and more with mmap, so freed large buffers go back to the OS at once.

    glibc raises its mmap threshold each time such a block is freed (up to 32 MiB), after which freed
    activation and logit buffers stay in the heap and peak RSS climbs by hundreds of MiB on long rows.
    Not lower: every mmap'd block is page-faulted in afresh, and at 1 MiB the faults of a small model's
    activations took a third of the step (bench/run.py, realistic case).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        M_MMAP_THRESHOLD = -3
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 4 << 20)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return_freed_memory_promptly()
    env = DistEnv.from_environ()
    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get(VERBOSE_ENV) != "1":
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # per-rank C++ reducer warnings; read when torch loads
    console_logging(env.rank)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        if env.local_rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    log_path = log_to_file(config.output_path(), env.rank)
    where = f" (full log: {log_path})" if log_path else ""
    from .preflight import PreflightError
    from .trainer import DiskFull, Preempted, train

    try:
        publisher = _hub_publisher(config, env)
        summary = train(config, publisher)
    except (ConfigError, DataError) as exc:
        logging.getLogger("praisonai_accel").debug("%s", exc)
        if env.local_rank == 0:  # every rank hits the same bad input; say it once
            print(f"error: {exc}", file=sys.stderr)
        if not isinstance(exc, PreflightError):  # its all-reduce may still be pending: destroying would wait for it
            _close_process_group(wait_for_others=False)
        return 2
    except DiskFull as exc:
        if env.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return FAILED_EXIT_CODE
    except KeyboardInterrupt:
        if env.rank == 0:
            print("praisonai-accel: interrupted; re-run the same command to resume from the last checkpoint", file=sys.stderr)
        return 130
    except Preempted as stop:
        if env.rank == 0:
            print(f"praisonai-accel: {stop}; re-run the same command to resume", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return PREEMPTED_EXIT_CODE
    except Exception as exc:  # anything else: the traceback goes to the rank's log, one line to the console
        _FILE_ONLY.error("rank %d failed:\n%s", env.rank, traceback.format_exc())
        if not any(marker in str(exc) for marker in _PEER_GONE) and _first_to_report(config.output_path()):
            print(f"error: rank {env.rank}: {explain(exc)}{where}", file=sys.stderr)
        _close_process_group(wait_for_others=False)
        return FAILED_EXIT_CODE
    _close_process_group(wait_for_others=True)
    _FILE_ONLY.info("rank %d done", env.rank)
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
    from .gguf_export import after_training  # save_gguf, huggingface_save_gguf, ollama_save (Ollama FROM the GGUF)

    problems += after_training(config, final_dir)
    if config.ollama_model and not config.ollama_save:
        from .ollama_publish import publish

        try:
            modelfile = publish(final_dir, config.ollama_model, ollama_base=config.ollama_base, push=config.ollama_push,
                                trust_remote_code=config.trust_remote_code)
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
    """Leave without interpreter teardown once everything is written and flushed. Under DDP, gloo's threads
    can call std::terminate there ("terminate called without an active exception"), turning a finished run
    into SIGABRT; and tearing down torch, transformers and their modules takes more than a second on its own."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
