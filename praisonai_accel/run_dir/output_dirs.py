"""Directories this project writes whole (the final adapter or model, a merged model) and may later replace.

Each carries a small marker file. A directory is replaced only when it carries the marker or is empty:
anything else at that path belongs to the user and is refused, never moved or deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .. import __version__
from ..config import ConfigError

MARKER = ".praisonai-accel.json"  # not pushed to the Hub (hub.CHECKPOINT_IGNORE)


class NotOurs(ConfigError):
    """The path holds something this project did not write; phrased for the user, as any config error is."""


def read_marker(directory: Path) -> dict | None:
    path = Path(directory) / MARKER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == "praisonai-accel" else None


def check_replaceable(target: Path, key: str) -> None:
    """Raise NotOurs unless `target` is absent, an empty directory, or a directory this project wrote."""
    target = Path(target)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink() or not target.is_dir():
        raise NotOurs(f"{key}: {target} exists and is not a directory this project wrote; choose another path")
    if read_marker(target) is None and any(target.iterdir()):
        raise NotOurs(f"{key}: {target} already holds files that praisonai-accel did not write; it is never replaced; "
                      "choose another path or move them away")


def replace_with(tmp: Path, target: Path, key: str, **facts) -> None:
    """Mark `tmp` as ours and move it to `target`, replacing only an earlier directory of ours (or an empty one)."""
    tmp, target = Path(tmp), Path(target)
    check_replaceable(target, key)
    (tmp / MARKER).write_text(json.dumps({"written_by": "praisonai-accel", "version": __version__, **facts}))
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
