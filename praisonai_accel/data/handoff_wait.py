"""How a worker waits for the tokenized data another process builds, through the file system and with no time limit
(a collective would time out after ddp_timeout on a large dataset): for the launcher, which tokenizes while its
workers start (PREPROCESSING_ENV names its status file), or for the rank that builds the cache. To move into the
launcher -> worker handoff module."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..config import TrainConfig
from .cache import STATS_FILE, cache_entries
from .formats import DataError
from .tokenized import TokenizedDataset


def wait_for_cache(config: TrainConfig, tokenizer, failed: Path, poll_seconds: float = 0.2) -> None:
    """Wait, through the file system and with no time limit, until the rank building the cache has finished it.

    No collective is involved, so a preprocessing longer than ddp_timeout cannot time the other ranks out. If the
    builder fails it writes `failed`, and this rank stops too; if it dies, the launcher stops this rank."""
    entries = cache_entries(config, tokenizer)
    while not all(TokenizedDataset.exists(e) and (e / STATS_FILE).exists() for e in entries):
        if failed.exists():
            raise DataError(f"preprocessing failed on the rank building the cache ({failed.read_text().strip()})")
        time.sleep(poll_seconds)


PREPROCESSING_ENV = "PRAISONAI_ACCEL_PREPROCESSING"  # the status file of a launcher that tokenizes for its workers


def write_preprocessing_status(path: Path, status: str, error: str = "", cached: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"status": status, "error": error, "cached": cached}))
    os.replace(tmp, path)


def wait_for_launcher(status_file: Path, poll_seconds: float = 0.2) -> bool:
    """Wait, through the file system and with no time limit, for `praisonai-accel train`, which tokenizes while
    its workers start; its error, if it failed, becomes this rank's. Returns whether it found the cache filled."""
    while True:
        try:
            status = json.loads(status_file.read_text())
        except (OSError, ValueError):
            status = {"status": "running"}
        if status["status"] == "done":
            return bool(status.get("cached"))
        if status["status"] == "failed":
            raise DataError(status["error"])
        time.sleep(poll_seconds)
