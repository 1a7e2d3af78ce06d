"""Conversations and texts -> token ids and labels that fit in max_seq_length: only the model's own output trained,
and long conversations shortened from the prompt side so the response survives (`truncation: keep_response`)."""

from __future__ import annotations

from dataclasses import dataclass

from .chat_masking import IGNORE_INDEX, MaskingPlan, content_text, encode_conversation
from .formats import Conversation


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False
    dropped: bool = False
    response_cut: bool = False


def encode_text(text: str, tokenizer, max_seq_length: int) -> Encoded:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return Encoded(ids[:max_seq_length], list(ids[:max_seq_length]), truncated=len(ids) > max_seq_length)


def encode_chat(conversation: Conversation, tokenizer, plan: MaskingPlan, max_seq_length: int,
                train_on_inputs: bool = False, truncation: str = "keep_response",
                excess_length_strategy: str = "truncate") -> Encoded:
    """Tokens and labels of a conversation that fits in max_seq_length.

    keep_response: a conversation that is too long loses its oldest turns first, then the start of the
    last user turn, never the response (the turns after the last user message). When even the response
    alone does not fit, it keeps the end of the prompt and the start of the response (excess_length_strategy
    truncate) or is dropped (drop). right: cut at max_seq_length.
    """
    messages = plan.prepare(conversation.messages)

    def encode(msgs: list[dict]) -> tuple[list[int], list[int]]:
        return encode_conversation(tokenizer, plan, msgs, conversation.tools, train_on_inputs)

    ids, labels = encode(messages)
    if len(ids) <= max_seq_length:
        return Encoded(ids, labels)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if truncation == "right" or not users:
        return Encoded(ids[:max_seq_length], labels[:max_seq_length], truncated=True)
    last_user = users[-1]
    head = [m for m in messages[:last_user] if m["role"] == "system"]
    history = [m for m in messages[:last_user] if m["role"] != "system"]
    response = messages[last_user + 1:]
    while history:  # the oldest exchange first: a user turn and what answered it
        cut = next((i for i, m in enumerate(history) if i > 0 and m["role"] == "user"), len(history))
        history = history[cut:]
        ids, labels = encode(head + history + messages[last_user:])
        if len(ids) <= max_seq_length:
            return Encoded(ids, labels, truncated=True)
    fitted = _cut_user_turn(encode, head, messages[last_user], response, tokenizer, max_seq_length)
    if fitted:
        return Encoded(*fitted, truncated=True)
    if excess_length_strategy == "drop":
        return Encoded([], [], truncated=True, dropped=True)
    ids, labels = encode(head + messages[last_user:])
    return Encoded(*_cut_response(ids, labels, tokenizer, max_seq_length), truncated=True, response_cut=True)


def _cut_response(ids: list[int], labels: list[int], tokenizer, max_seq_length: int) -> tuple[list[int], list[int]]:
    """A conversation whose response alone is too long: the end of its prompt, at most half of max_seq_length
    (after bos, kept where the tokenizer writes one), then as much of the response as fits. The response's end,
    its end-of-turn token with it, is cut off, so the model is never taught to stop where the cut falls."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), 0)
    bos = 1 if first and ids[0] == getattr(tokenizer, "bos_token_id", None) else 0
    start = max(bos, first - max(max_seq_length // 2 - bos, 0))
    ids, labels = ids[:bos] + ids[start:], labels[:bos] + labels[start:]
    return ids[:max_seq_length], labels[:max_seq_length]


def _cut_user_turn(encode, head, user: dict, response, tokenizer, max_seq_length: int):
    """The longest tail of the user turn's text for which the conversation fits (binary search)."""
    content_ids = tokenizer(content_text(user["content"]), add_special_tokens=False)["input_ids"]

    def attempt(keep: int):
        text = tokenizer.decode(content_ids[len(content_ids) - keep:]) if keep else ""
        content = text if isinstance(user["content"], str) else [{"type": "text", "text": text}]
        ids, labels = encode(head + [{**user, "content": content}] + response)
        return (ids, labels) if len(ids) <= max_seq_length else None

    best = attempt(0)
    if best is None:
        return None
    low, high = 0, len(content_ids)
    while low < high:
        middle = (low + high + 1) // 2
        fitted = attempt(middle)
        if fitted is not None:
            best, low = fitted, middle
        else:
            high = middle - 1
    return best


def count_targets(labels) -> int:
    """Tokens the loss is computed on: every labelled token except the first, which nothing predicts."""
    return sum(1 for x in labels[1:] if x != IGNORE_INDEX)


def target_count(batch):
    """count_targets over a padded batch (padding is IGNORE_INDEX, so it never counts), as a 0-dim tensor on the
    batch's device: summing it waits for nothing."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def batch_targets(batch) -> int:
    return int(target_count(batch))
