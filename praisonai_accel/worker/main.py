"""The worker's entry point, the same for every launcher (praisonai_accel/train.py is the module they run).

Each rank writes everything it logs, tracebacks included, to output_dir/logs/rank-N.log; the console gets setup
facts, metrics and, when something fails, one line naming the log. How a run ended becomes its exit code through
one table (EXIT_CODES), and who says it through one rule per row.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from ..config import ConfigError, load_config
from ..data import DataError
from ..publish.gguf import after_training
from ..publish.hub import HubPublisher
from ..publish.ollama import publish
from ..run_dir.checkpoints import latest_complete
from ..run_dir.lock import RunLocked, lock_for_worker, release_worker_lock
from ..runtime.distributed import DistEnv
from ..runtime.exit import die_with_parent
from ..errors import INTERRUPTED_EXIT_CODE, first_line
from ..runtime.handoff import VERBOSE_ENV, HandoffFailed
from ..logs import FILE_ONLY, console_logging, log_to_file
from .failures import PEER_GONE, DiskFull, Interrupted, Preempted, explain, first_to_report
from .outputs import record_end
from .preflight import PreflightError
from .recipe import train

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as if the signal had ended us, but with a checkpoint on disk
PUBLISH_FAILED_EXIT_CODE = 4  # trained and saved, but a push or an Ollama create failed
FAILED_EXIT_CODE = 1
BAD_INPUT_EXIT_CODE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m praisonai_accel.train",
                                     description="Train as CONFIG describes; every launcher runs this module.")
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


def _exit_codes(config):
    # (error class, exit code, who prints its line, close the process group without waiting)
    # "local rank 0": every rank hits the same bad input, say it once per machine; "rank 0": once per job;
    # "first": the rank that hit it (its own rows), once per job.
    return [
        (PreflightError, BAD_INPUT_EXIT_CODE, "local rank 0", False),  # its all-reduce may still be pending
        ((ConfigError, DataError, HandoffFailed), BAD_INPUT_EXIT_CODE, "local rank 0", True),
        # the training method's own errors (methods/base.TrainingMethod.errors): the rank whose rows hit one says it
        *((kind, code, "first", True) for kind, code in type(config).training_method.errors),
        (DiskFull, FAILED_EXIT_CODE, "rank 0", True),
        (KeyboardInterrupt, INTERRUPTED_EXIT_CODE, "rank 0", False),  # Ctrl-C before training (setup)
        (Interrupted, INTERRUPTED_EXIT_CODE, "rank 0", True),  # Ctrl-C in training: the last step is saved
        (Preempted, PREEMPTED_EXIT_CODE, "rank 0", True),
    ]


def _message(exc: BaseException, config, env: DistEnv | None = None) -> str:
    if isinstance(exc, KeyboardInterrupt):  # before training began: only an earlier attempt's checkpoint is there
        latest = latest_complete(config.output_path(), warn=False)
        if latest is None:
            return "praisonai-accel: interrupted before training began; nothing to resume, a re-run starts from step 0"
        return f"praisonai-accel: interrupted before training began; re-run the same command to resume from {latest}"
    if isinstance(exc, Preempted):
        return f"praisonai-accel: {exc}; re-run the same command to resume"
    method_errors = tuple(kind for kind, _code in type(config).training_method.errors)
    if isinstance(exc, method_errors) and env is not None and env.world_size > 1:  # the rows were this rank's
        return f"error: rank {env.rank}: {exc}"
    return f"error: {exc}"


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
        return BAD_INPUT_EXIT_CODE

    try:
        lock_for_worker(config.output_path(), env.rank)  # started without the launcher: rank 0 holds output_dir
    except (RunLocked, OSError) as exc:
        print(f"error: {first_line(exc)}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    log_path = log_to_file(config.output_path(), env.rank)

    try:
        publisher = _hub_publisher(config, env)
        summary = train(config, publisher)
    except BaseException as exc:
        return _failed(exc, env, config, log_path)
    _close_process_group(wait_for_others=True)
    FILE_ONLY.info("rank %d done", env.rank)
    # From here on only rank 0 works, and no other rank waits for it.
    problems = publish_after_training(config, publisher, Path(summary["final_model_dir"])) if env.rank == 0 else []
    for problem in problems:
        print(f"error: {problem} (the trained model is safe in {summary['final_model_dir']})", file=sys.stderr)
    if problems:
        _record_end(config, "finished", PUBLISH_FAILED_EXIT_CODE, replaces=("finished",))
    return PUBLISH_FAILED_EXIT_CODE if problems else 0


def _failed(exc: BaseException, env: DistEnv, config, log_path: Path | None) -> int:
    for kinds, code, speaker, close in _exit_codes(config):
        if isinstance(exc, kinds):
            if code == BAD_INPUT_EXIT_CODE:
                logging.getLogger("praisonai_accel").debug("%s", exc)
            if speaker == "first":
                FILE_ONLY.error("rank %d: %s", env.rank, exc)
                speaks = first_to_report(config.output_path())
            else:
                speaks = (env.local_rank if speaker == "local rank 0" else env.rank) == 0
            if speaks:
                print(_message(exc, config, env), file=sys.stderr)
            if env.rank == 0:
                _record_end(config, "interrupted" if code == INTERRUPTED_EXIT_CODE else "failed", code)
            if close:
                _close_process_group(wait_for_others=False)
            return code
    if not isinstance(exc, Exception):  # SystemExit and the like are not ours to translate
        raise exc
    # Anything else: the traceback goes to the rank's log, one line to the console (once, and not from a rank
    # that only lost its peer: its line would mislead).
    FILE_ONLY.error("rank %d failed:\n%s", env.rank, traceback.format_exc())
    if not any(marker in str(exc) for marker in PEER_GONE) and first_to_report(config.output_path()):
        where = f" (full log: {log_path})" if log_path else ""
        print(f"error: rank {env.rank}: {explain(exc)}{where}", file=sys.stderr)
    if env.rank == 0:
        _record_end(config, "failed", FAILED_EXIT_CODE)
    _close_process_group(wait_for_others=False)
    return FAILED_EXIT_CODE


def _record_end(config, status: str, code: int, replaces: tuple[str, ...] = ("running",)) -> None:
    try:
        record_end(config.output_path(), status, code, replaces)
    except OSError:  # the output_dir itself may be what failed
        pass


def _hub_publisher(config, env: DistEnv):
    if not config.push_to_hub or env.rank != 0:
        return None

    return HubPublisher(config)


def publish_after_training(config, publisher, final_dir: Path) -> list[str]:
    """Wait for Hub uploads, write the GGUF files asked for, then create the Ollama model; one line per failure."""
    problems = publisher.wait() if publisher is not None else []
    problems += after_training(config, final_dir)  # save_gguf, huggingface_save_gguf, ollama_save (FROM the GGUF)
    if config.ollama_model and not config.ollama_save:
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


def exit_now(code: int) -> None:
    """Leave without interpreter teardown once everything is written and flushed (runtime/exit.py says why), and
    without the exit handlers: the run's own ends (trackers, the process group, the lock) are closed here already."""
    from ..runtime.exit import exit_without_teardown

    release_worker_lock()
    exit_without_teardown(code, exit_handlers=False)
