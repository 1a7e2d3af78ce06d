"""What the worker trains on: the tokenized datasets (from the launcher's preprocessing, the cache, or tokenized
here by one rank while the others wait through the file system) and the training loader over them."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..data import LengthGroupedSampler, cache_dir, load_datasets, report_stats, wait_for_cache
from ..data.packing import PackedDataset
from ..runtime.distributed import attempt_id
from ..errors import first_line
from ..runtime.handoff import PREPROCESSING_ENV, wait_for_launcher
from .accelerator import sees_what_rank0_wrote

log = logging.getLogger("praisonai_accel")


def packing_for(config: TrainConfig, backend, warn: bool = True) -> bool:
    """Packing, unless unsloth trains: it ignores the attention mask in training and keeps packed examples apart only
    when given their lengths (and its flash-attention path reshapes a batch past its max_seq_length)."""
    if config.packing and backend.name == "unsloth":
        if warn:
            log.warning("warning: packing: off under unsloth, which would let packed examples attend to each other; "
                        "set use_unsloth: false to pack")
        return False
    return config.packing


def load_training_data(accelerator, config: TrainConfig, tokenizer, cache_shared: bool, method_data):
    """(train set, eval set or None, {"seconds", "cached", "formats": each dataset's}). One rank tokenizes (rank 0,
    or each node's first where the cache is not on shared storage) while the others wait through the file system: a
    collective would time out after ddp_timeout on a large dataset. `praisonai-accel train` tokenizes in the
    launcher while the workers start, and every rank waits for it."""
    output_dir = config.output_path()
    started = time.perf_counter()
    builds = accelerator.is_main_process if cache_shared else accelerator.is_local_main_process
    failed = output_dir / "logs" / f".preprocessing-failed-{attempt_id()}"
    launcher_found_it_cached = None
    if os.environ.get(PREPROCESSING_ENV):
        builds = False
        launcher_found_it_cached = wait_for_launcher(Path(os.environ[PREPROCESSING_ENV]))
    elif not builds:
        wait_for_cache(config, tokenizer, failed)
    try:
        train, stats, from_cache, evaluation = load_datasets(config, tokenizer, method_data)
    except Exception as exc:
        if builds and accelerator.num_processes > 1:
            failed.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text(f"rank {accelerator.process_index}: {first_line(exc, type(exc).__name__)}")
        raise
    if launcher_found_it_cached is not None:  # this run tokenized, in the launcher, unless it was cached already
        from_cache = launcher_found_it_cached
    preprocess = {"seconds": time.perf_counter() - started, "cached": from_cache,
                  "formats": {d.name: d.format for d in stats.datasets if d.format}}
    report_stats(stats, from_cache)
    if config.val_split_ratio > 0:
        train, evaluation = train.split(config.val_split_ratio, config.seed)
    if evaluation is not None:
        log.info("eval: %d examples", len(evaluation))
    if len(train) == 0:  # an empty loader would never end an epoch: the loop would spin forever
        raise ConfigError("dataset: no example is left to train on (val_split_ratio took them all, or every one "
                          "was dropped); add data or lower val_split_ratio")
    return train, evaluation, preprocess


def train_loader(config: TrainConfig, dataset, collate, packing: bool, batch_size: int | None = None):
    """`batch_size`: the method's examples per micro-batch (methods.TrainingMethod.loader_batch_size)."""
    import torch
    from torch.utils.data import DataLoader

    common = {"batch_size": batch_size or config.per_device_train_batch_size, "collate_fn": collate}
    lengths = dataset.lengths
    if packing:
        dataset = PackedDataset(dataset, lengths, config.max_seq_length)
        fill = sum(dataset.row_lengths) / (len(dataset) * config.max_seq_length)
        log.info("packing: %d examples in %d rows of %d tokens (%.1f%% full)", len(lengths), len(dataset),
                 config.max_seq_length, 100 * fill)
    elif config.group_by_length:
        sampler = LengthGroupedSampler(lengths, config.group_by_length_window, config.seed)
        return DataLoader(dataset, sampler=sampler, **common)
    return DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(config.seed), **common)


def shares_cache(accelerator, config: TrainConfig) -> bool:
    return sees_what_rank0_wrote(accelerator, cache_dir(config))
