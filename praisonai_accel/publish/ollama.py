"""Publishing to Ollama: a Modelfile derived from the tokenizer, and the model created over its HTTP API.

The TEMPLATE comes from `ollama_template` and is written only when it reproduces the chat template;
otherwise it is left out and Ollama detects the template from the model's own chat_template. Ollama
converts safetensors LoRA adapters only for Llama-family and Gemma 2 bases, so for any other
architecture the adapter is merged first and the model is created from the merged weights. From a GGUF file
(publish/gguf.py), the Modelfile is FROM that file, with the same TEMPLATE and stop parameters.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..data.chat_masking import template_name
from ..models.inference import inputs_of
from .gguf_llamacpp import vision_refusal
from .merge import merge_adapter
from .ollama_template import derive

log = logging.getLogger("praisonai_accel")

DEFAULT_HOST = "http://localhost:11434"
BASE_MODEL_FILES = ("*.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
# Base architectures whose safetensors LoRA adapters Ollama's converter takes (its "llama" and "gemma2").
ADAPTER_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM"}


class OllamaRefused(Exception):
    """A model this Ollama path cannot publish, phrased as one line (before anything is uploaded)."""


@dataclass
class OllamaRecipe:
    template: str | None  # None: no TEMPLATE, Ollama detects it from the model's chat template
    stop: list[str]
    base: str  # FROM: an Ollama model name or a directory of safetensors
    adapter: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)  # base model files, uploaded as blobs (none when FROM a name)
    adapter_files: dict[str, Path] = field(default_factory=dict)

    def modelfile(self) -> str:
        lines = [f"FROM {self.base}"]
        if self.adapter is not None:
            lines.append(f"ADAPTER {self.adapter}")
        if self.template is not None:
            lines.append(f'TEMPLATE """{self.template}"""')
        lines += [f"PARAMETER stop {json.dumps(token)}" for token in self.stop]
        return "\n".join(lines) + "\n"


def go_template(tokenizer) -> str | None:
    """Ollama's TEMPLATE for this tokenizer's chat template, or None when none reproduces it (said in one line)."""
    derived = derive(tokenizer)
    if derived is None:
        log.info("ollama: the chat template (%s) cannot be written as an Ollama TEMPLATE that reproduces it; "
                 "leaving TEMPLATE out, so Ollama detects it from the model's chat template",
                 template_name(tokenizer.chat_template) if isinstance(tokenizer.chat_template, str) else "custom")
        return None
    return derived.go()


def stop_tokens(tokenizer, template: str) -> list[str]:
    """The eos token, and every special token the template uses other than bos and pad."""
    special = set(getattr(tokenizer, "all_special_tokens", []))
    special |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    skip = {tokenizer.pad_token, getattr(tokenizer, "bos_token", None), None, ""}
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    stops += sorted(t for t in special - skip if t in template)
    return list(dict.fromkeys(stops))


def _base_model_dir(name: str) -> Path | None:
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        return None


def _architecture(model_dir: Path) -> str:
    try:
        return (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or ["unknown"])[0]
    except (OSError, ValueError):
        return "unknown"


def recipe_for(adapter_or_model: Path, ollama_base: str | None = None, trust_remote_code: bool = False) -> OllamaRecipe:
    """How to build the Ollama model from a trained adapter dir (FROM base + ADAPTER) or a merged model dir."""
    from transformers import AutoTokenizer

    source = Path(adapter_or_model)
    inputs = inputs_of(source, trust_remote_code)
    if inputs.vision:
        raise OllamaRefused(vision_refusal("ollama", inputs.model_type))
    tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    template = go_template(tokenizer)
    stops = stop_tokens(tokenizer, template if template is not None else str(tokenizer.chat_template or ""))
    if not (source / "adapter_config.json").exists():  # a merged or fully fine-tuned model
        return OllamaRecipe(template, stops, str(source.resolve()), files=_files(source, BASE_MODEL_FILES))
    base_name = json.loads((source / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapter = {"adapter": source.resolve(), "adapter_files": _files(source, ADAPTER_FILES)}
    if ollama_base:
        return OllamaRecipe(template, stops, ollama_base, **adapter)
    base_dir = _base_model_dir(base_name)
    if base_dir is None:
        raise FileNotFoundError(
            f"base model '{base_name}' is not on this machine; set ollama_base (an Ollama model such as llama3.2:1b) "
            "or merge the adapter first (praisonai-accel merge)"
        )
    architecture = _architecture(base_dir)
    if architecture not in ADAPTER_ARCHITECTURES:
        # replaces only an earlier merge of ours: a folder of the user's at that path is refused, never deleted
        merged = merge_adapter(source, source.with_name(source.name + "-merged"), trust_remote_code=trust_remote_code)
        log.info("ollama: Ollama imports LoRA adapters only for Llama-family and Gemma 2 bases, not %s; merged the "
                 "adapter into %s and creating the model from it", architecture, merged)
        return OllamaRecipe(template, stops, str(merged.resolve()), files=_files(merged, BASE_MODEL_FILES))
    return OllamaRecipe(template, stops, str(base_dir.resolve()), files=_files(base_dir, BASE_MODEL_FILES), **adapter)


def _files(directory: Path, patterns) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pattern in patterns:
        for path in sorted(Path(directory).glob(pattern)):
            if path.is_file():
                found[path.name] = path
    return found


def create_model(recipe: OllamaRecipe, name: str, host: str | None = None, push: bool = False, client=None) -> None:
    """Upload the files as blobs and create `name` on the Ollama server (OLLAMA_HOST, default localhost:11434)."""
    if client is None:
        try:
            import ollama
        except ImportError:
            raise RuntimeError("the ollama client is not installed; pip install 'praisonai-accel[ollama]'") from None
        client = ollama.Client(host=host or os.environ.get("OLLAMA_HOST") or DEFAULT_HOST)
    base_files = {key: client.create_blob(path) for key, path in recipe.files.items()}
    adapters = {key: client.create_blob(path) for key, path in recipe.adapter_files.items()}
    client.create(
        model=name,
        from_=None if base_files else recipe.base,
        files=base_files or None,
        adapters=adapters or None,
        template=recipe.template,
        parameters={"stop": recipe.stop} if recipe.stop else None,
    )
    log.info("created Ollama model %s", name)
    if push:
        client.push(name)
        log.info("pushed Ollama model %s", name)


def recipe_for_gguf(gguf_file: Path, tokenizer_dir: Path, trust_remote_code: bool = False) -> OllamaRecipe:
    """FROM a .gguf file (llama.cpp converted it, so any architecture it knows reaches Ollama), with the TEMPLATE and
    stop parameters derived from the trained tokenizer as for safetensors."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code)
    template = go_template(tokenizer)
    stops = stop_tokens(tokenizer, template if template is not None else str(tokenizer.chat_template or ""))
    gguf_file = Path(gguf_file).resolve()
    return OllamaRecipe(template, stops, str(gguf_file), files={gguf_file.name: gguf_file})


def publish_gguf(gguf_file: Path, tokenizer_dir: Path, name: str, push: bool = False, host: str | None = None,
                 client=None, trust_remote_code: bool = False) -> Path:
    """Write a Modelfile next to the .gguf file and create the model from it; returns the Modelfile's path."""
    recipe = recipe_for_gguf(gguf_file, tokenizer_dir, trust_remote_code)
    modelfile = Path(gguf_file).with_name("Modelfile")
    modelfile.write_text(recipe.modelfile())
    create_model(recipe, name, host=host, push=push, client=client)
    return modelfile


def publish(adapter_or_model: Path, name: str, ollama_base: str | None = None, push: bool = False,
            host: str | None = None, client=None, trust_remote_code: bool = False) -> Path:
    """Write <dir>/Modelfile and create the model; returns the Modelfile's path."""
    recipe = recipe_for(adapter_or_model, ollama_base, trust_remote_code)
    modelfile = Path(adapter_or_model) / "Modelfile"
    modelfile.write_text(recipe.modelfile())
    create_model(recipe, name, host=host, push=push, client=client)
    return modelfile
