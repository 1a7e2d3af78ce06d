"""Rules about a run that the CLI checks before launching anything and the worker checks again at setup (it may
have been started by `accelerate launch` or torchrun directly). Each rule is written once, here: it raises
ConfigError with the one line the user sees, and both callers show that line.

`RULES` is their one ordered list, each tagged with the phases it runs in: `launch` (before any process starts, by
`train`, `--ray`, `slurm` and `k8s` through launcher/prelaunch.check_launch), `worker` (at the worker's setup, before
the model loads) and `loaded` (once it has loaded: what needs the model's own config). A rule that reads the run's
files (output_dir, the model's folder) runs only where they are at hand: not when a Kubernetes manifest is generated
on a machine that will never see the pods' volume. `check_run` runs them.

Imported by the launcher and by the worker; imports only the config, the run directory, what a model takes
(data/vision_processor.ModelInputs), the method registry and (for sequence_parallel_size) sequence_parallel's pure
checks; the method's own rules are its class's check_config (method_rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import DEEPSPEED_REFUSED, REENTRANT_WITH_UNUSED, ConfigError, TrainConfig
from .data.vision_processor import ModelInputs
from .methods import method_for
from .run_dir import checkpoints as ckpt_dir
from .run_dir.output_dirs import check_replaceable
from .runtime.distributed import device_map_rule


@dataclass
class Situation:
    """Where the rules run and what is known there."""

    config: TrainConfig
    num_processes: int
    phase: str  # launch, worker or loaded
    sees_files: bool = True  # the run's output_dir and local model folder are on this machine
    model_config: Any = None  # the model's config: read from disk before launch where it can be, the loaded one after
    inputs: ModelInputs | None = None  # what the model takes besides text, as the caller decided it
    reentrant: bool | None = None  # the worker's answer (unsloth's checkpointing is reentrant too); None: the config's
    distributed_type: str | None = None  # the worker's Accelerator's


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[Situation], None]
    phases: tuple[str, ...]
    reads_files: bool = False


def reentrant_rule(config: TrainConfig, num_processes: int, reentrant: bool | None = None) -> None:
    """Reentrant checkpointing marks a parameter ready twice under DDP's unused-parameter detection. `reentrant`:
    what the worker knows (unsloth's checkpointing is reentrant too); the CLI reads the config."""
    if reentrant is None:
        reentrant = config.use_gradient_checkpointing == "reentrant"
    if num_processes > 1 and reentrant and config.ddp_find_unused_parameters:
        raise ConfigError(REENTRANT_WITH_UNUSED)


def deepspeed_rule(distributed_type: str, where: str) -> None:
    """`where` names what the user wrote: the --accelerate-config file, or the accelerate config a worker got."""
    if str(distributed_type).upper() == "DEEPSPEED":
        raise ConfigError(f"{where}: {DEEPSPEED_REFUSED}")


def final_model_dir_rule(config: TrainConfig) -> None:
    """The final save may replace only an earlier final model of ours."""
    check_replaceable(config.final_model_path(), "final_model_dir")


def resume_rule(config: TrainConfig, num_processes: int) -> tuple[Path | None, int, str | None]:
    """Where the run starts: (checkpoint or None, micro-batches each rank skips in the resumed epoch, a warning
    when the process layout changed). Refuses another run's checkpoints and a layout that cannot continue."""
    start = ckpt_dir.checkpoint_to_resume(config.output_path(), config.resume_from_checkpoint, config.run_fingerprint(),
                                      config.overwrite_output_dir, config.run_identity(), config.force_resume)
    if start is None:
        return None, 0, None
    # The ranks of a sequence-parallel group share their rows: the data-parallel size is what reads the data.
    per_device = config.per_device_train_batch_size
    saved, method = ckpt_dir.CheckpointState.read(start), method_for(config)
    world = num_processes // config.sequence_parallel_size
    if saved.global_step % method.steps_per_batch and (saved.world_size, saved.per_device_train_batch_size) != \
            (world, per_device):  # each process holds the rollout of its own prompts
        raise ConfigError(f"resume_from_checkpoint: {start.name} was taken mid-way through a generated batch's "
                          f"num_iterations: {method.steps_per_batch} steps by {saved.world_size} process(es) x batch "
                          f"{saved.per_device_train_batch_size}; resume it with that layout")
    skip, warning = ckpt_dir.resume_skip(saved, world, per_device, method.loader_batch_size(per_device))
    return start, skip, warning


def sequence_parallel_rule(config: TrainConfig, num_processes: int, model_config=None) -> None:
    """sequence_parallel_size: N needs a method that trains slices of rows, a number of processes that forms whole
    groups of N, and attention heads that split over N ranks. `model_config`: the model's (the worker's, once loaded),
    or None where the CLI cannot read it without downloading; the worker checks it then."""
    n = config.sequence_parallel_size
    if n <= 1:
        return
    from .models.sequence_parallel import check_sequence_parallel, check_world

    if not type(config).training_method.supports_sequence_parallel:
        raise ConfigError(f"sequence_parallel_size: method: {config.method} does not split its rows over ranks; "
                          "use sequence_parallel_size: 1 (or method: sft)")
    reason = check_world(num_processes, n) or (check_sequence_parallel(model_config, n) if model_config else None)
    if reason:
        raise ConfigError(reason)


def vision_rule(config: TrainConfig, takes_images: bool | None) -> None:
    """What a vision-language model cannot do here (packing rows with images, sequence parallelism, a method other
    than SFT), and vision keys written for a model that takes no images. `takes_images`: from the model's config
    (None: not known before launch, the worker checks it once the model loads)."""
    if takes_images is None:
        return
    if takes_images:
        if config.packing:
            raise ConfigError("packing: rows with images are not packed (an image's tokens and its pixels would have "
                              "to move together); set packing: false")
        if config.sequence_parallel_size > 1:
            raise ConfigError("sequence_parallel_size: a row's image tokens cannot be split over ranks; set it to 1")
        if not type(config).training_method.takes_images:
            raise ConfigError(f"method: {config.method}: {config.model_name} takes images, which only method: sft "
                              "trains so far; use method: sft")
        return
    written = config.vision_keys_written()
    if written:
        raise ConfigError(f"{written[0]}: {config.model_name} takes no images (its config names no vision tower, or "
                          f"no image processor is saved with it); remove {', '.join(written)}")


def offload_embedding_rule(config: TrainConfig, model_config=None, distributed_type: str | None = None) -> None:
    """offload_embedding keeps a frozen, untied input embedding in host memory (models/host_embedding.py): not a
    trained one (full), one FSDP would shard, a model a device_map places, or a table the LM head shares.
    `model_config`: the model's (None where the CLI cannot read it; the worker checks it once loaded)."""
    if not config.offload_embedding:
        return
    if config.finetune_type == "full":
        raise ConfigError("offload_embedding: the embedding trains under finetune_type: full and stays on the GPU; "
                          "use lora or qlora, or remove offload_embedding")
    if str(distributed_type).upper() == "FSDP":
        raise ConfigError("offload_embedding: FSDP shards the embedding with the rest of the model; remove "
                          "offload_embedding or --fsdp")
    if config.device_map not in (None, "cuda"):
        raise ConfigError("offload_embedding: device_map places the model itself; remove offload_embedding or "
                          "device_map")
    if config.use_unsloth is True:
        raise ConfigError("offload_embedding: unsloth places the model itself; set use_unsloth: auto (transformers is "
                          "then chosen) or false")
    # transformers 5 ties by the outer config (a VLM's), where a text config may say otherwise
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    tied = any(getattr(c, "tie_word_embeddings", False) for c in (model_config, text))
    from .models.host_embedding import tied_message
    from .models.loading import SEQUENCE_CLASSIFIER

    if config.model_head != SEQUENCE_CLASSIFIER and tied:  # a reward model has no LM head to share the table
        raise ConfigError(tied_message(config.model_name))


def method_rule(config: TrainConfig) -> None:
    """The training method's own rules (methods/base.TrainingMethod.check_config), such as what GRPO's rollouts
    can do."""
    type(config).training_method.check_config(config)


RULES = (
    Rule("device_map", lambda s: device_map_rule(s.config.device_map, s.num_processes), ("launch",)),
    Rule("reentrant checkpointing", lambda s: reentrant_rule(s.config, s.num_processes, s.reentrant),
         ("launch", "worker")),
    Rule("DeepSpeed", lambda s: deepspeed_rule(s.distributed_type, "accelerate config"), ("worker",)),
    Rule("sequence parallel", lambda s: sequence_parallel_rule(s.config, s.num_processes, s.model_config),
         ("launch", "worker", "loaded")),
    Rule("offload_embedding", lambda s: offload_embedding_rule(s.config, s.model_config, s.distributed_type),
         ("launch", "worker", "loaded")),
    Rule("method", lambda s: method_rule(s.config), ("launch", "worker")),
    Rule("final model directory", lambda s: final_model_dir_rule(s.config), ("launch", "worker"), reads_files=True),
    Rule("vision", lambda s: vision_rule(s.config, s.inputs.images if s.inputs else None), ("launch", "loaded"),
         reads_files=True),
)


def check_run(situation: Situation) -> None:
    """Every rule of the situation's phase, in order; the first broken one raises its line."""
    for rule in RULES:
        if situation.phase in rule.phases and (situation.sees_files or not rule.reads_files):
            rule.check(situation)
