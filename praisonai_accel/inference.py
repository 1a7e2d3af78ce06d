"""Load a trained adapter (or a full model) for inference, and generate replies."""

from __future__ import annotations

import json
from pathlib import Path

from .output_dirs import read_marker


class ModelDirError(Exception):
    """A path that holds no usable model, phrased for the user."""


def resolve_model_dir(path: Path) -> Path:
    """An adapter/model directory, or a training output_dir whose final model is inside it."""
    path = Path(path)
    if not path.exists():
        raise ModelDirError(f"{path}: no such directory")
    if (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return path
    summary = path / "train_summary.json"
    if summary.is_file():
        final = Path(json.loads(summary.read_text())["final_model_dir"])
        if final.is_dir():
            return final
    if (path / "lora_model" / "adapter_config.json").is_file():
        return path / "lora_model"
    raise ModelDirError(f"{path}: holds no adapter_config.json or config.json (point at the adapter directory)")


def base_model_of(adapter_dir: Path) -> str:
    return json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]


def load_for_inference(path: Path, device: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) ready for generate(); base + adapter when `path` is an adapter.

    trust_remote_code comes from the caller (the run's config, or --trust-remote-code), never from a file in the
    model directory; the revision the run trained on does come from ours (it picks a commit, it runs nothing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(path)
    facts = read_marker(model_dir) or {}
    if facts.get("trust_remote_code") and not trust_remote_code:
        raise ModelDirError(f"{model_dir}: was trained with trust_remote_code: true; pass --trust-remote-code to run "
                            "the model's own code")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if (model_dir / "adapter_config.json").is_file():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_model_of(model_dir), dtype="auto", revision=facts.get("revision"),
                                                    trust_remote_code=trust_remote_code)
        model = PeftModel.from_pretrained(base, str(model_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto", trust_remote_code=trust_remote_code)
    model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the model's own generation_config eos ids, the tokenizer's eos, and the template's
    end-of-turn token. Qwen2.5 and Llama 3.x end a turn with <|im_end|> / <|eot_id|>, which for some checkpoints is
    not the tokenizer's eos; stopping on eos alone runs on into invented turns."""
    from .data import end_of_turn_token

    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids.append(tokenizer.eos_token_id)
    turn_end = end_of_turn_token(tokenizer)
    if turn_end is not None:
        ids.append(tokenizer.convert_tokens_to_ids(turn_end))
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))


def generate(model, tokenizer, messages: list[dict], max_new_tokens: int = 128, temperature: float = 0.0) -> str:
    import torch

    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=stop_token_ids(model, tokenizer), **sampling)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
