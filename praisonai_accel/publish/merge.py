"""Fold a LoRA adapter into its base model and save the result as safetensors + tokenizer, appearing whole or not
at all."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..models.inference import ModelDirError, load_for_inference, resolve_model_dir
from ..run_dir.output_dirs import NotOurs, check_replaceable, read_marker, replace_with


def merge_adapter(path: Path, target: Path, force: bool = False, trust_remote_code: bool = False) -> Path:
    """Fold the LoRA weights into the base model and save safetensors + tokenizer, atomically. An existing target is
    replaced only when it is an earlier merge of ours (or empty), unless the user passes force."""
    adapter_dir = resolve_model_dir(path)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ModelDirError(f"{adapter_dir}: is a full model already, there is no adapter to merge")
    target = Path(target)
    facts = {"kind": "merged", "trust_remote_code": trust_remote_code, "revision": (read_marker(adapter_dir) or {}).get("revision")}
    if target.exists() and force:
        shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    try:
        check_replaceable(target, "merge target")
    except NotOurs as exc:
        raise ModelDirError(f"{exc}; or pass --force to replace it") from None
    model, tokenizer = load_for_inference(adapter_dir, device="cpu", trust_remote_code=trust_remote_code)
    merged = model.merge_and_unload()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        replace_with(tmp, target, "merge target", **facts)
    except NotOurs as exc:  # appeared while merging
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelDirError(str(exc)) from None
    except BaseException:  # Ctrl-C or a full disk while writing: no half-written copy of the model left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
