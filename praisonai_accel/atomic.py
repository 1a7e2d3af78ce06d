"""Files that appear whole or not at all: written beside their target under a temporary name, then renamed."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path in the target's directory; renamed onto `path` when the block ends without an exception,
    removed when it raises. `suffix` lets writers that pick their format from the name (savefig) see the real one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(data, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2))


def write_yaml_atomic(data: dict, path: str | Path) -> Path:
    import yaml

    return write_text_atomic(path, yaml.safe_dump(data, sort_keys=True))
