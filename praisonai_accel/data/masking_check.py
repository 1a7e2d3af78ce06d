"""The masking guarantee, checked on a sample of each dataset independently of how labels were made: every assistant
reply and its end-of-turn token are trained, and no system, user or tool token is."""

from __future__ import annotations

from dataclasses import dataclass, field

from .chat_masking import IGNORE_INDEX, MaskingPlan, content_text, render, special_strings

@dataclass
class MaskingReport:
    """What a sample of examples showed: counts of each kind of problem, and an example of each."""

    checked: int = 0
    problems: dict[str, int] = field(default_factory=dict)

    def add(self, problem: str) -> None:
        self.problems[problem] = self.problems.get(problem, 0) + 1

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        return "; ".join(f"{what} in {count} of {self.checked} sampled example(s)" for what, count in self.problems.items())


def _end_of_turn_index(ids, offsets, position: int, special_ids: set[int]) -> int | None:
    """Index of the first special token at or after character `position`."""
    for index, (start, _end) in enumerate(offsets):
        if start >= position and ids[index] in special_ids:
            return index
    return None


def _tokens_within(offsets, start: int, end: int) -> list[int]:
    return [i for i, (s, e) in enumerate(offsets) if s >= start and e <= end and e > s]


def check_masking(tokenizer, plan: MaskingPlan, messages: list[dict], tools, labels: list[int], ids: list[int],
                  report: MaskingReport) -> None:
    """Check one encoded example: every assistant reply and its end-of-turn token are trained; no system,
    user or tool token is. Located by the message contents in the rendered text, not by the masking method."""
    text = render(tokenizer, plan.template, messages, tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if encoded["input_ids"] != list(ids[: len(encoded["input_ids"])]) or len(ids) != len(encoded["input_ids"]):
        return  # truncated or shortened examples are not comparable with the full rendering
    offsets = encoded["offset_mapping"]
    special_ids = set(tokenizer.convert_tokens_to_ids(special_strings(tokenizer)))
    report.checked += 1
    cursor = 0
    for message in messages:
        content = content_text(message.get("content"))
        if not content.strip():
            continue
        start = text.find(content, cursor)
        if start < 0:
            continue
        end, before = start + len(content), cursor
        cursor = end
        inside = _tokens_within(offsets, start, end)
        if message.get("role") == "assistant":
            if any(labels[i] == IGNORE_INDEX for i in inside):
                report.add("part of an assistant reply is not trained")
            for part, what in ((plan.reasoning_opening, "the reasoning opening"), (plan.header, "the header")):
                at = text.rfind(part, before, start) if part else -1
                if at >= 0 and any(labels[i] == IGNORE_INDEX for i in _tokens_within(offsets, at, at + len(part))):
                    report.add(f"{what} the model writes before an assistant reply ({part}) is not trained")
            eot = _end_of_turn_index(ids, offsets, end, special_ids)
            if eot is None or labels[eot] == IGNORE_INDEX:
                report.add("the end-of-turn token after an assistant reply is not trained")
        elif any(labels[i] != IGNORE_INDEX for i in inside):
            report.add(f"{message.get('role')} tokens are trained")
