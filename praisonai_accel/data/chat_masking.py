"""Which tokens of a conversation are trained: every assistant reply with its end-of-turn token, nothing else.

Where the ecosystem knows the answer we use it: a template that carries `{% generation %}` markers, or trl's training
twin of a known template, gives transformers' assistant-token mask (`apply_chat_template(...,
return_assistant_tokens_mask=True)`). For any other template the reply spans are found by rendering the
conversation's prefixes (`rendered_spans`). Either way `masking_check.check_masking` verifies the result on a sample
of the data, independently of how it was built."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

IGNORE_INDEX = -100
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # what templates read the reasoning from
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

METHOD_MARKERS = "generation markers"
METHOD_TWIN = "trl training template"
METHOD_SPANS = "rendered spans"


@dataclass(frozen=True)
class MaskingPlan:
    """How labels are built for one tokenizer: the template the examples are rendered with, and the method."""

    template: str
    method: str
    name: str  # the template's family when trl knows it, for messages
    content_blocks: bool = False  # vision-language templates read content as [{"type": "text", "text": ...}]
    string_arguments: bool = False  # templates that concatenate tool-call arguments as a JSON string
    recognised_by: str = ""  # "text" or "rendering" when `name` is one of trl's templates
    header: str = ""  # a reply's header the model writes itself (GPT-OSS), trained with the reply
    reasoning_opening: str = ""  # <think> and the like, trained with the reply wherever it opens it

    def prepare(self, messages: list[dict]) -> list[dict]:
        """Messages normalised, in the shape this template reads."""
        messages = [normalize_message(m) for m in messages]
        if self.content_blocks:
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str) else m
                        for m in messages]
        if self.string_arguments:
            messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                             for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        return messages


def _trl_templates_folder() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("trl")  # its files, without running its __init__ (~0.2 s in the CLI)
    return Path(spec.origin).parent / "chat_templates" if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=1)
def _known_templates() -> dict[str, str]:
    """trl's verbatim templates by text, so a tokenizer's template can be named."""
    folder = _trl_templates_folder()
    if folder is None:
        return {}
    return {p.read_text(encoding="utf-8"): p.stem for p in sorted(folder.glob("*.jinja"))}


@functools.lru_cache(maxsize=1)
def _twins() -> dict[str, str]:
    """trl's training twin of each verbatim template that has one, by the verbatim template's name."""
    folder = _trl_templates_folder()
    if folder is None:
        return {}
    return {p.stem[: -len("_training")]: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*_training.jinja"))
            if (folder / f"{p.stem[: -len('_training')]}.jinja").exists()}


def template_name(template: str) -> str:
    return _known_templates().get(template, "custom")


def _default_template(tokenizer) -> str:
    template = tokenizer.chat_template
    return template["default"] if isinstance(template, dict) else template


def plan_masking(tokenizer, spans_only: bool = False) -> MaskingPlan:
    """The best masking the ecosystem offers for this tokenizer's template (`spans_only`: the hand-written one).

    A template that is not trl's text but renders like one of trl's templates (a fine-tune's or a re-upload's
    copy, with a comment or different whitespace in its code) is recognised by rendering probe conversations,
    and trained with that template's twin."""
    template = _default_template(tokenizer)
    name, recognised_by = template_name(template), "text"
    if spans_only:
        method = METHOD_SPANS
    elif _GENERATION_MARKER.search(template):
        method = METHOD_MARKERS
    else:
        # trl's get_training_chat_template for a template without generation markers, read from trl's own files:
        # importing trl.chat_template_utils costs all of transformers' modeling code (~2 s) where the CLI needs a
        # tokenizer alone (tests/test_chat_templates.py holds the two to the same answer)
        twin = _twins().get(name)
        if twin is None and name == "custom":
            name = recognise_by_rendering(tokenizer, template) or name
            twin, recognised_by = _twins().get(name), "rendering"
        template, method = (twin, METHOD_TWIN) if twin is not None else (template, METHOD_SPANS)
    plan = MaskingPlan(template, method, name, content_blocks=_reads_content_blocks(tokenizer, template),
                       string_arguments=_wants_string_arguments(tokenizer, template),
                       recognised_by=recognised_by if name != "custom" else "")
    return replace(plan, **_model_written_parts(tokenizer, plan))


