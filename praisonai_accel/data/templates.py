"""The chat template a run trains with: the tokenizer loaded with its template settled (config's chat_template, the
tokenizer's own, or a plain fallback for base models), how labels are made for it (see chat_masking), and the check
that the template keeps every part of a conversation: a template with no place for tool calls or tool results would
render them as nothing, and an emptied turn would be trained."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import TrainConfig
from .chat_masking import MaskingPlan, content_text, render
from .formats import DataError, RowProblem, visible_content
from .vision_processor import load_processor, model_inputs, tokenizer_of

# Used only when the tokenizer ships no chat template (base models); saved with the tokenizer.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
    "{% else %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)


def load_tokenizer(config: TrainConfig, inputs=None):
    """The run's tokenizer with its chat template and pad token settled (ensure_chat_template): what training,
    `preprocess`, `preview` and the launcher's preprocessing all tokenize with. `inputs`: what the model takes
    (vision_processor.ModelInputs) where the caller has decided it; decided here otherwise."""
    from transformers import AutoTokenizer

    if (inputs or model_inputs(config)).vision:  # its processor's tokenizer, carrying the processor and its template
        tokenizer = tokenizer_of(load_processor(config))
        ensure_chat_template(tokenizer, config.chat_template)
        return tokenizer
    name = config.tokenizer_name or config.model_name
    revision = config.revision if name == config.model_name else None  # a revision names a commit of model_name
    tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=config.trust_remote_code)
    ensure_chat_template(tokenizer, config.chat_template)
    return tokenizer


def resolve_chat_template(value: str) -> str:
    """chat_template as written in config.yaml: Jinja text, or the path of a file holding it (a .jinja file).
    A value that is neither is refused rather than rendered as literal text around every conversation."""
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(f"chat_template: '{value}' is neither a Jinja template nor an existing file")
    text = path.read_text(encoding="utf-8")
    if "{%" not in text and "{{" not in text:
        raise DataError(f"chat_template: {path} holds no Jinja template ({{% ... %}} or {{{{ ... }}}})")
    return text


def _adds_bos(tokenizer) -> bool:
    """Would this tokenizer put bos in front of a text (Llama, Mistral and Gemma base models do)?"""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]


def ensure_chat_template(tokenizer, override: str | None = None) -> None:
    if override:
        tokenizer.chat_template = resolve_chat_template(override)
    elif not getattr(tokenizer, "chat_template", None):
        # Texts are tokenized without special tokens (the template writes them), so bos is written here when the
        # tokenizer would have added it: base Llama, Mistral and Gemma models are trained with it.
        tokenizer.chat_template = ("{{ bos_token }}" if _adds_bos(tokenizer) else "") + FALLBACK_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def describe_plan(plan: MaskingPlan) -> str:
    """How labels are made, for the log: `qwen3 (trl training template, recognised by rendering)`."""
    how = f", recognised by {plan.recognised_by}" if plan.recognised_by == "rendering" else ""
    return f"{plan.name} ({plan.method}{how})"


def template_label(plan: MaskingPlan) -> str:
    return f"'{plan.name}'" if plan.name != "custom" else "(one trl does not know)"


def _forms(text: str) -> tuple[str, ...]:
    """The text as templates may write it: as is, or JSON-escaped (Llama 3.1 writes tool results with tojson)."""
    return text, json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]


def _appears(part: str, text: str) -> bool:
    return any(form in text for form in _forms(part))


def dropped_by_template(tokenizer, plan: MaskingPlan, messages: list[dict], tools=None) -> RowProblem | None:
    """What of the conversation (prepared for the plan) the rendered text leaves out, if anything: every message's
    content, every tool call's name and argument names, every tool result must be written somewhere."""
    text = render(tokenizer, plan.template, messages, tools)
    dropped: dict[str, list[int]] = {}
    for number, message in enumerate(messages, 1):
        role = message.get("role")
        content = visible_content(content_text(message.get("content")))
        if content and not _appears(content, text):
            dropped.setdefault(f"the {role} role", []).append(number)
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = {}
            names = [str(function.get("name", ""))] + [str(k) for k in (arguments if isinstance(arguments, dict) else {})]
            if not all(_appears(name, text) for name in names if name):
                dropped.setdefault("tool calls", []).append(number)
    if not dropped:
        return None
    turns = " and ".join(f"{part} (turn {', '.join(map(str, numbers))})" for part, numbers in dropped.items())
    return RowProblem(f"chat template drops {' and '.join(dropped)}", f"the chat template {template_label(plan)} drops {turns}")
