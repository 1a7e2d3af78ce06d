"""The Ollama TEMPLATE for a tokenizer's chat template, written only when it reproduces the template exactly.

The chat template is Jinja; Ollama wants a Go template. Rather than translate Jinja, the template
is rendered around marker strings and cut at the markers, which gives the exact text that goes
before and after the system prompt, each user turn and each reply. Those pieces fill one fixed Go
template over `.Messages`. Before it is used, the pieces are rendered the way Ollama executes that
template (its message collation included) on several conversations and compared with the Jinja
rendering; a template that does not match (dates baked in, turns that depend on their position,
roles the pieces cannot express) gets no TEMPLATE, and Ollama detects one from the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..data.chat_masking import special_strings

_SYS, _U1, _A1, _U2 = "\x01SYSTEM\x01", "\x01USER-A\x01", "\x01REPLY-A\x01", "\x01USER-B\x01"
# Verification renders on another day: a template that prints today's date cannot be a fixed TEMPLATE.
_OTHER_DAY = {"date_string": "01 Jan 2001", "strftime_now": lambda fmt: datetime(2001, 1, 1).strftime(fmt)}


@dataclass(frozen=True)
class OllamaTemplate:
    no_system: str  # what a conversation without a system prompt starts with (bos, a default system turn)
    system_open: str | None  # before the system prompt; None when the template takes no system role
    system_close: str
    user_open: str
    user_close: str  # after the user's text: the end of the turn and the generation prompt
    reply_close: str  # after a reply, before the next user turn

    def go(self) -> str:
        """The Go template text, for a Modelfile's TEMPLATE."""
        head = self.no_system
        if self.system_open is not None:
            head = "{{ if .System }}" + self.system_open + "{{ .System }}" + self.system_close + "{{ else }}" + \
                   self.no_system + "{{ end }}"
        return (head + '{{ range .Messages }}{{ if eq .Role "user" }}' + self.user_open + "{{ .Content }}" +
                self.user_close + '{{ else if eq .Role "assistant" }}{{ .Content }}' + self.reply_close +
                "{{ end }}{{ end }}")

    def render(self, messages: list[dict]) -> str:
        """What Ollama's template engine makes of go() for these messages: system messages are joined
        into .System, consecutive messages of one role are merged, and the rest are walked in order."""
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        out = self.system_open + system + self.system_close if system and self.system_open is not None else self.no_system
        for message in collate(messages):
            if message["role"] == "user":
                out += self.user_open + message["content"] + self.user_close
            elif message["role"] == "assistant":
                out += message["content"] + self.reply_close
        return out


def collate(messages: list[dict]) -> list[dict]:
    """Ollama's collate(): consecutive messages of the same role (tool messages aside) become one."""
    merged: list[dict] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"] and message["role"] != "tool":
            merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n\n" + message["content"]}
        else:
            merged.append(dict(message))
    return merged


def _common_suffix(*texts: str) -> str:
    length = 0
    while all(length < len(t) for t in texts) and len({t[len(t) - length - 1] for t in texts}) == 1:
        length += 1
    return texts[0][len(texts[0]) - length:] if length else ""


def _user_opening(common: str, specials: list[str]) -> str:
    """Where a user turn starts within the text every user turn is preceded by: at the control token that
    introduces the role ("<|im_start|>user", "<|start_header_id|>user"), never inside a control token.
    Any split renders the same text; this one makes a TEMPLATE a person can read."""
    starts = [i for i in range(len(common)) if any(common.startswith(token, i) for token in specials)]
    if not starts:
        return common
    role = common.lower().find("user")
    before_role = [i for i in starts if 0 <= role and i <= role]
    at = before_role[-1] if before_role else starts[0]
    while True:  # back over control tokens right before it: <|START_OF_TURN_TOKEN|><|USER_TOKEN|> is one opening
        previous = next((i for i in starts if i < at and common[i:at] in specials), None)
        if previous is None:
            return common[at:]
        at = previous


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def _conversations(with_system: bool) -> list[list[dict]]:
    turn = lambda role, text: {"role": role, "content": text}
    talks = [
        [turn("user", "hello there")],
        [turn("user", "add two and three"), turn("assistant", "five"), turn("user", "and four more?")],
        [turn("user", "a"), turn("assistant", "b"), turn("user", "c"), turn("assistant", "d"), turn("user", "e")],
    ]
    if with_system:
        talks += [[turn("system", "be brief")] + talk for talk in talks[:2]]
    return talks


def derive(tokenizer) -> OllamaTemplate | None:
    """The verified template pieces for this tokenizer's chat template, or None when no TEMPLATE is faithful."""
    user = lambda text: {"role": "user", "content": text}
    try:
        one = _render(tokenizer, [user(_U1)])
        two = _render(tokenizer, [user(_U1), {"role": "assistant", "content": _A1}, user(_U2)])
        head, user_close = one.split(_U1)
        between = two[two.index(_A1) + len(_A1):two.index(_U2)]
    except Exception:  # a template that needs more than plain turns, or drops them
        return None
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": _SYS}, user(_U1)])
        system_open, rest = with_system.split(_SYS)
        system_middle = rest[:rest.index(_U1)]
    except Exception:  # templates that refuse a system role, or leave it out
        system_open = system_middle = None
    pieces = [head, between] + ([system_middle] if system_middle is not None else [])
    user_open = _user_opening(_common_suffix(*pieces), special_strings(tokenizer))
    cut = lambda text: text[: len(text) - len(user_open)]
    template = OllamaTemplate(
        no_system=cut(head), system_open=system_open, system_close=cut(system_middle) if system_middle is not None else "",
        user_open=user_open, user_close=user_close, reply_close=cut(between),
    )
    return template if _faithful(tokenizer, template) else None


def _faithful(tokenizer, template: OllamaTemplate) -> bool:
    go = template.go()
    if '"""' in go or go.count("{{") != go.count("}}") or any(
            "{{" in piece or "}}" in piece for piece in (template.no_system, template.system_open or "", template.system_close,
                                                         template.user_open, template.user_close, template.reply_close)):
        return False  # the pieces would break the Modelfile or the Go template
    for messages in _conversations(template.system_open is not None):
        try:
            if template.render(messages) != _render(tokenizer, messages, **_OTHER_DAY):
                return False
        except Exception:
            return False
    return True