def _probe_conversations() -> list[tuple[list[dict], list | None, bool]]:
    """(messages, tools, generation prompt): a system prompt, several turns, reasoning, tool calls and prompts."""
    user = lambda text: {"role": "user", "content": text}
    reply = lambda text, **extra: {"role": "assistant", "content": text, **extra}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a word up", "parameters": {
        "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "alpha"}}}
    several = [user("first question"), reply("first answer"), user("second question"), reply("second answer")]
    return [
        (several, None, False),
        ([{"role": "system", "content": "a system prompt"}, *several], None, False),
        ([user("q1"), reply("a1", reasoning_content="r1"), user("q2"), reply("a2", reasoning_content="r2")], None, False),
        ([user("use the tool"), reply("", tool_calls=[call]), {"role": "tool", "name": "lookup", "content": "found"},
          reply("done")], tools, False),
        (several[:1], None, True),
        ([{"role": "system", "content": "a system prompt"}, *several[:3]], None, True),
    ]


def _rendering_signature(tokenizer, template: str) -> tuple:
    """What a template renders for each probe conversation (the error's type where it refuses one)."""
    shape = MaskingPlan(template, METHOD_SPANS, "", content_blocks=_reads_content_blocks(tokenizer, template),
                        string_arguments=_wants_string_arguments(tokenizer, template))
    rendered = []
    for messages, tools, prompt in _probe_conversations():
        try:
            rendered.append(render(tokenizer, template, shape.prepare(messages), tools, generation_prompt=prompt))
        except Exception as exc:
            rendered.append(type(exc).__name__)
    return tuple(rendered)


def recognise_by_rendering(tokenizer, template: str) -> str | None:
    """The name of the trl template (with a training twin) that renders every probe exactly as `template` does."""
    signature = _rendering_signature(tokenizer, template)
    if not any(isinstance(r, str) and "first answer" in r for r in signature):
        return None  # renders too little to be compared
    by_name = {stem: text for text, stem in _known_templates().items()}
    return next((name for name in _twins() if _rendering_signature(tokenizer, by_name[name]) == signature), None)


def _model_written_parts(tokenizer, plan: MaskingPlan) -> dict:
    """What a reply's turn holds before the reply that the model writes itself, as trl's twins train it:
    the header, when the model also writes it inside a reply (GPT-OSS's <|start|>assistant between its
    analysis and final channels), and the reasoning opening (<think>), even where the generation prompt
    writes it (Nemotron 3, Qwen3.5)."""
    reasoning, answer = "praisonai-accel-reasoning", "praisonai-accel-answer"
    first = [{"role": "user", "content": "q"}]
    bare = _renders(tokenizer, plan.template, plan.prepare(first))
    prompted = _renders(tokenizer, plan.template, plan.prepare(first), generation_prompt=True)
    text = _renders(tokenizer, plan.template, plan.prepare(
        [*first, {"role": "assistant", "content": answer, "reasoning_content": reasoning}]))
    if bare is None or prompted is None or text is None or answer not in text:
        return {}
    header = prompted[_common_prefix(bare, prompted):]
    parts = {}
    at_reasoning, at_answer = text.find(reasoning), text.rfind(answer)
    head = header.strip()
    if head and 0 <= at_reasoning < at_answer and head in text[at_reasoning:at_answer]:
        parts["header"] = head
    if 0 <= at_reasoning < at_answer:
        before = text[:at_reasoning]
        after_header = before[before.rindex(head) + len(head):] if head and head in before else ""
        opening = (after_header if after_header.strip() else before).rstrip().rsplit("\n", 1)[-1].strip()
        if opening and not opening.isalnum():
            parts["reasoning_opening"] = opening
    return parts


