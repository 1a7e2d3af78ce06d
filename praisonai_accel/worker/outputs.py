"""What a run leaves behind besides checkpoints: the final model directory, progress.json, train_summary.json,
metrics.jsonl trimmed on resume, the loss plot; and the clean-up of what an interrupted run left half-done."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from ..atomic import write_json_atomic
from ..config import ConfigError, TrainConfig
from ..data.processor_files import save_processing
from ..run_dir.output_dirs import NotOurs, replace_with
from . import checkpoint as ckpt
from ..run_dir import checkpoints as ckpt_dir
from ..run_dir.metrics import headline_names, read_metrics
from ..run_dir.report import write_loss_plot
from .metrics import short_name

log = logging.getLogger("praisonai_accel")


def save_final_model(accelerator, model, tokenizer, config: TrainConfig, card: str | None = None,
                     processor=None) -> None:
    """Rank 0 writes the adapter (or full model), tokenizer and model card; the directory appears complete or not at
    all, and replaces only an earlier final model of ours (checked before launch, and again here). A vision-language
    model's processor (`processor`, else the one its tokenizer carries) is saved whole, with the tokenizer."""
    import os

    target = config.final_model_path()
    causal_lm, state_dict = ckpt.trained_model_and_state(accelerator, model, trainable_only=config.uses_lora)
    if accelerator.is_main_process:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        causal_lm.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        save_processing(tokenizer, tmp, processor)
        if card is not None:
            (tmp / "README.md").write_text(card)
        try:
            replace_with(tmp, target, "final_model_dir", kind="adapter" if config.uses_lora else "model",
                         trust_remote_code=config.trust_remote_code, revision=config.revision,
                         base_model=config.model_name)  # eval --base of a full fine-tune scores it
        except NotOurs as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"{exc} (the checkpoints in {config.output_dir} are intact)") from None
    accelerator.wait_for_everyone()


def parameter_digest(model) -> str:
    """Hash of this rank's trainable weights: equal on every rank iff DDP kept them in sync."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            value = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2 shards are DTensors
            digest.update(name.encode())
            digest.update(value.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def peak_gpu_memory_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def write_progress(output_dir: Path, status: str, global_step: int, total_steps: int, num_processes: int,
                   final_model_dir: Path, method: str, config_dir: str | None, headline=(), config_file=None,
                   run: tuple[str, dict] | None = None, **ended) -> None:
    """output_dir/progress.json: what `report` reads of a run in progress or ended (rank 0 calls this). `status`:
    running, finished, interrupted (Ctrl-C), preempted (SIGTERM / SIGUSR1) or failed; `ended` adds how (signal,
    exit_code). The method (and the config's directory, where a method's module may be) say which rows the method
    adds; `headline` its headline metrics; `config_file` the config it was started with (export gguf reads its rows);
    `run` its (run_fingerprint, run_identity): another run is refused this output_dir once it has finished."""
    import time

    fingerprint, identity = run or (None, None)
    write_json_atomic({"status": status, "global_step": global_step, "total_steps": total_steps,
                       "num_processes": num_processes, "updated": time.time(), "final_model_dir": str(final_model_dir),
                       "headline_metrics": list(headline), "method": method,
                       "config_dir": config_dir, "config_file": config_file, "run_fingerprint": fingerprint,
                       "run_identity": identity, **ended}, output_dir / "progress.json")


def record_end(output_dir: Path, status: str, exit_code: int, replaces: tuple[str, ...] = ("running",)) -> None:
    """How a run that stopped outside the training loop ended (an error, Ctrl-C during setup, a failed push after
    training), into progress.json; a status other than `replaces` (what the loop wrote on its way out) is kept."""
    import time

    path = Path(output_dir) / "progress.json"
    try:
        progress = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # never started training: nothing to say it was running
    if progress.get("status") not in replaces:
        return
    progress.update(status=status, exit_code=exit_code, updated=time.time())
    write_json_atomic(progress, path)


def end_summary(summary: dict, metrics, adapter: bool, resumed_from: Path | None) -> list[str]:
    """The few lines a run ends with: time, loss and the headline metrics first -> last, evaluation, best
    checkpoint, where the model is. `metrics`: the run's MetricsLogger (this attempt's first and last records)."""
    seconds = summary.get("train_seconds") or 0
    minutes, secs = divmod(int(seconds), 60)
    resumed = f", resumed from {resumed_from.name}" if resumed_from else ""
    lines = [f"done: {summary['global_step']} steps in {minutes}m {secs:02d}s on {summary['num_processes']} "
             f"process(es){resumed}"]
    first, last = metrics.first, metrics.last
    if first and last:
        changes = [f"loss {first['loss']:.4f} -> {last['loss']:.4f}"]
        for name in headline_names(metrics.headline, last):
            if first.get(name) is not None and last.get(name) is not None:
                changes.append(f"{short_name(name)} {first[name]:.4f} -> {last[name]:.4f}")
        lines.append(" | ".join(changes))
    evaluated = metrics.last_eval
    if evaluated:
        best = (f" | best checkpoint: {summary['best_checkpoint']} ({summary['best_metric']:.4f})"
                if summary.get("best_checkpoint") and summary.get("best_metric") is not None else "")
        shown = [f"{name} {evaluated[name]:.4f}" for name in ["eval_loss", *(k for k in evaluated if metrics.scores
                                                                          and k.startswith(metrics.scores))]
                 if evaluated.get(name) is not None]
        lines.append(f"{' | '.join(shown)} at step {evaluated['step']}{best}")
    lines.append(f"saved {'adapter' if adapter else 'model'} to {summary['final_model_dir']}")
    return lines


def trim_metrics_after(output_dir: Path, step: int) -> None:
    """On resume, forget metric lines of steps that will be trained again (rank 0 calls this)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return
    kept = [record for record in read_metrics(path) if record.get("step", 0) <= step]
    path.write_text("".join(json.dumps(record) + "\n" for record in kept))


def remove_stale_push_snapshots(output_dir: Path) -> None:
    """Hub-push snapshots (hub.py's .push-*) left by a run that died mid-upload; nothing else is touched."""
    for path in output_dir.glob(".push-*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def clean_up_interrupted_saves(config: TrainConfig, resuming: bool) -> None:
    """Rank 0, before training: what an earlier attempt left half-written (never a complete checkpoint of ours,
    unless overwrite_output_dir says to start over)."""
    output_dir = config.output_path()
    if config.overwrite_output_dir and not resuming:
        ckpt_dir.clear_checkpoints(output_dir)
    ckpt_dir.remove_stale_temporaries(output_dir)
    remove_stale_push_snapshots(output_dir)


def write_summary(summary: dict, output_dir: Path, plot_loss: bool) -> None:
    """train_summary.json and, if asked, loss.png (rank 0 calls this)."""
    write_json_atomic(summary, output_dir / "train_summary.json")
    if plot_loss:
        plot = write_loss_plot(output_dir)
        if plot is not None:
            log.info("loss plot: %s", plot)
