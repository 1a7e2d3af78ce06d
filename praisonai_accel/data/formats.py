"""Rows -> conversations, and the check that a row is one: which format a dataset is in (alpaca, sharegpt,
messages, text), why a row does not fit it (in words, one reason per kind of fault), and the conversation or text
a row that fits becomes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable

from ..config import DatasetSpec
from .chat_masking import content_text

ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bot": "assistant", "model": "assistant", "function_call": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
}
KNOWN_ROLES = (*ROLE_NAMES, "developer")  # OpenAI's newer name for system; templates that know it read it as is
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "thinking", "reasoning")


class DataError(Exception):
    """Bad or unusable training data, phrased for the user."""


class RowProblem(str):
    """Why a row cannot be trained, in words; `kind` groups rows for the counts by reason."""

    kind: str

    def __new__(cls, kind: str, text: str) -> "RowProblem":
        problem = super().__new__(cls, text)
        problem.kind = kind
        return problem

    def __reduce__(self):  # kept across datasets.map's worker processes
        return RowProblem, (self.kind, str(self))


TOO_LONG = "does not fit in max_seq_length"  # the kind of the one reason a row is dropped rather than refused


def detect_format(columns: Iterable[str], spec: DatasetSpec) -> str:
    if spec.format != "auto":
        return spec.format
    columns = set(columns)
    if {"instruction", "output"} <= columns:
        return "alpaca"
    if "conversations" in columns:
        return "sharegpt"
    if "messages" in columns:
        return "messages"
    if spec.text_field in columns:
        return "text"
    raise DataError(
        f"dataset {spec.name}: cannot tell its format from columns {sorted(columns)}; set format: alpaca | sharegpt | messages | text"
    )


# ---------------------------------------------------------------- the check

def _kind_of(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "a list", dict: "an object", str: "text"}.get(type(value), type(value).__name__)


def _field(row: dict, key: str, expected: str = "text", optional: bool = False) -> RowProblem | None:
    """A field of the row that must hold non-empty text (or a non-empty list)."""
    if key not in row:
        if optional:
            return None
        return RowProblem("missing field", f"field '{key}' is missing (the row has: {', '.join(sorted(map(str, row))) or 'nothing'})")
    value = row[key]
    if value is None:
        return None if optional else RowProblem("null field", f"field '{key}' is null")
    wanted = str if expected == "text" else list
    if not isinstance(value, wanted):
        return RowProblem("wrongly typed field", f"field '{key}' is {_kind_of(value)}, not {expected}")
    if not optional and not (value.strip() if isinstance(value, str) else value):
        return RowProblem("empty conversation" if expected == "a list" else "empty field",
                          "the conversation is empty" if expected == "a list" else f"field '{key}' is empty")
    return None


def check_row(row, fmt: str, spec: DatasetSpec) -> RowProblem | None:
    """Why this row cannot be trained as `fmt`, or None when it can."""
    if not isinstance(row, dict):
        return RowProblem("not an object", f"{_kind_of(row)}, not an object")
    if fmt == "text":
        return _field(row, spec.text_field)
    if fmt == "alpaca":
        return _field(row, "instruction") or _field(row, "input", optional=True) or _field(row, "output")
    key = "conversations" if fmt == "sharegpt" else "messages"
    problem = _field(row, key, "a list") or _tools_problem(row)
    if problem:
        return problem
    roles = []
    for number, turn in enumerate(row[key], 1):
        problem = (_sharegpt_turn_problem if fmt == "sharegpt" else _message_problem)(turn, number)
        if problem:
            return problem
        roles.append(ROLE_NAMES.get(_raw_role(turn), _raw_role(turn)))
    if "assistant" not in roles:
        return RowProblem("no assistant turn", "the conversation has no assistant turn to train")
    return None


def _raw_role(turn: dict) -> str:
    role = turn.get("from") if turn.get("from") is not None else turn.get("role")
    return role.lower() if isinstance(role, str) else ""


def _role_problem(turn, number: int, key: str) -> RowProblem | None:
    if not isinstance(turn, dict):
        return RowProblem("malformed turn", f"turn {number} is {_kind_of(turn)}, not an object")
    role = turn.get(key)
    if role is None:
        return RowProblem("missing role", f"turn {number} has no '{key}'")
    if not isinstance(role, str):
        return RowProblem("wrongly typed field", f"turn {number}'s '{key}' is {_kind_of(role)}, not text")
    if role.lower() not in KNOWN_ROLES:
        return RowProblem("unknown role", f"turn {number} has the unknown role '{role}' (known: {', '.join(KNOWN_ROLES)})")
    return None


def _sharegpt_turn_problem(turn, number: int) -> RowProblem | None:
    uses_role = isinstance(turn, dict) and turn.get("from") is None and turn.get("role") is not None
    problem = _role_problem(turn, number, "role" if uses_role else "from")
    if problem:
        return problem
    role = _raw_role(turn)
    value = _turn_value(turn)
    if value is not None and not isinstance(value, str):
        return RowProblem("wrongly typed field", f"turn {number} ({role})'s value is {_kind_of(value)}, not text")
    if not (value or "").strip():
        if role == "system":
            return None  # an empty system prompt says nothing; it is left out
        return RowProblem("no content", f"turn {number} ({role}) has no content")
    if role == "function_call" and _function_calls(value) is None:
        return RowProblem("malformed tool call", f"turn {number} (function_call) is not a JSON call with a name")
    return None


def _message_problem(message, number: int) -> RowProblem | None:
    problem = _role_problem(message, number, "role")
    if problem:
        return problem
    role, content, calls = message["role"].lower(), message.get("content"), message.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(_call_name(c) for c in calls)):
        return RowProblem("malformed tool call", f"turn {number} ({role})'s tool_calls are not a list of calls with a name")
    if content is not None and not isinstance(content, (str, list)):
        return RowProblem("wrongly typed field", f"turn {number} ({role})'s content is {_kind_of(content)}, not text")
    if isinstance(content, list) and not all(isinstance(b, dict) for b in content):
        return RowProblem("wrongly typed field", f"turn {number} ({role})'s content is a list of something other than blocks")

    if not content_text(content).strip() and not calls and not (isinstance(content, list) and content):
        if role in ("system", "developer"):
            return None
        return RowProblem("no content", f"turn {number} ({role}) has no content")
    return None


def _call_name(call) -> str | None:
    if not isinstance(call, dict):
        return None
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    return name if isinstance(name, str) and name else None


def _function_calls(value: str) -> list[dict] | None:
    """LLaMA-Factory's function_call value: one call, or a list of calls, as JSON with a name each."""
    try:
        calls = json.loads(value)
    except ValueError:
        return None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(_call_name(c) for c in calls):
        return None
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _tools_problem(row: dict) -> RowProblem | None:
    tools = row.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            return RowProblem("invalid tools", f"field 'tools' is not valid JSON ({getattr(exc, 'msg', exc)})")
    if tools in (None, "") or isinstance(tools, list) and all(isinstance(t, dict) for t in tools):
        return None
    return RowProblem("invalid tools", f"field 'tools' is {_kind_of(tools)}, not a list of tool descriptions")


