"""A run's checkpoints on disk: their layout, which are complete and intact, where a run resumes, rotation.

No torch here: the launcher, `checks` and `report` read a run directory with it; worker/checkpoint.py saves and
loads the state itself. The layout of output_dir/checkpoint-<step>/ is described there.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import ConfigError
from . import manifest

log = logging.getLogger("praisonai_accel")

STATE_FILE = "praisonai_state.json"
SCHEDULER_FILE = "scheduler.json"
MARKER = "COMPLETE"
DATA_SUFFIXES = {".safetensors", ".json", ".txt", ".jinja", ".model", ".md"}  # read as data, never as code
_NAME = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class CheckpointState:
    global_step: int
    epoch: int
    batches_in_epoch: int  # micro-batches each rank consumed in `epoch`
    samples_in_epoch: int  # over all ranks, so another world size can find the same place
    samples_seen: int
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    run_fingerprint: str
    config_fingerprint: str
    first_loss: float | None = None  # first and latest logged training loss, for the summary and model card
    last_loss: float | None = None
    best_metric: float | None = None
    best_checkpoint: str | None = None
    evals_without_improvement: int = 0
    run_identity: dict | None = None  # what run_fingerprint hashes, so a refusal can say what differs
    model_commit: str | None = None  # the Hub commit of the base model's weights (None for a local folder)

    def write(self, directory: Path) -> None:
        (Path(directory) / STATE_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, directory: Path) -> "CheckpointState":
        path = Path(directory) / STATE_FILE
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"resume_from_checkpoint: {path} is not a checkpoint state this version wrote ({exc})") from None


def step_of(path: Path) -> int:
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else -1


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def checkpoints(output_dir: Path) -> list[Path]:
    """Every checkpoint-<step> directory, complete or not, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted((p for p in output_dir.iterdir() if p.is_dir() and _NAME.match(p.name)), key=step_of)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    return [p for p in checkpoints(output_dir) if is_complete(p)]


def latest_complete(output_dir: Path, warn: bool = True) -> Path | None:
    for path in reversed(checkpoints(output_dir)):
        if is_complete(path):
            return path
        if warn:
            log.warning("skipping incomplete checkpoint %s (no %s marker)", path, MARKER)
    return None


def latest_intact(output_dir: Path) -> Path:
    """The newest complete checkpoint whose files match its manifest and can be read; each newer one that fails is
    named in one warning line (a requeued job heals by itself). Refuses when none is intact."""
    failed = []
    for path in reversed(checkpoints(output_dir)):
        if not is_complete(path):
            log.warning("skipping incomplete checkpoint %s (no %s marker)", path, MARKER)
            continue
        reason, said = trouble(path)
        if reason is None:
            return path
        failed.append(f"{path.name}: {reason}")
        manifest.SKIPPED.append(path)
        say = logging.getLogger("praisonai_accel.file").info if said else log.warning  # the launcher said it already
        say("warning: skipping %s, which failed verification: %s; resuming from an older checkpoint", path.name, reason)
    raise ConfigError(f"output_dir: no checkpoint in {output_dir} is intact ({'; '.join(failed[:2])}); move them "
                      "away, or set overwrite_output_dir: true to start over")


def trouble(path: Path) -> tuple[str | None, bool]:
    """Why a complete checkpoint cannot be resumed from (damaged, unreadable) or None, and whether the launcher
    already said so. A file whose pickle would run code is not damage: UnsafeCheckpoint, refused, never skipped."""
    reason, said = manifest.checked(path, MARKER)
    try:
        check_safe_to_load(path)
        if reason is None:
            CheckpointState.read(path)
    except UnsafeCheckpoint:
        raise
    except ConfigError as exc:
        reason = reason or str(exc).removeprefix("resume_from_checkpoint: ")
    manifest.remember(path, reason)
    return reason, said


def differences(saved: CheckpointState, identity: dict) -> str:
    """The keys that make the checkpoint's run another run, as the user wrote them."""
    return differing_keys(saved.run_identity, identity)


def differing_keys(saved: dict | None, identity: dict) -> str:
    if saved is None:
        return "model, data, LoRA or seed"
    keys = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
    return ", ".join(keys) or "the run fingerprint"


