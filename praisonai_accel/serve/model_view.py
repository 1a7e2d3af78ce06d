"""The directory an engine loads: an adapter merged once into a cache keyed by the adapter's hash (outside the run's
directories, reused while the adapter is unchanged), and a view of the model under the name it is served as, whose
generation_config stops where the run's chat template ends a turn."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from ..models.inference import ModelDirError, inputs_of, is_processor, model_config_of, stop_token_ids
from ..publish.merge import merge_adapter
from ..run_dir.output_dirs import MARKER, read_marker
from .target import ServeError

log = logging.getLogger("praisonai_accel")


def cache_root() -> Path:
    """$PRAISONAI_ACCEL_CACHE, else $XDG_CACHE_HOME/praisonai-accel, else ~/.cache/praisonai-accel; then serve/."""
    configured = os.environ.get("PRAISONAI_ACCEL_CACHE")
    if configured:
        return Path(configured).expanduser() / "serve"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "praisonai-accel" / "serve"


def adapter_hash(adapter_dir: Path) -> str:
    """sha256 of every file of the adapter directory (names and contents; our marker's revision, which picks the base
    model's commit, included), so a retrained or edited adapter never reuses an old merge."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(adapter_dir).rglob("*") if p.is_file()):
        relative = file.relative_to(adapter_dir).as_posix()
        if relative == MARKER:
            continue
        digest.update(relative.encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    digest.update(json.dumps((read_marker(adapter_dir) or {}).get("revision")).encode())
    return digest.hexdigest()


def merged_model(adapter_dir: Path, trust_remote_code: bool = False) -> tuple[Path, bool]:
    """(the merged model directory in the cache, whether an earlier merge was reused)."""
    target = cache_root() / "merged" / adapter_hash(adapter_dir)[:24]
    if (read_marker(target) or {}).get("kind") == "merged" and (target / "config.json").is_file():
        return target, True
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        merge_adapter(adapter_dir, target, trust_remote_code=trust_remote_code)
    except (ModelDirError, OSError, ValueError) as exc:
        raise ServeError(f"{adapter_dir}: cannot merge the adapter for serving: {exc}") from None
    return target, False


def generation_config_of(model_dir: Path, trust_remote_code: bool = False):
    """The directory's generation_config.json, else one from its config (an adapter's: its base model's)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model_dir))
    except OSError:
        return GenerationConfig.from_model_config(model_config_of(model_dir, trust_remote_code))


def stop_ids(model_dir: Path, trust_remote_code: bool = False) -> list[int]:
    """inference.stop_token_ids for the model in this directory, read from its generation_config and tokenizer (or
    processor) without loading its weights: the run's eos and its chat template's end-of-turn token."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    generation = generation_config_of(model_dir, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if inputs_of(model_dir, trust_remote_code).vision:  # as load_for_inference decides: the processor's template
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        tokenizer = processor if is_processor(processor) else tokenizer
    return stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)


def make_view(model_dir: Path, name: str, trust_remote_code: bool = False) -> tuple[Path, Path]:
    """(a new folder we own, the view inside it at `name`): links to each file of `model_dir`, and a
    generation_config.json of our own whose eos ids are stop_ids(). An engine started in the folder and given `name`
    serves the model under that name; the folder is removed when the server stops (remove_view)."""
    root = cache_root() / "views"
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="serve-", dir=root))
    view = folder / name
    try:
        view.mkdir(parents=True)
        for entry in Path(model_dir).iterdir():
            if entry.name not in ("generation_config.json", MARKER):
                (view / entry.name).symlink_to(entry.resolve())
        generation = generation_config_of(model_dir, trust_remote_code)
        generation.eos_token_id = stop_ids(model_dir, trust_remote_code)
        generation.save_pretrained(str(view))
    except (OSError, ValueError) as exc:
        remove_view(folder)
        raise ServeError(f"{model_dir}: cannot read its tokenizer or generation config: {exc}") from None
    except BaseException:
        remove_view(folder)
        raise
    return folder, view


def remove_view(folder: Path) -> None:
    """Remove a folder make_view made: its links and our generation_config, never what they point at."""
    folder = Path(folder)
    if folder.parent != cache_root() / "views" or not folder.name.startswith("serve-"):
        return
    for directory, subdirectories, files in os.walk(folder, topdown=False):  # never into what a link points at
        for entry in files + subdirectories:
            path = Path(directory) / entry
            path.unlink() if path.is_symlink() or not path.is_dir() else path.rmdir()
    folder.rmdir()
