"""Preference data: formats found from the columns, row checks, encoding with SFT's masking, truncation, collation.

Formats (`detect_format`):
- `paired`: TRL's prompt / chosen / rejected, plain text or conversational (lists of messages);
- `implicit`: TRL's chosen / rejected holding the whole conversation, the prompt being their common prefix;
- `sharegpt_paired`: LLaMA-Factory's `conversations` + `chosen` / `rejected` turns ({"from", "value"});
- `unpaired`: TRL's prompt / completion / label (KTO);
- `messages_label`, `sharegpt_label`: LLaMA-Factory's KTO form, `messages` (or `conversations`) + `label`, the last
  turn being the completion.

A conversation is encoded with chat_masking.encode_conversation, the masking SFT uses, and then everything before the
completion (the prompt, earlier assistant turns included) is set to -100: prompt tokens are never trained. Plain text
is tokenized as TRL does: the prompt with special tokens, the completion without, then eos. Truncation cuts the prompt
first, from the left, to max_prompt_length (bos kept), then the completion from the right to max_seq_length; each
example says which was cut (`prompt_cut`, `completion_cut`) so the run can count them. A pair whose completion keeps
no trained token is dropped with the reason, never silently.
"""

from __future__ import annotations

from ..data.chat_masking import IGNORE_INDEX, encode_conversation
from ..data import ROLE_NAMES, DataError
from ..data.formats import _sharegpt_turn

PAIRED_FORMATS = ("paired", "implicit", "sharegpt_paired")
UNPAIRED_FORMATS = ("unpaired", "messages_label", "sharegpt_label")


def detect_format(columns, spec, paired: bool) -> str:
    """The preference format from the columns; DataError (one line) naming the columns the method needs."""
    cols = set(columns)
    name = getattr(spec, "name", "dataset")
    if paired:
        if {"chosen", "rejected"} <= cols:
            if "conversations" in cols:
                return "sharegpt_paired"
            return "paired" if "prompt" in cols else "implicit"
        needs = ("prompt / chosen / rejected (or chosen / rejected with the prompt inside them, or LLaMA-Factory's "
                 "conversations / chosen / rejected)")
    else:
        if "label" in cols:
            if {"prompt", "completion"} <= cols:
                return "unpaired"
            if "messages" in cols:
                return "messages_label"
            if "conversations" in cols:
                return "sharegpt_label"
        needs = "prompt / completion / label (or LLaMA-Factory's messages / label)"
    raise DataError(f"dataset {name}: columns {sorted(cols)} are not preference data; this method needs {needs}")


def is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def clean_messages(value) -> list[dict]:
    """Messages without null keys, their roles in the names the chat templates use (ROLE_NAMES)."""
    out = []
    for m in value:
        message = {k: v for k, v in m.items() if v is not None}
        message["role"] = ROLE_NAMES.get(str(message["role"]).lower(), str(message["role"]))
        out.append(message)
    return out


def _turns(value) -> list[dict]:
    """LLaMA-Factory's sharegpt turns (one turn or a list) as messages."""
    turns = value if isinstance(value, list) else [value]
    return [_sharegpt_turn(t) for t in turns]


def text_or_messages(value, what: str) -> str | None:
    """Why `value` (the column `what`) is neither text nor a list of messages with roles, in words, or None."""
    if value is None:
        return f"'{what}' is missing or null"
    if isinstance(value, str):
        return None if value.strip() else f"'{what}' is empty"
    if is_messages(value):
        return None
    return f"'{what}' is a {type(value).__name__}, not text or a list of messages with roles"