def refuse_another_finished_run(output_dir: Path, run_fingerprint: str, identity: dict) -> None:
    """An output_dir without checkpoints (save_strategy: no, the default) may still hold a finished run: its final
    model, metrics and summary, which another run would replace. Refused as another run's checkpoints are; the same
    run again trains from step 0 (there is nothing to resume from); a run that never finished has nothing to lose."""
    try:
        progress = json.loads((Path(output_dir) / "progress.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(progress, dict):
        return
    saved = progress.get("run_fingerprint")
    if progress.get("status") != "finished" or saved is None or saved == run_fingerprint:
        return
    differ = differing_keys(progress.get("run_identity"), identity)
    raise ConfigError(
        f"output_dir: {output_dir} holds a finished run of another config ({differ} differ), its model in "
        f"{progress.get('final_model_dir')}; use another output_dir, or overwrite_output_dir: true to replace it")


def checkpoint_to_resume(output_dir: Path, resume: bool | str, run_fingerprint: str, overwrite: bool,
                         identity: dict | None = None, force: bool = False) -> Path | None:
    """Which checkpoint this run starts from, or None for a fresh start; refuses to mix runs and to load anything
    that would run code. `force` (force_resume) lets an explicit path of another run through, on purpose."""
    identity = identity or {}
    if isinstance(resume, str):
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"resume_from_checkpoint: no such checkpoint directory '{resume}'")
        if not is_complete(path):
            raise ConfigError(f"resume_from_checkpoint: '{resume}' is incomplete (no {MARKER} marker); it was interrupted while saving")
        if reason := trouble(path)[0]:
            raise ConfigError(f"resume_from_checkpoint: '{resume}' failed verification: {reason}; nothing was loaded or deleted")
        saved = CheckpointState.read(path)
        if saved.run_fingerprint != run_fingerprint and not force:
            raise ConfigError(
                f"resume_from_checkpoint: '{resume}' belongs to another run ({differences(saved, identity)} differ); "
                "set force_resume: true to start from it anyway"
            )
        check_safe_to_load(path)
        return path
    existing = complete_checkpoints(output_dir)
    if overwrite:
        return None
    if not existing:
        refuse_another_finished_run(output_dir, run_fingerprint, identity)
        return None
    if resume is False:
        raise ConfigError(
            f"output_dir: {output_dir} already holds checkpoints ({existing[-1].name}); set resume_from_checkpoint: true "
            "to continue, or overwrite_output_dir: true to start over"
        )
    latest = latest_intact(output_dir)
    saved = CheckpointState.read(latest)
    if saved.run_fingerprint != run_fingerprint:
        raise ConfigError(
            f"output_dir: {output_dir} holds checkpoints of another run ({differences(saved, identity)} differ); "
            "use another output_dir, or overwrite_output_dir: true to start over"
        )
    check_safe_to_load(latest)
    return latest


def resume_skip(state: CheckpointState, world: int, per_device: int,
                examples_per_batch: int | None = None) -> tuple[int, str | None]:
    """Micro-batches each rank skips in the resumed epoch, and a warning if the layout changed.

    The sampler's order does not depend on the world size, so the same samples can be skipped
    as long as they fill whole global batches of the new layout; otherwise refuse.
    """
    if state.world_size == world and state.per_device_train_batch_size == per_device:
        return state.batches_in_epoch, None
    # the loader's examples per batch (GRPO: prompts; its per_device_train_batch_size counts completions)
    global_batch = world * (examples_per_batch or per_device)
    if state.samples_in_epoch % global_batch:
        raise ConfigError(
            f"resume_from_checkpoint: the checkpoint was taken after {state.samples_in_epoch} samples of epoch "
            f"{state.epoch} with {state.world_size} process(es) x batch {state.per_device_train_batch_size}; "
            f"{world} process(es) x batch {per_device} cannot continue at exactly that sample; resume with the original layout"
        )
    return state.samples_in_epoch // global_batch, (
        f"resuming with {world} process(es) x batch {per_device} (checkpoint: {state.world_size} x "
        f"{state.per_device_train_batch_size}); continuing at sample {state.samples_in_epoch} of epoch {state.epoch}"
    )


def clear_checkpoints(output_dir: Path) -> None:
    for path in checkpoints(output_dir) + list(Path(output_dir).glob("checkpoint-*.tmp")):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(output_dir: Path) -> None:
    """Leftovers of a save that was killed half-way."""
    for path in Path(output_dir).glob("checkpoint-*.tmp"):
        log.warning("removing %s, left by a save that was interrupted", path)
        shutil.rmtree(path, ignore_errors=True)


def rotate(output_dir: Path, limit: int | None, keep: str | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit`, never the newest nor the best one (so a limit of 1
    keeps two when the best is older than the newest, as transformers does); returns what was deleted."""
    if not limit:
        return []
    complete = complete_checkpoints(output_dir)
    protected = {p.name for p in complete[-1:]} | ({Path(keep).name} if keep else set())
    removable = [p for p in complete if p.name not in protected]
    excess = len(complete) - max(limit, len(protected))
    deleted = removable[: max(excess, 0)]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file whose pickle would call something other than tensor and RNG-state constructors."""


def _torch_files(checkpoint: Path) -> list[Path]:
    """The files of a checkpoint that Accelerate reads with torch.load (the adapter/ folder is never loaded)."""
    return sorted(p for p in Path(checkpoint).iterdir() if p.is_file() and p.suffix not in DATA_SUFFIXES
                  and p.name != MARKER)


def check_safe_to_load(checkpoint: Path) -> None:
    """Refuse, naming the file, any checkpoint file whose pickle would call something other than the tensor, number
    and RNG-state constructors that weights_only loading allows. Nothing is unpickled to find out."""
    import torch
    from accelerate.utils.other import TORCH_SAFE_GLOBALS  # the numpy RNG-state types accelerate's load allows

    for path in _torch_files(checkpoint):
        try:
            with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception as exc:  # not a torch.save archive: a bare pickle, or garbage
            raise ConfigError(f"resume_from_checkpoint: {path} cannot be loaded safely (not a torch.save archive: "
                              f"{type(exc).__name__}); refusing to resume from {Path(checkpoint).name}") from None
        if unsafe:
            raise UnsafeCheckpoint(f"resume_from_checkpoint: {path} cannot be loaded safely (its pickle calls "
                              f"{', '.join(sorted(unsafe)[:3])}); refusing to resume from {Path(checkpoint).name}")