_PROBE = "\x02probe\x02"


def _renders(tokenizer, template: str, messages: list[dict], generation_prompt: bool = False) -> str | None:
    try:
        return render(tokenizer, template, messages, generation_prompt=generation_prompt)
    except Exception:
        return None


def _reads_content_blocks(tokenizer, template: str) -> bool:
    as_text = _renders(tokenizer, template, [{"role": "user", "content": _PROBE}])
    if as_text is not None and _PROBE in as_text:
        return False
    as_blocks = _renders(tokenizer, template, [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
    return as_blocks is not None and _PROBE in as_blocks


def _wants_string_arguments(tokenizer, template: str) -> bool:
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    user = {"role": "user", "content": "x"}
    try:
        render(tokenizer, template, [user, call])
        return False
    except TypeError:  # DeepSeek-V3 concatenates the arguments as a string
        call["tool_calls"][0]["function"]["arguments"] = '{"a": 1}'
        return _renders(tokenizer, template, [user, call]) is not None
    except Exception:
        return False


# ---------------------------------------------------------------- messages as templates expect them

def content_text(content) -> str:
    """The text of a message's content, whether a string or a list of blocks."""
    if isinstance(content, str):
        return content
    # Arrow-typed rows (a Hub dataset's) give an image part "text": None
    return "".join(block.get("text") or "" for block in content or [] if isinstance(block, dict))


def normalize_message(message: dict) -> dict:
    """A row's message in the shape chat templates read: reasoning under every name templates use,
    tool-call arguments as mappings, and no None values."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = out.get("content") if out.get("content") is not None else ""
    reasoning = next((out[k] for k in REASONING_KEYS if out.get(k)), None)
    if reasoning is not None and out.get("role") == "assistant":
        for key in REASONING_KEYS:
            out[key] = reasoning
    if out.get("tool_calls"):
        out["tool_calls"] = [_normalize_tool_call(call) for call in out["tool_calls"]]
    return out


def _normalize_tool_call(call: dict) -> dict:
    call = {k: v for k, v in call.items() if v is not None}
    function = dict(call.get("function") or {k: call[k] for k in ("name", "arguments") if k in call})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass
    return {"type": call.get("type", "function"), "function": function}


# ---------------------------------------------------------------- labels

def render(tokenizer, template: str, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def encode_conversation(tokenizer, plan: MaskingPlan, messages: list[dict], tools=None,
                        train_on_inputs: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and their labels (IGNORE_INDEX where not trained)."""
    if plan.method == METHOD_SPANS:
        text, spans = rendered_spans(tokenizer, plan.template, messages, tools, plan.header, plan.reasoning_opening)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        trained = [_inside(start, end, spans, text) for start, end in encoded["offset_mapping"]]
    else:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=plan.template, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        ids, trained = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    if train_on_inputs:
        return ids, list(ids)
    return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, trained)]


def _inside(start: int, end: int, spans: list[tuple[int, int]], text: str) -> bool:
    """A token is trained when it starts in a span and whatever of it lies past the span is whitespace
    (control tokens that swallow the newline after them, as Phi-3's do)."""
    return any(s <= start < e and not text[max(e, start):end].strip() for s, e in spans)


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index