def check_row(row: dict, fmt: str) -> str | None:
    """Why this row cannot be used, in words, or None."""
    if fmt in ("paired", "implicit"):
        for key in (("prompt", "chosen", "rejected") if fmt == "paired" else ("chosen", "rejected")):
            if (why := text_or_messages(row.get(key), key)) is not None:
                return why
        keys = ("prompt", "chosen", "rejected") if fmt == "paired" else ("chosen", "rejected")
        if len({isinstance(row[key], str) for key in keys}) > 1:
            return "prompt, chosen and rejected mix plain text and message lists"
        if row["chosen"] == row["rejected"]:
            return "chosen and rejected are the same"
        chosen, rejected = row["chosen"], row["rejected"]
        if fmt == "implicit" and (rejected[:len(chosen)] == chosen or chosen[:len(rejected)] == rejected):
            return "one of chosen and rejected begins the other: no completion of its own after the common prompt"
        return None
    if fmt == "sharegpt_paired":
        turns = row.get("conversations")
        if not isinstance(turns, list) or not turns:
            return "'conversations' is missing, null or empty"
        for key in ("chosen", "rejected"):
            value = row.get(key)
            if not isinstance(value, (dict, list)) or not value:
                return f"'{key}' is missing or null (a turn with from/value)"
        if row["chosen"] == row["rejected"]:
            return "chosen and rejected are the same"
        return None
    label = row.get("label")
    if not isinstance(label, bool) and label not in (0, 1):
        return f"'label' is {label!r}; it must be true or false"
    if fmt == "unpaired":
        for key in ("prompt", "completion"):
            if (why := text_or_messages(row.get(key), key)) is not None:
                return why
        return None
    key = "messages" if fmt == "messages_label" else "conversations"
    value = row.get(key)
    if not isinstance(value, list) or len(value) < 2:
        return f"'{key}' must hold the prompt and the completion (at least 2 messages)"
    last = value[-1].get("role", value[-1].get("from")) if isinstance(value[-1], dict) else None
    if ROLE_NAMES.get(str(last).lower()) != "assistant":
        return f"the last message of '{key}' is from '{last}', not the assistant: there is no completion"
    return None


def split_implicit(chosen, rejected):
    """TRL's extract_prompt: the common prefix (messages, or characters back to a space) is the prompt."""
    from trl.data_utils import extract_prompt

    parts = extract_prompt({"chosen": chosen, "rejected": rejected})
    return parts["prompt"], parts["chosen"], parts["rejected"]


def prompt_and_completions(row: dict, fmt: str, system_prompt: str | None = None):
    """(prompt, [completion, ...]): each a string, or a list of messages (conversational)."""
    if fmt == "paired":
        prompt, completions = row["prompt"], [row["chosen"], row["rejected"]]
    elif fmt == "implicit":
        prompt, chosen, rejected = split_implicit(row["chosen"], row["rejected"])
        completions = [chosen, rejected]
    elif fmt == "sharegpt_paired":
        prompt, completions = _turns(row["conversations"]), [_turns(row["chosen"]), _turns(row["rejected"])]
    elif fmt == "unpaired":
        prompt, completions = row["prompt"], [row["completion"]]
    else:
        turns = clean_messages(row["messages"]) if fmt == "messages_label" else _turns(row["conversations"])
        prompt, completions = turns[:-1], [turns[-1:]]
    conversational = not isinstance(completions[0], str)
    if conversational:
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else clean_messages(prompt)
        completions = [[{"role": "assistant", "content": c}] if isinstance(c, str) else clean_messages(c) for c in completions]
        if system_prompt and (not prompt or prompt[0]["role"] != "system"):
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
    return prompt, completions, conversational


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_completion(tokenizer, plan, prompt, completion, conversational: bool) -> tuple[list[int], list[int], int]:
    """(ids, labels, prompt length) of prompt + completion; labels -100 everywhere before the completion."""
    if conversational:
        ids, labels = encode_conversation(tokenizer, plan, plan.prepare(prompt + completion))
        prompt_ids, _ = encode_conversation(tokenizer, plan, plan.prepare(prompt)) if prompt else ([], [])
        k = _common_prefix(prompt_ids, ids)
        labels = [IGNORE_INDEX] * k + labels[k:]
        first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
        return ids, labels, first  # the generation header before the reply counts as prompt, as in TRL
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids, len(prompt_ids)


