"""The size and a content hash of every file of a checkpoint (MANIFEST.json), checked before anything is loaded.

Written by rank 0 right after every rank has written its files and before COMPLETE, while the files are still in the
page cache; the hash is xxHash's XXH3-128 when the `xxhash` package is there (a dependency of `datasets`, about as
fast as reading memory), else BLAKE2b-128 from hashlib. These guard against damage (a truncated copy, a flipped
bit, a half-synced file system), not against someone who rewrites the checkpoint and its manifest together: loading
stays safe anyway, since nothing in a checkpoint is ever unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..runtime.handoff import CHECKED_CHECKPOINTS_ENV

MANIFEST = "MANIFEST.json"
_CHUNK = 8 << 20


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "blake2b_128":
        import hashlib

        return hashlib.blake2b(digest_size=16)
    raise ValueError(f"unknown hash {algorithm}")


def fast_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b_128"
    return "xxh3_128"


def file_digest(path: Path, algorithm: str) -> str:
    digest = _hasher(algorithm)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def _files(directory: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in skip)


def write_manifest(directory: Path, marker: str) -> None:
    """Every file under `directory` except the marker written after this; fsynced, so it is on disk before it."""
    import os

    directory = Path(directory)
    algorithm = fast_algorithm()
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "hash": file_digest(p, algorithm)}
             for p in _files(directory, {MANIFEST, marker})}
    path = directory / MANIFEST
    with open(path, "w") as handle:
        json.dump({"algorithm": algorithm, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def has_manifest(directory: Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def damage(directory: Path, marker: str) -> str | None:
    """Why the checkpoint cannot be trusted, in words, or None when every file is as recorded. A checkpoint written
    before manifests existed has none: None too (the caller says so)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        algorithm, files = manifest["algorithm"], manifest["files"]
        sizes = {name: int(entry["size"]) for name, entry in files.items()}
        _hasher(algorithm)
    except ImportError:
        algorithm = None  # recorded with xxhash, which is gone: sizes only
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST} is unreadable ({type(exc).__name__})"
    try:
        present = {p.relative_to(directory).as_posix() for p in _files(directory, {MANIFEST, marker})}
        extra = sorted(name for name in present - set(files) if not Path(name).name.startswith("."))
        for name, size in sizes.items():
            if name not in present:
                return f"{name} is missing"
            actual = (directory / name).stat().st_size
            if actual != size:
                return f"{name} is {actual} bytes, {size} recorded ({'truncated' if actual < size else 'grown'})"
        if extra:
            return f"{extra[0]} is not in its {MANIFEST}"
        if algorithm is None:
            return None
        for name in sorted(files):
            if file_digest(directory / name, algorithm) != files[name]["hash"]:
                return f"{name} does not match its recorded {algorithm} hash (its content changed after saving)"
    except OSError as exc:
        return f"it cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    return None


# The launcher checks the checkpoints before any worker starts and hands its verdicts to the workers, so rank 0 neither
# hashes them again nor repeats the launcher's warnings.
_VERDICTS: dict[str, str] = {}  # resolved path -> reason ("" when intact), as found by this process


def _from_launcher() -> dict[str, str]:
    import os

    try:
        return dict(json.loads(os.environ.get(CHECKED_CHECKPOINTS_ENV, "{}")))
    except (ValueError, TypeError):
        return {}


def checked(directory: Path, marker: str) -> tuple[str | None, bool]:
    """(why the checkpoint cannot be used or None, whether the launcher already said so)."""
    key = str(Path(directory).resolve())
    known = _from_launcher()
    if key in known:
        return known[key] or None, True
    reason = damage(directory, marker) if has_manifest(directory) else unreadable(directory)
    _VERDICTS[key] = reason or ""
    return reason, False


def unreadable(directory: Path) -> str | None:
    """A checkpoint from before manifests: the checks loading would make anyway, made first (a safetensors header
    that does not fit its file is what a truncated copy looks like)."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError, ValueError) as exc:
            return f"{path.name} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


def remember(directory: Path, reason: str | None) -> None:
    key = str(Path(directory).resolve())
    if key not in _from_launcher():
        _VERDICTS[key] = reason or ""


def verdicts() -> dict[str, str]:
    """What this process found of the checkpoints it verified (resolved path -> reason, "" when intact), for its
    workers (handoff.worker_environment)."""
    return dict(_VERDICTS)


SKIPPED: list[Path] = []  # checkpoints checkpoint.latest_intact passed over, for set_aside_skipped


def set_aside_skipped() -> None:
    """Rank 0 of the training job, once it resumes from an older checkpoint: damaged newer ones are renamed."""
    set_aside([p for p in SKIPPED if p.is_dir()])
    SKIPPED.clear()


def set_aside(directories: list[Path]) -> list[Path]:
    """Rename checkpoints that failed verification to NAME.damaged: kept for a look, but no longer the newest
    checkpoint that rotation protects and every later resume would skip again."""
    import logging

    moved = []
    for path in directories:
        target, n = path.with_name(path.name + ".damaged"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.damaged-{n}")
        try:
            path.rename(target)
        except OSError:
            continue
        logging.getLogger("praisonai_accel").info("renamed %s, which failed verification, to %s", path.name, target.name)
        moved.append(target)
    return moved


def decided_on_main_process(accelerator, decide) -> tuple[Path | None, int, str | None]:
    """Where to resume, (checkpoint, micro-batches to skip, warning), decided by the main process alone (one hash
    pass, one set of warnings) and told to every rank; a ConfigError there is raised on every rank."""
    if accelerator.num_processes == 1:
        return decide()
    from accelerate.utils import broadcast_object_list

    answer = [None, 0, None, None]
    if accelerator.is_main_process:
        try:
            found, skip, warning = decide()
            answer = [str(found) if found else None, skip, warning, None]
        except ConfigError as exc:  # every rank raises it, as when each decided alone
            answer = [None, 0, None, str(exc)]
    broadcast_object_list(answer)
    if answer[3]:
        raise ConfigError(answer[3])
    return (Path(answer[0]) if answer[0] else None), answer[1], answer[2]
