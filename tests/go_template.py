"""A small Go text/template interpreter for the subset an Ollama TEMPLATE of ours uses, with Ollama's own
execution of a `.Messages` template (system messages joined into .System, same-role messages collated).

Written independently of praisonai_accel.publish.ollama_template, so a test can render the TEMPLATE text itself
and compare it with the Jinja chat template.

Supported: literal text, {{ .Field }}, {{ if PIPE }} / {{ else if PIPE }} / {{ else }} / {{ end }},
{{ range .Messages }}, and PIPE = .Field | eq .Field "string" | ne .Field "string". Trim markers ({{- -}})
are honoured.
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def tokenize(text: str) -> list[tuple[str, str]]:
    parts: list[tuple[str, str]] = []
    position = 0
    for match in _ACTION.finditer(text):
        literal = text[position:match.start()]
        if match.group(1):
            literal = literal.rstrip()
        parts.append(("text", literal))
        parts.append(("action", match.group(2)))
        position = match.end()
        if match.group(3):
            rest = text[position:]
            position += len(rest) - len(rest.lstrip())
    parts.append(("text", text[position:]))
    return [p for p in parts if p != ("text", "")]


def parse(tokens: list[tuple[str, str]], index: int = 0, stop=("end",)):
    """A list of nodes up to one of `stop`; returns (nodes, index of the stop token)."""
    nodes = []
    while index < len(tokens):
        kind, value = tokens[index]
        if kind == "text":
            nodes.append(("text", value))
            index += 1
            continue
        word = value.split()[0]
        if word in stop or (word == "else" and "else" in stop):
            return nodes, index
        if word == "if":
            node, index = _parse_if(tokens, index, value[2:].strip())
            nodes.append(node)
        elif word == "range":
            body, index = parse(tokens, index + 1, stop=("end",))
            nodes.append(("range", value[5:].strip(), body))
            index += 1
        elif value.startswith("."):
            nodes.append(("field", value))
            index += 1
        else:
            raise ValueError(f"unsupported action {{{{ {value} }}}}")
    if stop != ("<eof>",):
        raise ValueError("unterminated block")
    return nodes, index


def _parse_if(tokens, index, condition):
    body, index = parse(tokens, index + 1, stop=("end", "else"))
    word = tokens[index][1]
    if word == "end":
        return ("if", condition, body, []), index + 1
    if word.startswith("else if"):
        nested, index = _parse_if(tokens, index, word[len("else if"):].strip())
        return ("if", condition, body, [nested]), index
    orelse, index = parse(tokens, index + 1, stop=("end",))
    return ("if", condition, body, orelse), index + 1


def _value(expression: str, scope: dict):
    if expression.startswith('"'):
        return expression.strip('"')
    return scope.get(expression[1:], "") if expression != "." else scope


def _test(condition: str, scope: dict) -> bool:
    words = re.findall(r'"[^"]*"|\S+', condition)
    if words[0] in ("eq", "ne"):
        equal = _value(words[1], scope) == _value(words[2], scope)
        return equal if words[0] == "eq" else not equal
    return bool(_value(words[0], scope))


def execute(nodes, scope: dict, root: dict) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "field":
            out.append(str(_value(node[1], scope)))
        elif node[0] == "if":
            out.append(execute(node[2] if _test(node[1], scope) else node[3], scope, root))
        elif node[0] == "range":
            for item in _value(node[1], root):
                out.append(execute(node[2], item, root))
    return "".join(out)


def render_ollama(template: str, messages: list[dict]) -> str:
    """What Ollama's Template.Execute produces for a .Messages template."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    collated: list[dict] = []
    for message in messages:
        if collated and collated[-1]["Role"] == message["role"] and message["role"] != "tool":
            collated[-1]["Content"] += "\n\n" + message["content"]
        else:
            collated.append({"Role": message["role"], "Content": message["content"]})
    nodes, _ = parse(tokenize(template), stop=("<eof>",))
    root = {"System": system, "Messages": collated}
    return execute(nodes, root, root)
