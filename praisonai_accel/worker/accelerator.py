"""The worker's Accelerator: DDP / FSDP2 settings, mixed precision, trackers, and the checks that every rank sees
output_dir and the preprocessing cache the way rank 0 does."""

from __future__ import annotations

import contextlib
import datetime
import functools
import io
import logging
import os
from contextlib import nullcontext
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..methods.context import RunContext
from ..runtime.distributed import attempt_id, ddp_backend_kwargs, fsdp_requested, resolve_mixed_precision

log = logging.getLogger("praisonai_accel")


def build_accelerator(config: TrainConfig, distributed: bool, reentrant: bool, use_cuda: bool, bf16: bool):
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration,
    )

    precision = resolve_mixed_precision(config.mixed_precision, use_cuda, bf16)
    find_unused = config.ddp_find_unused_parameters
    if find_unused is None:
        find_unused = distributed and not reentrant
    accelerator = Accelerator(
        mixed_precision=precision,
        cpu=not use_cuda,
        gradient_accumulation_steps=1,  # accumulation is done by the recipe: the loss is normalised over the step
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused),
                         InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=config.ddp_timeout),
                                                **ddp_backend_kwargs())],
        log_with=config.trackers or None,
        project_config=ProjectConfiguration(project_dir=config.output_dir,
                                            logging_dir=str(config.output_path() / "runs"),
                                            automatic_checkpoint_naming=False),
    )
    if not use_cuda and distributed and fsdp_requested():
        select_fsdp_on_cpu(accelerator)
    return accelerator


def select_fsdp_on_cpu(accelerator) -> None:
    """The one seam where CPU processes get real FSDP2 over gloo.

    Accelerate picks FSDP only for GPU-like devices (state.py), so on CPU an FSDP config silently became DDP. Its
    FSDP2 path itself (fully_shard, DTensor state dicts) runs on CPU over gloo, so the state is switched to FSDP
    with the plugin the launch config describes; everything after this is the GPU code path."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch exported
    if plugin.fsdp_version != 2:
        raise ConfigError("fsdp_version: only FSDP2 is supported (fsdp_version: 2 in the accelerate config)")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's fields each time it is instantiated (accelerate does that during
    # prepare), so both say FSDP; every collective accelerate runs treats FSDP like any torch.distributed type.
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP


def sees_what_rank0_wrote(accelerator, directory: Path) -> bool:
    """Whether this rank sees a file rank 0 has just written in `directory` (shared storage)."""
    probe = directory / ".praisonai_shared_check"
    token = os.environ.get("TORCHELASTIC_RUN_ID", "") + attempt_id()
    if accelerator.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    accelerator.wait_for_everyone()
    try:
        seen = probe.is_file() and probe.read_text() == token
    except OSError:
        seen = False
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        probe.unlink(missing_ok=True)
    return seen


def check_shared_output_dir(accelerator, output_dir: Path) -> None:
    """Every rank must see what rank 0 writes in output_dir, or checkpoints and resume cannot work across nodes."""
    import torch

    seen = sees_what_rank0_wrote(accelerator, output_dir)
    missing = accelerator.reduce(torch.tensor([0.0 if seen else 1.0], device=accelerator.device), "sum")
    if float(missing[0]) > 0:
        raise ConfigError(
            f"output_dir: {int(missing[0])} process(es) cannot see what rank 0 wrote in {output_dir}; with several "
            "nodes, output_dir must be on storage all nodes share (NFS, Lustre, a mounted bucket)"
        )


def start_trackers(accelerator, config: TrainConfig, verbose: bool) -> None:
    """Rank 0 starts the experiment trackers of report_to; mlflow without a server gets a file store in output_dir."""
    if not config.trackers or not accelerator.is_main_process:
        return
    output_dir = config.output_path()
    if "mlflow" in config.trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        # no server given: a file store in output_dir (mlflow keeps it only behind this opt-in)
        os.environ["MLFLOW_TRACKING_URI"] = (output_dir / "mlruns").resolve().as_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if not verbose:
        os.environ.setdefault("WANDB_SILENT", "true")
    with quiet_stdout(verbose):  # trackers announce themselves with print()
        accelerator.init_trackers(config.run_name or output_dir.resolve().name, config=tracker_config(config))


def run_context(accelerator, tokenizer, config: TrainConfig):
    """What the training method is handed by TrainingMethod.set_up: nothing it must find for itself."""
    return RunContext(accelerator, tokenizer, config.output_path(), functools.partial(log_table, accelerator,
                                                                                       config.trackers))


def log_table(accelerator, trackers: list[str], name: str, columns: list[str], rows: list[list], step: int) -> None:
    """A table to the trackers that show one (a method logs through RunContext.log_table): TensorBoard gets it as
    markdown text, wandb as a Table; mlflow and trackio log numbers only."""
    if "tensorboard" in trackers:
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
        accelerator.get_tracker("tensorboard", unwrap=True).add_text(name, "\n".join(lines), global_step=step)
    if "wandb" in trackers:
        import wandb

        data = [[step, *(value if isinstance(value, (int, float)) else str(value) for value in row)] for row in rows]
        accelerator.get_tracker("wandb", unwrap=True).log({name: wandb.Table(columns=["step", *columns], data=data)},
                                                          step=step)


def track_loader(accelerator, add=None, remove=None) -> None:
    """Accelerate checkpoints (save_state / load_state) the sampler state of the loaders in its private
    `_dataloaders` list, and adds a loader there only through `prepare`, which shards it by process; it offers no
    public way to register a loader sharded otherwise (a sequence-parallel group reads the same rows) or to drop one
    a method replaced (the preference methods' loader with precomputed reference log-probs). This is the one place
    that touches the list: the run's checkpoints then hold its one training loader, as without either."""
    if remove is not None:
        accelerator._dataloaders.remove(remove)
    if add is not None:
        accelerator._dataloaders.append(add)


def tracker_config(config: TrainConfig) -> dict:
    """The run's settings as trackers store them: scalars, lists and mappings as text."""
    values = {}
    for key, value in config.model_dump(mode="json").items():
        values[key] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return values


def quiet_stdout(verbose: bool):
    return nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