def truncate(ids: list[int], labels: list[int], prompt_length: int, max_prompt_length: int, max_length: int,
             bos_token_id) -> tuple[list[int], list[int], bool, bool]:
    """The prompt cut from the left to max_prompt_length (bos kept), then the whole cut from the right to
    max_length. Returns (ids, labels, prompt_cut, completion_cut)."""
    prompt_cut = prompt_length > max_prompt_length
    if prompt_cut:
        bos = 1 if ids and bos_token_id is not None and ids[0] == bos_token_id else 0
        start = prompt_length - (max_prompt_length - bos)
        ids, labels = ids[:bos] + ids[start:], labels[:bos] + labels[start:]
    completion_cut = len(ids) > max_length
    return ids[:max_length], labels[:max_length], prompt_cut, completion_cut


def encode_row(row: dict, fmt: str, tokenizer, plan, max_prompt_length: int, max_length: int,
               system_prompt: str | None = None) -> dict[str, list[int]] | str:
    """The encoded example (chosen_/rejected_ columns for pairs, completion_ columns and label for KTO), or the
    reason it was dropped."""
    prompt, completions, conversational = prompt_and_completions(row, fmt, system_prompt)
    out: dict[str, list[int]] = {"prompt_cut": [0], "completion_cut": [0]}
    names = ("chosen", "rejected") if len(completions) == 2 else ("completion",)
    for name, completion in zip(names, completions):
        ids, labels, k = encode_completion(tokenizer, plan, prompt, completion, conversational)
        ids, labels, prompt_cut, completion_cut = truncate(ids, labels, k, max_prompt_length, max_length,
                                                           getattr(tokenizer, "bos_token_id", None))
        if all(label == IGNORE_INDEX for label in labels[1:]):
            return (f"length: the {name} completion keeps no token within max_seq_length {max_length} "
                    f"(prompt cut to max_prompt_length {max_prompt_length})")
        out[f"{name}_input_ids"], out[f"{name}_labels"] = ids, labels
        out["prompt_cut"] = [int(out["prompt_cut"][0] or prompt_cut)]
        out["completion_cut"] = [int(out["completion_cut"][0] or completion_cut)]
    if "label" in row:
        out["label"] = [int(bool(row["label"]))]
    return out


def _pad(rows: list[list[int]], value: int):
    import torch

    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return out, mask


def collate_pairs(examples: list[dict], pad_token_id: int) -> dict:
    """Chosen rows then rejected rows, right-padded into one batch: one forward for both."""
    rows = [list(e["chosen_input_ids"]) for e in examples] + [list(e["rejected_input_ids"]) for e in examples]
    labels = [list(e["chosen_labels"]) for e in examples] + [list(e["rejected_labels"]) for e in examples]
    ids, mask = _pad(rows, pad_token_id)
    return _with_reference({"input_ids": ids, "attention_mask": mask, "labels": _pad(labels, IGNORE_INDEX)[0]},
                           examples, ("ref_chosen_logps", "ref_rejected_logps"))


def collate_unpaired(examples: list[dict], pad_token_id: int) -> dict:
    """KTO: the examples, then the mismatched rows of TRL's KL estimate: example i's prompt with the completion of
    example i-1 in the batch (a rotation by one, as TRL builds them); `kl_rows` says how many."""
    import torch

    rows = [list(e["completion_input_ids"]) for e in examples]
    labels = [list(e["completion_labels"]) for e in examples]
    n = len(examples)
    if n > 1:
        for i in range(n):
            prompt_length = _first_trained(labels[i])
            j = (i - 1) % n
            start = _first_trained(labels[j])
            rows.append(rows[i][:prompt_length] + rows[j][start:])
            labels.append([IGNORE_INDEX] * prompt_length + labels[j][start:])
    ids, mask = _pad(rows, pad_token_id)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": _pad(labels, IGNORE_INDEX)[0],
             "desirable": torch.tensor([bool(e["label"][0]) for e in examples]), "kl_rows": torch.tensor(n if n > 1 else 0)}
    return _with_reference(batch, examples, ("ref_logps",))


def _first_trained(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def _with_reference(batch: dict, examples: list[dict], keys: tuple[str, ...]) -> dict:
    """Precomputed reference log-probs (see reference_cache) ride along as float tensors when every example has them."""
    import torch

    if examples and all(k in e for e in examples for k in keys):
        for k in keys:
            batch[k] = torch.tensor([float(e[k]) for e in examples], dtype=torch.float32)
    return batch