# ---------------------------------------------------------------- row -> conversation

@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None


def _tools_of(example: dict) -> list[dict] | None:
    tools = example.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    return list(tools) if tools else None


def _turn_value(turn: dict):
    return turn.get("value") if turn.get("value") is not None else turn.get("content")


def _sharegpt_turn(turn: dict) -> dict:
    raw_role = _raw_role(turn)
    content = _turn_value(turn) or ""
    message = {"role": ROLE_NAMES.get(raw_role, "user"), "content": content if isinstance(content, (str, list)) else str(content)}
    if raw_role == "function_call":  # LLaMA-Factory's sharegpt: the call (or a list of calls) as JSON in the value
        calls = _function_calls(message["content"])
        if calls is not None:
            message = {"role": "assistant", "content": "", "tool_calls": calls}
    return message


def _is_empty_system(message: dict) -> bool:
    return message["role"] in ("system", "developer") and not content_text(message.get("content")).strip()


def to_conversation(example: dict, fmt: str, spec: DatasetSpec) -> Conversation | str:
    """One row (that check_row accepts) as a conversation, or as plain text for format: text."""
    if fmt == "text":
        return str(example[spec.text_field])
    if fmt == "alpaca":
        prompt = str(example["instruction"])
        if example.get("input"):
            prompt += "\n\n" + str(example["input"])
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(example["output"])}]
    elif fmt == "sharegpt":
        messages = [_sharegpt_turn(turn) for turn in example["conversations"]]
    else:
        messages = [{k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None} for m in example["messages"]]
        for message in messages:
            message["role"] = ROLE_NAMES.get(str(message["role"]).lower(), str(message["role"]))
    messages = [m for m in messages if not _is_empty_system(m)]
    if spec.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    return Conversation(messages, _tools_of(example))


_REASONING_BLOCK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


def visible_content(text: str) -> str:
    """A reply's content without a leading <think>...</think> block (templates may move or drop reasoning)."""
    return _REASONING_BLOCK.sub("", text).strip()