def special_strings(tokenizer) -> list[str]:
    """The control tokens of this tokenizer, longest first."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted((t for t in tokens if t), key=len, reverse=True)


def end_of_turn_token(tokenizer, template: str | None = None, parts: bool = False) -> str | None:
    """The control token the chat template writes right after an assistant reply (<|im_end|>, <|eot_id|>, <|end|>,
    <end_of_turn>, ...): where a chat model stops, whether or not the tokenizer calls it eos. `template`: another
    than the tokenizer's (a processor's); `parts`: the template reads typed content parts (a vision model's)."""
    marker = "praisonai-accel-reply"
    template = template or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    if parts:
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    text = _renders(tokenizer, template, messages)
    if not text or marker not in text:
        return None
    after = text[text.rindex(marker) + len(marker):].lstrip()
    return next((token for token in special_strings(tokenizer) if after.startswith(token)), None)


def _outside_special(text: str, position: int, specials: list[str]) -> int:
    """`position`, moved back to the start of a control token it falls inside ("<|" of <|end|> vs <|return|>)."""
    for token in specials:
        at = text.rfind(token, max(0, position - len(token) + 1), position + len(token) - 1)
        if 0 <= at < position:
            position = at
    return position


def _with_terminator(text: str, reply_end: int, end: int, specials: list[str]) -> int:
    """Where a turn rendered last ends differently from the same turn followed by more (GPT-OSS closes the
    final reply with <|return|>, earlier ones with <|end|>), the agreeing prefix stops before any
    terminator: then the control token the whole conversation has right there is this turn's terminator."""
    end = _outside_special(text, end, specials)
    if any(token in text[reply_end:end] for token in specials):
        return end
    following = next((token for token in specials if text.startswith(token, end)), None)
    return end + len(following) if following else end


def _model_written_start(text: str, start: int, cursor: int, header: str, reasoning_opening: str) -> int:
    """`start` moved back over the reasoning opening (with an empty reasoning block's closing tag) and the
    header that the generation prompt wrote for the model."""
    for part, between in ((reasoning_opening, _EMPTY_REASONING_REST), (header, _WHITESPACE)):
        at = text.rfind(part, cursor, start) if part else -1
        if at >= 0 and between.fullmatch(text[at + len(part):start]):
            start = at
    return start


_EMPTY_REASONING_REST = re.compile(r"\s*(</[^<>\s]+>\s*)?")
_WHITESPACE = re.compile(r"\s*")


def rendered_spans(tokenizer, template: str, messages: list[dict], tools=None, header: str = "",
                   reasoning_opening: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn the model must generate.

    A turn starts where the prompt for it (the conversation so far plus the generation prompt) ends,
    and ends where the conversation rendered through that turn stops agreeing with the whole
    conversation: the reply, its end-of-turn token and anything the template adds before a next turn
    (Phi-3 appends eos only when nothing follows, so the prefix and the whole diverge right there).
    Whitespace after the end-of-turn belongs to no one. Templates that rewrite earlier turns (dropping
    their reasoning, say) fall back to locating the reply text and extending it over what the template
    writes after a reply, as far as the whole conversation agrees. What the model writes itself but the
    generation prompt already holds (`header`, `reasoning_opening`: see `_model_written_parts`) is moved
    into the reply's span.
    """
    text = render(tokenizer, template, messages, tools)
    specials = special_strings(tokenizer)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(tokenizer, template, messages[:index], tools, generation_prompt=True)
        through = render(tokenizer, template, messages[: index + 1], tools)
        content = content_text(message.get("content"))
        # Where the prompt stops agreeing with the whole: its end, or where a generation prompt that
        # differs from how a finished turn is written (DeepSeek's <think>) parts from it.
        start = max(_outside_special(text, _common_prefix(prompt, text), specials), cursor)
        start = _model_written_start(text, start, cursor, header, reasoning_opening)
        end = _common_prefix(through, text)
        if content in text[start:end]:
            reply_end = start + text[start:end].rfind(content) + len(content) if content else start
            end = _with_terminator(text, reply_end, end, specials)
            spans.append((start, len(text[:end].rstrip())))
            cursor = end
            continue
        located = text.find(content, cursor) if content else -1
        if located < 0:
            continue
        reply_end = located + len(content)
        at = through.rfind(content) if content else -1
        tail = through[at + len(content):] if at >= 0 else ""
        end = _with_terminator(text, reply_end, reply_end + _common_prefix(tail, text[reply_end:]), specials)
        spans.append((min(start, located), len(text[:end].rstrip())))
        cursor = end
    return text, spans
