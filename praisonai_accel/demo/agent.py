"""A tiny local model that calls tools, so multi-turn tool RL runs offline on a CPU: the demo tokenizer with a
compact ChatML chat template that renders tools, tool calls (Qwen's `<tool_call>` JSON) and tool results, the
response parser TRL uses for Qwen 3 (saved with the tokenizer, as models that ship their own parser do), and a
2-layer Llama taught, in a few seconds here, to answer "add A and B" by calling add(a, b) and then saying the sum.
"""

from __future__ import annotations

import random
from pathlib import Path

from .text import make_tiny_model

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.properties | list | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def add_records(count: int, seed: int) -> list[dict]:
    """Rows of the agent task: a conversational prompt and the `answer` a reward function checks."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": [{"role": "user", "content": f"add {a} and {b}"}], "answer": str(a + b)})
    return rows


def conversation(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": f"add {a} and {b}"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]


def make_tool_model(directory: Path, steps: int = 150, seed: int = 0) -> Path:
    """The tiny model, taught `steps` steps on add-tool conversations (more steps, fewer malformed calls)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    from transformers.utils import logging as hf_logging

    directory = make_tiny_model(Path(directory), seed=seed)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    schemas = [_schema()]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        texts = [tokenizer.apply_chat_template(conversation(rng.randint(0, 99), rng.randint(0, 99)), tools=schemas,
                                               tokenize=False) for _ in range(16)]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(add)
