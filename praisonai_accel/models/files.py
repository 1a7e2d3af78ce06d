"""What a model folder holds, read from the file system without loading anything."""

from __future__ import annotations

from pathlib import Path


def local_weight_bytes(model_name: str) -> int:
    """The size of a local model folder's weight files; 0 for a Hub id (nothing is downloaded to find out)."""
    folder = Path(model_name).expanduser()
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.glob("*") if p.suffix in (".safetensors", ".bin"))
