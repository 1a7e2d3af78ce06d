"""The training recipe, top to bottom: set up, (resume), step, evaluate, checkpoint, save.

Accelerate owns DDP/FSDP wrapping, mixed precision, device placement, rank-0 gating, trackers and
checkpoint state. The loop owns gradient accumulation (with `no_sync`) because the loss is normalised
by the number of target tokens in the whole optimizer step, over every micro-batch and every rank:
only then do 2 processes x batch B give the same update as 1 process x batch 2B. The loss itself
(LM head at target positions only, in chunks) lives in `loss.py`, evaluation in `evaluation.py`.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import itertools
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator

from . import checkpoint as ckpt
from .checkpoint_manifest import resume_point_on_main, set_aside_skipped
from .config import DEEPSPEED_REFUSED, REENTRANT_WITH_UNUSED, ConfigError, TrainConfig
from .data import (
    PREPROCESSING_ENV, LengthGroupedSampler, PadCollator, batch_targets, cache_dir, ensure_chat_template, load_datasets,
    quiet_datasets, report_stats, wait_for_cache, wait_for_launcher,
)
from .distributed import VERBOSE_ENV, DistEnv, attempt_id, fsdp_requested, gpu_has_bf16, resolve_mixed_precision
from .errors import first_line
from .evaluation import evaluate, record_evaluation
from .flops import attended_keys, examples_in, flop_counts
from .hub import model_card
from .metrics import MetricsLogger, StepResult, Window, read_metrics, write_json_atomic
from .model import (
    choose_backend, load_model_and_tokenizer, parameters_without_gradient, resolve_commit, trainable_parameter_count,
    uses_reentrant_checkpointing,
)
from .output_dirs import NotOurs, check_replaceable, replace_with
from .preflight import run_preflight
from .sharded_state import parameter_bytes, reshard
from .watchdog import Watchdog

log = logging.getLogger("praisonai_accel")


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint was saved at `checkpoint`."""

    def __init__(self, checkpoint: Path):
        super().__init__(f"stopped by SIGTERM; checkpoint saved at {checkpoint}")
        self.checkpoint = checkpoint


class DiskFull(Exception):
    """No space left while saving; earlier checkpoints are intact."""


# ---------------------------------------------------------------- small pure helpers

