"""Publishing to Ollama: a Modelfile derived from the tokenizer, and the model created over its HTTP API.

The chat template is Jinja; Ollama wants a Go template. Rather than translate Jinja, we render the
template around marker strings and cut the output at the markers, which gives the exact text that
goes before and after the system prompt, the user turn and the reply.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("praisonai_accel")

DEFAULT_HOST = "http://localhost:11434"
_SYS, _USER, _REPLY = "\x01SYSTEM\x01", "\x01PROMPT\x01", "\x01REPLY\x01"
BASE_MODEL_FILES = ("*.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


@dataclass
class OllamaRecipe:
    template: str
    stop: list[str]
    base: str  # FROM: an Ollama model name or a directory of safetensors
    adapter: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)  # base model files, uploaded as blobs (none when FROM a name)
    adapter_files: dict[str, Path] = field(default_factory=dict)

    def modelfile(self) -> str:
        lines = [f"FROM {self.base}"]
        if self.adapter is not None:
            lines.append(f"ADAPTER {self.adapter}")
        lines.append(f'TEMPLATE """{self.template}"""')
        lines += [f"PARAMETER stop {json.dumps(token)}" for token in self.stop]
        return "\n".join(lines) + "\n"


def _between(text: str, start: str | None, end: str) -> str:
    begin = text.index(start) + len(start) if start else 0
    return text[begin:text.index(end, begin)]


def go_template(tokenizer) -> str:
    """Ollama's TEMPLATE for this tokenizer's chat template (system, prompt, response).

    Pieces: what opens the conversation (bos, or a default system prompt), the system block, the
    user turn's opening and closing, the generation prompt, and what follows the reply.
    """
    render = lambda messages, gen=False: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    user = {"role": "user", "content": _USER}
    user_turn = render([user])
    prompt_only = render([user], gen=True)
    with_reply = render([user, {"role": "assistant", "content": _REPLY}])
    after_reply = with_reply[with_reply.index(_REPLY) + len(_REPLY):]
    second_turn = render([{"role": "user", "content": "a"}, {"role": "assistant", "content": _REPLY}, user])
    user_open = _between(second_turn, _REPLY + after_reply, _USER) if (_REPLY + after_reply) in second_turn else ""
    before_user = user_turn[: user_turn.index(_USER)]
    opening = before_user[: len(before_user) - len(user_open)] if before_user.endswith(user_open) else before_user
    user_open = user_open if before_user.endswith(user_open) else ""
    user_close = user_turn[user_turn.index(_USER) + len(_USER):]
    generation_prompt = prompt_only[len(user_turn):] if prompt_only.startswith(user_turn) else ""

    system_block = ""
    try:
        with_system = render([{"role": "system", "content": _SYS}, user])
    except Exception:  # templates that reject a system role have no system block
        with_system = ""
    if _SYS in with_system:
        between = _between(with_system, _SYS, _USER)
        system_close = between[: len(between) - len(user_open)] if user_open and between.endswith(user_open) else between
        system_block = "{{ if .System }}" + with_system[: with_system.index(_SYS)] + "{{ .System }}" + system_close
        system_block += ("{{ else }}" + opening if opening else "") + "{{ end }}"
    else:
        system_block = opening
    return (
        system_block
        + "{{ if .Prompt }}" + user_open + "{{ .Prompt }}" + user_close + "{{ end }}"
        + generation_prompt + "{{ .Response }}" + after_reply.rstrip("\n")
    )


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


def recipe_for(adapter_or_model: Path, ollama_base: str | None = None) -> OllamaRecipe:
    """How to build the Ollama model from a trained adapter dir (FROM base + ADAPTER) or a merged model dir."""
    from transformers import AutoTokenizer

    source = Path(adapter_or_model)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    template = go_template(tokenizer)
    stops = stop_tokens(tokenizer, template)
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


def publish(adapter_or_model: Path, name: str, ollama_base: str | None = None, push: bool = False,
            host: str | None = None, client=None) -> Path:
    """Write <dir>/Modelfile and create the model; returns the Modelfile's path."""
    recipe = recipe_for(adapter_or_model, ollama_base)
    modelfile = Path(adapter_or_model) / "Modelfile"
    modelfile.write_text(recipe.modelfile())
    create_model(recipe, name, host=host, push=push, client=client)
    return modelfile
