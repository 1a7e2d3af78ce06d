"""GRPO's data half: a `prompt` column (text, or conversational: a list of messages) plus any columns the reward
functions read; rows checked, prompts encoded and cut from the left, and prompt batches collated.

The preprocessing cache holds ragged int columns, so an example keeps
- `prompt_input_ids`: the prompt's tokens (a conversation rendered by the chat template with the generation prompt;
  plain text tokenized without special tokens, as TRL's GRPOTrainer does), cut from the left to max_prompt_length;
- `row`: the JSON of the whole dataset row (the prompt as written and every other column) as UTF-8 bytes, so the
  reward functions get TRL's keyword arguments without the worker reading (or importing `datasets` for) the source
  again;
- `row_number`: [dataset index, 1 for a line of a file / 0 for a row index, the number]; the preprocessing driver
  fills it (data/preprocess.py), so an exception inside a reward function names the row the way a bad row is named.
"""

from __future__ import annotations

import json

from ..data import DataError, RowProblem
from ..data.method_data import MethodData
from .method_keys import prompt_limit
from .preference_data import clean_messages, text_or_messages
from .rewards import check_columns, load_reward_functions
from .tools import load_tools

COLUMNS = ("prompt_input_ids", "row", "row_number")


def check_prompt(row: dict) -> str | None:
    """Why this row's prompt cannot be used, in words, or None."""
    value = row.get("prompt")
    why = text_or_messages(value, "prompt")
    if why is None and not isinstance(value, str) and any(not isinstance(m.get("content"), (str, list))
                                                           for m in value):
        return "a message of 'prompt' has no text content"
    return why


def prompt_messages(value, system_prompt: str | None) -> list[dict]:
    messages = clean_messages(value)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def encode_prompt(row: dict, tokenizer, max_prompt_length: int, system_prompt: str | None = None,
                  tools: list[dict] | None = None) -> tuple[list[int], bool]:
    """(prompt token ids, whether they were cut from the left to max_prompt_length); `tools`: the JSON schemas
    the chat template offers the model."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        text = tokenizer.apply_chat_template(prompt_messages(prompt, system_prompt), tools=tools or None,
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = len(ids) > max_prompt_length
    return (ids[-max_prompt_length:] if cut else ids), cut


def row_bytes(row: dict) -> list[int]:
    return list(json.dumps(row, default=str, ensure_ascii=False).encode("utf-8"))


def row_of(example: dict) -> dict:
    return json.loads(bytes(int(b) for b in example["row"]).decode("utf-8"))


class GRPOData(MethodData):
    """The data half the preprocessing driver runs (data/preprocess.py; SFT's is methods/sft_rows.SFTData)."""

    name = "grpo"
    columns = COLUMNS
    row_number_column = "row_number"  # the driver fills it with the row's number (see the module docstring)

    def __init__(self, tokenizer, config):
        self.tokenizer, self.config = tokenizer, config
        self._tools = False  # tools.ToolSet (or None) once a row is encoded

    def _schemas(self, row: dict) -> list[dict] | None:
        if self._tools is False:
            self._tools = load_tools(self.config)
        if self._tools is None:
            return None
        return self._tools.schemas[row.get("environment") if self._tools.multi_environment else None]

    def detect_format(self, columns, spec) -> str:
        if "prompt" not in set(columns):
            raise DataError(f"dataset {getattr(spec, 'name', 'dataset')}: columns {sorted(columns)} have no 'prompt'; "
                            "method grpo needs a prompt column (text or a list of messages) and any columns your "
                            "reward functions read")

        check_columns(load_reward_functions(self.config), columns, f"dataset {getattr(spec, 'name', 'dataset')}")
        return "prompt"

    def check_row(self, row: dict, fmt: str, spec):
        why = check_prompt(row)
        if why:
            return RowProblem("invalid prompt", why)
        config = self.config
        if (config.tools or config.environment_factory) and isinstance(row.get("prompt"), str):
            return RowProblem("text prompt with tools", "'prompt' is text, but tools are offered in chat turns; "
                              "write it as a list of messages ([{\"role\": \"user\", \"content\": ...}])")
        if isinstance(config.environment_factory, dict) and row.get("environment") not in config.environment_factory:
            return RowProblem("unknown environment", f"'environment' is {row.get('environment')!r}, not one of "
                              f"environment_factory's: {', '.join(config.environment_factory)}")
        return None

    def encode(self, row: dict, fmt: str, tokenizer, config, spec):
        try:
            ids, cut = encode_prompt(row, tokenizer, prompt_limit(config), getattr(spec, "system_prompt", None),
                                     self._schemas(row))
        except Exception as exc:  # a chat template that cannot render this conversation
            text = str(exc).splitlines()[0] if str(exc) else ""
            return RowProblem("chat template cannot render it",
                              f"the chat template cannot render it: {type(exc).__name__}: {text}")
        if not ids:
            return RowProblem("invalid prompt", "'prompt' has no token once encoded")
        return {"prompt_input_ids": ids, "row": row_bytes(row), "row_number": [0, 0, 0], "truncated": cut,
                "response_cut": False}

    def length(self, example: dict) -> int:
        return len(example["prompt_input_ids"])


def collate_prompts(examples: list[dict], pad_token_id: int) -> dict:
    """Prompts left-padded (every row's next token in the last column), the rows for the reward functions, and an
    all -100 `labels` (nothing is trained before the rollout, which replaces this batch)."""
    import torch

    from .generation import left_pad

    ids, mask = left_pad([list(e["prompt_input_ids"]) for e in examples], pad_token_id)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.full_like(ids, -100),
            "rows": [row_of(e) for e in examples],
            "row_numbers": torch.as_tensor([list(e["row_number"]) for e in examples], dtype=torch.long)}