def plan_steps(config: TrainConfig, batches_per_epoch: int) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps)."""
    per_epoch = max(1, math.ceil(batches_per_epoch / config.gradient_accumulation_steps))
    total = config.max_steps if config.max_steps > 0 else per_epoch * config.num_train_epochs
    return per_epoch, total


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    return config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)


def micro_batch_groups(batches: Iterator, size: int) -> Iterator[list]:
    while group := list(itertools.islice(batches, size)):
        yield group


def parameter_digest(model) -> str:
    """Hash of this rank's trainable weights: equal on every rank iff DDP kept them in sync."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            value = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2 shards are DTensors
            digest.update(name.encode())
            digest.update(value.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def is_disk_full(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        text = str(exc)
        if "No space left" in text or "unexpected pos" in text or "file write failed" in text:
            return True  # torch.save reports a short write this way
        exc = exc.__cause__ or exc.__context__
    return False


def save_final_model(accelerator, model, tokenizer, config: TrainConfig, card: str | None = None) -> None:
    """Rank 0 writes the adapter (or full model), tokenizer and model card; the directory appears complete or not at
    all, and replaces only an earlier final model of ours (checked before launch, and again here)."""
    target = config.final_model_path()
    causal_lm, state_dict = ckpt.trained_model_and_state(accelerator, model, trainable_only=config.uses_lora)
    if accelerator.is_main_process:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        causal_lm.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
        try:
            replace_with(tmp, target, "final_model_dir", kind="adapter" if config.uses_lora else "model",
                         trust_remote_code=config.trust_remote_code, revision=config.revision)
        except NotOurs as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"{exc} (the checkpoints in {config.output_dir} are intact)") from None
    accelerator.wait_for_everyone()


def quiet_libraries(verbose: bool) -> None:
    """Setup facts and metrics from us; nothing from the libraries (progress bars, per-rank chatter) unless verbose."""
    import transformers

    # Every rank logs at INFO into its own log file; the console handler shows rank 0's INFO and others' warnings.
    logging.getLogger().setLevel(logging.INFO)
    log.setLevel(logging.INFO)
    if verbose:
        return
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    quiet_datasets()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    for noisy in ("torch.distributed", "torch.nn.parallel", "peft", "bitsandbytes", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _peak_gpu_memory_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def remove_stale_push_snapshots(output_dir: Path) -> None:
    """Hub-push snapshots (hub.py's .push-*) left by a run that died mid-upload; nothing else is touched."""
    for path in output_dir.glob(".push-*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


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


def packing_for(config: TrainConfig, backend, warn: bool = True) -> bool:
    """Packing, unless unsloth trains: it ignores the attention mask in training and keeps packed examples apart only
    when given their lengths (and its flash-attention path reshapes a batch past its max_seq_length)."""
    if config.packing and backend.name == "unsloth":
        if warn:
            log.warning("warning: packing: off under unsloth, which would let packed examples attend to each other; "
                        "set use_unsloth: false to pack")
        return False
    return config.packing


def rng_snapshot() -> dict:
    """The generators dropout draws from, cheap to take at every step (host-side states, no device sync)."""
    import torch

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(snapshot: dict) -> None:
    import torch

    torch.set_rng_state(snapshot["cpu"])
    if snapshot["cuda"] is not None:
        torch.cuda.set_rng_state_all(snapshot["cuda"])


# ---------------------------------------------------------------- the recipe

class Recipe:
    def __init__(self, config: TrainConfig, publisher=None):
        self.config = config
        self.publisher = publisher  # rank 0's HubPublisher, or None
        self.env = DistEnv.from_environ()
        self.output_dir = config.output_path()
        self.verbose = os.environ.get(VERBOSE_ENV) == "1"
        self.stop_requested = False
        self._rng_to_reapply: Path | None = None  # set when resuming mid-epoch, see _epoch_batches

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        import torch
        from accelerate.utils import set_seed

        config = self.config
        use_cuda = torch.cuda.is_available()
        bf16 = gpu_has_bf16()  # the model's dtype, LoRA's, autocast's and unsloth's all follow from this one answer
        self.backend = choose_backend(config, self.env, use_cuda)  # imports unsloth, if at all, before transformers
        self.reentrant = uses_reentrant_checkpointing(config, self.backend)
        self.packing = packing_for(config, self.backend, warn=self.env.is_main)
        self.accelerator = accelerator = self._build_accelerator(use_cuda, bf16)
        quiet_libraries(self.verbose)
        if accelerator.distributed_type.name == "DEEPSPEED":  # launched with a DeepSpeed config, past the CLI
            raise ConfigError(f"accelerate config: {DEEPSPEED_REFUSED}")
        check_replaceable(config.final_model_path(), "final_model_dir")  # accelerate launch / torchrun: not checked yet
        if config.trust_remote_code and not config.revision and accelerator.is_main_process:  # once, not once per rank
            log.warning("warning: trust_remote_code: true without revision: every rank, node and restart runs whatever "
                        "code is on the model's main branch when it loads; pin it with revision: <commit>")
        self.cache_shared = True
        run_preflight(accelerator, config, local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      fsdp=fsdp_requested())
        if accelerator.num_processes > 1:
            check_shared_output_dir(accelerator, self.output_dir)
            self.cache_shared = sees_what_rank0_wrote(accelerator, cache_dir(config))
        self.resume_from = self._find_resume_point()
        set_seed(config.seed)
        log.info("backend: %s%s | processes: %d (%s) | device: %s | mixed precision: %s", self.backend.name,
                 f" ({self.backend.reason})" if self.backend.reason else "", accelerator.num_processes,
                 accelerator.distributed_type.name, accelerator.device, accelerator.mixed_precision)

        self.model_commit = resolve_commit(config)
        pinned = config.model_copy(update={"revision": self.model_commit}) if self.model_commit else config
        model, self.tokenizer = load_model_and_tokenizer(pinned, self.env, self.backend, use_cuda, bf16)
        ensure_chat_template(self.tokenizer, config.chat_template)
        trainable, total = trainable_parameter_count(model)
        log.info("model: %s | trainable parameters: %s of %s (%.2f%%)", config.model_name, f"{trainable:,}",
                 f"{total:,}", 100 * trainable / max(total, 1))

        train_data, self.eval_data = self._load_data()
        if len(train_data) == 0:  # an empty loader would never end an epoch: the loop would spin forever
            raise ConfigError("dataset: no example is left to train on (val_split_ratio took them all, or every one "
                              "was dropped); add data or lower val_split_ratio")
        loader = self._train_loader(train_data)
        loss_module = self._loss_module(model, use_cuda)
        self.flop_counts = flop_counts(model)
        if self.reentrant and accelerator.num_processes > 1:
            self._check_every_trainable_parameter_learns(loss_module, train_data)
        optimizer = self._build_optimizer(loss_module)
        self.model, self.optimizer, self.loader = accelerator.prepare(loss_module, optimizer, loader)
        self.parameter_bytes = parameter_bytes(self.model)  # this rank's share: 1/N of each layer under FSDP
        self.steps_per_epoch, self.total_steps = plan_steps(config, len(self.loader))
        from transformers import get_scheduler

        # Not prepared: a prepared scheduler steps once per process per optimizer step.
        self.scheduler = get_scheduler(config.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=warmup_steps(config, self.total_steps),
                                       num_training_steps=self.total_steps)
        # The scheduler goes into checkpoints as JSON (ckpt.save_scheduler), never registered with accelerate: it
        # would pickle it and read it back with weights_only=False.
        ckpt.install_trainable_only_hooks(accelerator)
        self.state = self._fresh_state()
        if self.resume_from is not None:
            self._load_checkpoint(self.resume_from)
        if threading.current_thread() is threading.main_thread():  # Ray Train runs the loop in another thread
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if config.trackers and accelerator.is_main_process:
            if "mlflow" in config.trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
                # no server given: a file store in output_dir (mlflow keeps it only behind this opt-in)
                os.environ["MLFLOW_TRACKING_URI"] = (self.output_dir / "mlruns").resolve().as_uri()
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            if not self.verbose:
                os.environ.setdefault("WANDB_SILENT", "true")
            with self._quiet_stdout():  # trackers announce themselves with print()
                accelerator.init_trackers(config.run_name or self.output_dir.resolve().name,
                                          config=_tracker_config(config))
        world, accum, per_device = accelerator.num_processes, config.gradient_accumulation_steps, config.per_device_train_batch_size
        log.info("steps: %d (%d per epoch) | effective batch: %d x %d x %d = %d%s", self.total_steps, self.steps_per_epoch,
                 per_device, accum, world, per_device * accum * world, " rows" if self.packing else "")

    def _check_every_trainable_parameter_learns(self, loss_module, dataset) -> None:
        """Reentrant checkpointing under DDP runs without unused-parameter detection, which is only right when every
        trainable parameter gets a gradient from a batch: checked on one example before DDP wraps the model."""
        batch = PadCollator(self.tokenizer.pad_token_id)([dataset[0]])
        missing = parameters_without_gradient(loss_module, {k: v.to(self.accelerator.device) for k, v in batch.items()})
        if missing:
            raise ConfigError(
                f"reentrant gradient checkpointing (unsloth's, or use_gradient_checkpointing: reentrant) under DDP needs "
                f"every trainable parameter to get a gradient, and {len(missing)} get none ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); use use_gradient_checkpointing: true (non-reentrant, "
                "transformers) or leave those modules out of lora_target_modules")

    def _build_accelerator(self, use_cuda: bool, bf16: bool):
        from accelerate import Accelerator
        from accelerate.utils import (
            DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration,
        )

        config = self.config
        precision = resolve_mixed_precision(config.mixed_precision, use_cuda, bf16)
        find_unused = config.ddp_find_unused_parameters
        if find_unused is None:
            find_unused = self.env.is_distributed and not self.reentrant
        elif find_unused and self.reentrant and self.env.is_distributed:
            raise ConfigError(REENTRANT_WITH_UNUSED)
        accelerator = Accelerator(
            mixed_precision=precision,
            cpu=not use_cuda,
            gradient_accumulation_steps=1,  # accumulation is done by the loop, see module docstring
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused),
                             InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=config.ddp_timeout))],
            log_with=config.trackers or None,
            project_config=ProjectConfiguration(project_dir=config.output_dir, logging_dir=str(self.output_dir / "runs"),
                                                automatic_checkpoint_naming=False),
        )
        if not use_cuda and self.env.is_distributed and fsdp_requested():
            select_fsdp_on_cpu(accelerator)
        return accelerator

    def _find_resume_point(self) -> Path | None:
        config = self.config
        resume = resume_point_on_main(self.accelerator, lambda: ckpt.checkpoint_to_resume(
            self.output_dir, config.resume_from_checkpoint, config.run_fingerprint(), config.overwrite_output_dir,
            config.run_identity(), config.force_resume))
        if self.accelerator.is_main_process:
            set_aside_skipped()
            if config.overwrite_output_dir and resume is None:
                ckpt.clear_checkpoints(self.output_dir)
            ckpt.remove_stale_temporaries(self.output_dir)
            remove_stale_push_snapshots(self.output_dir)
        self.accelerator.wait_for_everyone()
        return resume

    def _load_data(self):
        config, accelerator = self.config, self.accelerator
        started = time.perf_counter()
        # One rank tokenizes (rank 0, or each node's first where the cache is not shared storage) while the others
        # wait through the file system: a collective would time out after ddp_timeout on a large dataset.
        # `praisonai-accel train` tokenizes in the launcher while the workers start, and every rank waits for it.
        builds = accelerator.is_main_process if self.cache_shared else accelerator.is_local_main_process
        failed = self.output_dir / "logs" / f".preprocessing-failed-{attempt_id()}"
        launcher_found_it_cached = None
        if os.environ.get(PREPROCESSING_ENV):
            builds = False
            launcher_found_it_cached = wait_for_launcher(Path(os.environ[PREPROCESSING_ENV]))
        elif not builds:
            wait_for_cache(config, self.tokenizer, failed)
        try:
            train, stats, from_cache, evaluation = load_datasets(config, self.tokenizer)
        except Exception as exc:
            if builds and accelerator.num_processes > 1:
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text(f"rank {accelerator.process_index}: {first_line(exc, type(exc).__name__)}")
            raise
        if launcher_found_it_cached is not None:  # this run tokenized, in the launcher, unless it was cached already
            from_cache = launcher_found_it_cached
        self.preprocess = {"seconds": time.perf_counter() - started, "cached": from_cache}
        report_stats(stats, from_cache)
        if config.val_split_ratio > 0:
            train, evaluation = train.split(config.val_split_ratio, config.seed)
        if evaluation is not None:
            log.info("eval: %d examples", len(evaluation))
        return train, evaluation

    def _train_loader(self, dataset):
        import torch
        from torch.utils.data import DataLoader

        from .packing import PackedDataset

        config = self.config
        common = {"batch_size": config.per_device_train_batch_size, "collate_fn": PadCollator(self.tokenizer.pad_token_id)}
        lengths = dataset.lengths
        if self.packing:
            dataset = PackedDataset(dataset, lengths, config.max_seq_length)
            fill = sum(dataset.row_lengths) / (len(dataset) * config.max_seq_length)
            log.info("packing: %d examples in %d rows of %d tokens (%.1f%% full)", len(lengths), len(dataset),
                     config.max_seq_length, 100 * fill)
        elif config.group_by_length:
            sampler = LengthGroupedSampler(lengths, config.group_by_length_window, config.seed)
            return DataLoader(dataset, sampler=sampler, **common)
        return DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(config.seed), **common)

    def _loss_module(self, model, use_cuda: bool):
        from .loss import CausalLMLoss, load_liger, verify_head, wraps_head

        config = self.config
        module = CausalLMLoss(model, chunked=config.chunked_loss, liger=load_liger(config.use_liger, use_cuda))
        if module.chunked and wraps_head(module):
            module.chunked = False
            log.info("loss: lm_head is trained through peft (LoRA or modules_to_save), which the chunked loss would "
                     "bypass; using the model's full logits")
        probe = self.tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
        if module.chunked and not self._head_verified(module, probe, verify_head):
            module.chunked = False
            log.warning("warning: this model's head is not a plain linear layer over the decoder output; "
                        "the loss uses its full logits")
        log.info("loss: %s", "liger fused linear cross-entropy" if module.liger is not None and module.chunked else
                 "LM head at target positions only, chunked" if module.chunked else "full logits")
        return module

    def _head_verified(self, module, probe, verify_head) -> bool:
        """Under FSDP only rank 0 holds real weights before prepare (the others wait on the meta device for its
        broadcast), so rank 0 checks the head and tells the others."""
        accelerator = self.accelerator
        if not ckpt.is_fsdp(accelerator):
            return verify_head(module, probe, accelerator.device)
        import torch
        import torch.distributed as dist

        verdict = torch.tensor([float(verify_head(module, probe, accelerator.device)) if accelerator.is_main_process else 0.0])
        dist.broadcast(verdict, src=0)
        return bool(verdict[0] > 0)

    def _build_optimizer(self, model):
        import torch

        config = self.config
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        betas, eps, lr = (config.adam_beta1, config.adam_beta2), config.adam_epsilon, config.learning_rate
        if config.optim == "sgd":
            return torch.optim.SGD(groups, lr=lr)
        if config.optim in ("adamw_8bit", "paged_adamw_8bit"):
            try:
                import bitsandbytes as bnb
            except Exception as exc:
                raise ConfigError(f"optim: {config.optim} needs bitsandbytes ({type(exc).__name__}); "
                                  "pip install 'praisonai-accel[qlora]', or use optim: adamw_torch") from None
            cls = bnb.optim.PagedAdamW8bit if config.optim.startswith("paged") else bnb.optim.AdamW8bit
            return cls(groups, lr=lr, betas=betas, eps=eps)
        fused = config.optim == "adamw_torch_fused" and torch.cuda.is_available()
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))

    def _fresh_state(self) -> ckpt.CheckpointState:
        config = self.config
        return ckpt.CheckpointState(
            global_step=0, epoch=0, batches_in_epoch=0, samples_in_epoch=0, samples_seen=0,
            world_size=self.accelerator.num_processes, per_device_train_batch_size=config.per_device_train_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            run_fingerprint=config.run_fingerprint(), config_fingerprint=config.fingerprint(),
            run_identity=config.run_identity(), model_commit=self.model_commit,
        )

    def _load_checkpoint(self, path: Path) -> None:
        accelerator = self.accelerator
        saved = ckpt.CheckpointState.read(path)
        if saved.model_commit and self.model_commit and saved.model_commit != self.model_commit:
            raise ConfigError(f"revision: {self.config.model_name} now resolves to commit {self.model_commit}, but "
                              f"{path.name} was trained on {saved.model_commit}; set revision: {saved.model_commit} to resume")
        if not ckpt.rng_file_exists(path, accelerator.process_index):
            log.warning("%s has no RNG state for rank %d (it was saved by %d process(es)); that rank starts from its seed",
                        path, accelerator.process_index, saved.world_size)
        skip, warning = ckpt.resume_skip(saved, accelerator.num_processes, self.config.per_device_train_batch_size)
        if warning:
            log.warning(warning)
        ckpt.load_state(accelerator, path, self.model, self.optimizer, self.scheduler)
        accelerator.project_configuration.iteration = len(ckpt.complete_checkpoints(self.output_dir))
        self.state = saved
        self.state.batches_in_epoch = skip
        self.state.world_size = accelerator.num_processes
        self.state.per_device_train_batch_size = self.config.per_device_train_batch_size
        self.state.gradient_accumulation_steps = self.config.gradient_accumulation_steps
        self.state.config_fingerprint = self.config.fingerprint()
        self.state.run_fingerprint, self.state.run_identity = self.config.run_fingerprint(), self.config.run_identity()
        self.state.model_commit = self.model_commit
        self._rng_to_reapply = path if skip else None
        log.info("resumed from %s at step %d (epoch %d, %d batch(es) in)", path, saved.global_step, saved.epoch, skip)

    def _on_sigterm(self, _signum, _frame) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------ the loop

    def _epoch_batches(self, epoch: int) -> Iterator:
        """This epoch's batches, resuming mid-epoch where the checkpoint left off."""
        self.loader.set_epoch(epoch)
        skip = self.state.batches_in_epoch
        loader = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        batches = iter(loader)
        rng_checkpoint, self._rng_to_reapply = self._rng_to_reapply, None
        if rng_checkpoint is None:
            return batches
        # Starting the iterator draws from the RNG; the uninterrupted run drew at the epoch's start,
        # so re-apply the saved state now or dropout and friends diverge from it.
        try:
            first = next(batches)
        except StopIteration:
            return iter(())
        if ckpt.rng_file_exists(rng_checkpoint, self.accelerator.process_index):
            ckpt.load_rng_state(rng_checkpoint, self.accelerator.process_index)
        return itertools.chain([first], batches)

    def _optimizer_step(self, group: list) -> StepResult | None:
        """Forward/backward every micro-batch, then one optimizer step; totals are over all ranks.

        None when SIGTERM arrived between two micro-batches: a long step on a big model would otherwise end under
        the launcher's SIGKILL before its checkpoint. The step is abandoned: gradients dropped and the RNG put back
        as it was at the step's start, so the checkpoint of the last finished step resumes exactly."""
        import torch

        accelerator, model = self.accelerator, self.model
        rng = rng_snapshot() if len(group) > 1 else None
        local = torch.tensor([sum(batch_targets(b) for b in group)], device=accelerator.device)
        step_targets = int(accelerator.reduce(local, reduction="sum").item())
        scale = accelerator.num_processes / max(step_targets, 1)  # DDP averages over ranks; micro-batch grads add up
        loss_sum = torch.zeros((), device=accelerator.device)
        counts = torch.zeros(3, dtype=torch.long, device=accelerator.device)  # real tokens, attended keys, examples
        positions = 0
        for index, batch in enumerate(group):
            if index and self._stop_agreed():
                self.optimizer.zero_grad(set_to_none=True)
                restore_rng(rng)
                return None
            last = index == len(group) - 1
            with nullcontext() if last else accelerator.no_sync(model):
                summed = model(batch["input_ids"], batch["labels"], batch["attention_mask"], batch.get("position_ids"))
                accelerator.backward(summed * scale)
            loss_sum += summed.detach()
            mask = batch["attention_mask"]
            counts += torch.stack([mask.sum(), attended_keys(mask, batch.get("position_ids")), examples_in(batch)])
            positions += mask.numel()
        tokens, attended, examples = counts.tolist()  # one wait for the device per step, not three per micro-batch
        # Clipping at infinity clips nothing and still returns the norm, so grad_norm is always logged.
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
        self.optimizer.step()
        if not accelerator.optimizer_step_was_skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # One collective for the loss, token counts and the stop decision, so every rank agrees.
        totals = accelerator.reduce(torch.tensor(
            [float(loss_sum), float(tokens), float(positions), float(self.stop_requested), float(examples), float(attended)],
            dtype=torch.float64 if accelerator.device.type != "mps" else torch.float32, device=accelerator.device), "sum")
        tokens, attended = int(totals[1]), int(totals[5])
        return StepResult(loss_sum=float(totals[0]), targets=step_targets, tokens=tokens,
                          positions=int(totals[2]), grad_norm=grad_norm, stop=bool(totals[3] > 0),
                          examples=int(totals[4]), flops=self.flop_counts.step(tokens, attended, step_targets))

    def _stop_agreed(self) -> bool:
        """Whether any rank has been asked to stop: every rank must leave the step at the same micro-batch."""
        import torch

        flag = torch.tensor([float(self.stop_requested)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum")[0] > 0)

    def evaluate(self) -> float:
        batch_size = self.config.per_device_eval_batch_size or self.config.per_device_train_batch_size
        loss = evaluate(self.accelerator, self.model, self.eval_data, PadCollator(self.tokenizer.pad_token_id), batch_size)
        reshard(self.model)  # FSDP2: what stayed gathered after the no-grad forwards goes back to shards
        return loss

    def save_checkpoint(self) -> Path:
        config = self.config
        started = time.perf_counter()
        try:
            path = ckpt.save_checkpoint(self.accelerator, self.model, self.optimizer, self.tokenizer, self.scheduler,
                                        self.output_dir, self.state, config.uses_lora)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            tmp = self.output_dir / f"checkpoint-{self.state.global_step}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            latest = ckpt.latest_complete(self.output_dir, warn=False)
            raise DiskFull(f"no space left on device while saving checkpoint-{self.state.global_step}; the latest "
                           f"complete checkpoint is {latest.name if latest else 'none'}; free space in "
                           f"{self.output_dir} and re-run the same command to resume") from None
        self.metrics.log_event({"step": self.state.global_step, "checkpoint": path.name,
                                "save_seconds": time.perf_counter() - started, "time": time.time()})
        if self.accelerator.is_main_process:
            deleted = ckpt.rotate(self.output_dir, config.save_total_limit, self.state.best_checkpoint)
            for old in deleted:
                log.info("deleted old checkpoint %s", old.name)
            if self.publisher is not None:
                self.publisher.on_checkpoint(path)
        self.accelerator.wait_for_everyone()
        log.info("saved checkpoint %s", path)
        return path

    def _saves_at(self, step: int, end_of_epoch: bool) -> bool:
        config = self.config
        if config.save_strategy == "steps":
            return step % config.save_steps == 0
        return config.save_strategy == "epoch" and end_of_epoch

    def _evals_at(self, step: int, end_of_epoch: bool) -> bool:
        config = self.config
        if config.eval_strategy == "steps":
            return step % config.eval_steps == 0
        return config.eval_strategy == "epoch" and end_of_epoch

    def train(self) -> dict:
        config, accelerator, state = self.config, self.accelerator, self.state
        world = accelerator.num_processes
        self._trim_metrics_after(state.global_step)
        tracker_log = (lambda values, step: accelerator.log(values, step=step)) if config.trackers else None
        metrics = self.metrics = MetricsLogger(self.output_dir / "metrics.jsonl", self.total_steps,
                                               enabled=accelerator.is_main_process, start_step=state.global_step,
                                               append=True, tracker_log=tracker_log)
        self._write_progress("running")
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        started = time.perf_counter()
        window = Window()
        stop_early = False
        self.model.train()
        log_path = self.output_dir / "logs" / f"rank-{accelerator.process_index}.log"
        with metrics, Watchdog(config.hang_timeout, accelerator.process_index, log_path) as watchdog:
            while state.global_step < self.total_steps and state.epoch < epochs and not stop_early:
                batches = self._epoch_batches(state.epoch)
                batches_per_epoch = len(self.loader)
                for group in micro_batch_groups(batches, config.gradient_accumulation_steps):
                    step = self._optimizer_step(group)
                    watchdog.progress()
                    if step is None:  # SIGTERM between micro-batches: the step was abandoned, save where the last ended
                        saved = self.save_checkpoint()
                        self._write_progress("preempted")
                        raise Preempted(saved)
                    state.global_step += 1
                    state.batches_in_epoch += len(group)
                    consumed = sum(len(b["input_ids"]) for b in group) * world
                    state.samples_in_epoch += consumed
                    state.samples_seen += consumed
                    window.add(step)
                    end_of_epoch = state.batches_in_epoch >= batches_per_epoch
                    if end_of_epoch:
                        state.epoch, state.batches_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
                    last = state.global_step >= self.total_steps
                    if state.global_step % config.logging_steps == 0 or last:
                        record = window.record(state, self.scheduler.get_last_lr()[0], step.grad_norm, batches_per_epoch)
                        metrics.log(record)
                        state.first_loss = record["loss"] if state.first_loss is None else state.first_loss
                        state.last_loss = record["loss"]
                        window = Window()
                    if self.eval_data is not None and self._evals_at(state.global_step, end_of_epoch):
                        eval_loss = self.evaluate()
                        watchdog.progress()
                        metrics.log_event({"step": state.global_step, "eval_loss": eval_loss})
                        stop_early = record_evaluation(config, state, eval_loss, self._saves_at(state.global_step, end_of_epoch))
                    if step.stop:
                        saved = self.save_checkpoint()
                        self._write_progress("preempted")
                        raise Preempted(saved)
                    if self._saves_at(state.global_step, end_of_epoch):
                        self.save_checkpoint()
                        watchdog.progress()
                    if last or stop_early:
                        break
            if stop_early:
                log.info("early stopping at step %d: no improvement in %d evaluation(s)", state.global_step,
                         config.early_stopping_patience)
        return self._finish(started, stop_early)

    def _write_progress(self, status: str) -> None:
        """output_dir/progress.json: what `report` reads of a run in progress or interrupted."""
        if self.accelerator.is_main_process:
            write_json_atomic({"status": status, "global_step": self.state.global_step, "total_steps": self.total_steps,
                               "num_processes": self.accelerator.num_processes, "updated": time.time(),
                               "final_model_dir": str(self.config.final_model_path())},
                              self.output_dir / "progress.json")

    def _trim_metrics_after(self, step: int) -> None:
        """On resume, forget metric lines of steps that will be trained again."""
        path = self.output_dir / "metrics.jsonl"
        if not self.accelerator.is_main_process or not path.exists():
            return
        import json

        kept = [record for record in read_metrics(path) if record.get("step", 0) <= step]
        path.write_text("".join(json.dumps(record) + "\n" for record in kept))

    def _finish(self, started: float, stopped_early: bool) -> dict:
        from accelerate.utils import gather_object

        accelerator, config, state = self.accelerator, self.config, self.state
        if config.load_best_model_at_end and state.best_checkpoint:
            best = self.output_dir / state.best_checkpoint
            if ckpt.is_complete(best):
                ckpt.load_state(accelerator, best, self.model, self.optimizer, self.scheduler)
                log.info("loaded best checkpoint %s (%s %.4f)", best.name, config.metric_for_best_model, state.best_metric)
        final_dir = config.final_model_path()
        summary = {
            "global_step": state.global_step,
            "total_steps": self.total_steps,
            "num_processes": accelerator.num_processes,
            "final_model_dir": str(final_dir),
            "first_loss": state.first_loss,
            "final_loss": state.last_loss,
            "best_metric": state.best_metric,
            "best_checkpoint": state.best_checkpoint,
            "stopped_early": stopped_early,
            "peak_gpu_memory_mib": _peak_gpu_memory_mib(),
            "preprocess_seconds": self.preprocess["seconds"],
            "preprocess_cached": self.preprocess["cached"],
            "revision": config.revision,
            "model_commit": self.model_commit,
        }
        save_final_model(accelerator, self.model, self.tokenizer, config, model_card(config, summary))
        if self.publisher is not None:
            self.publisher.on_final(final_dir)
        digests = gather_object([parameter_digest(accelerator.unwrap_model(self.model))])
        summary.update({
            "distributed_type": accelerator.distributed_type.name,
            "parameter_bytes_per_rank": gather_object([self.parameter_bytes]),
            "flop_counts": self.flop_counts.as_dict(),
            "rank_weight_digests": digests,
            "weights_in_sync": len(set(digests)) == 1,
            "backend": self.backend.name,
            "train_seconds": time.perf_counter() - started,
        })
        if accelerator.is_main_process:
            write_json_atomic(summary, self.output_dir / "train_summary.json")
            self._write_progress("finished")
            log.info("saved %s to %s", "adapter" if config.uses_lora else "model", final_dir)
            if not summary["weights_in_sync"]:
                log.warning("ranks finished with different weights: %s", digests)
            if config.plot_loss:
                from .report import write_loss_plot

                plot = write_loss_plot(self.output_dir)
                if plot is not None:
                    log.info("loss plot: %s", plot)
        accelerator.wait_for_everyone()
        with self._quiet_stdout():
            accelerator.end_training()
        trackio = sys.modules.get("trackio")
        if trackio is not None:  # its exit hook would finish the finished run again, and say so on the console
            trackio.context_vars.current_run.set(None)
        return summary

    def _quiet_stdout(self):
        import contextlib
        import io

        return nullcontext() if self.verbose else contextlib.redirect_stdout(io.StringIO())


def _tracker_config(config: TrainConfig) -> dict:
    """The run's settings as trackers store them: scalars, lists and mappings as text."""
    values = {}
    for key, value in config.model_dump(mode="json").items():
        values[key] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return values


def train(config: TrainConfig, publisher=None) -> dict:
    recipe = Recipe(config, publisher)
    recipe.setup()
    return recipe.train()
