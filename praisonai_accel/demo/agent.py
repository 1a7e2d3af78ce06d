"""A tiny local model that calls tools, so multi-turn tool RL runs offline on a CPU: the demo tokenizer with a
compact ChatML chat template that renders tools, tool calls (Qwen's `<tool_call>` JSON) and tool results, the
response parser TRL uses for Qwen 3 (saved with the tokenizer, as models that ship their own parser do), and a
2-layer Llama taught, in a few seconds here, to answer "add A and B" by calling add(a, b) and then saying the sum.
"""

from __future__ import annotations

import random
from pathlib import Path

from .text import make_tiny_model

HIGHEST = 9  # the numbers of the task: one token each, which a 2-layer model learns to copy

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
        a, b = rng.randint(0, HIGHEST), rng.randint(0, HIGHEST)
        rows.append({"prompt": [{"role": "user", "content": f"add {a} and {b}"}], "answer": str(a + b)})
    return rows


def conversation(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": f"add {a} and {b}"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]


def make_tool_model(directory: Path, steps: int = 250, seed: int = 0) -> Path:
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
        texts = [tokenizer.apply_chat_template(conversation(rng.randint(0, HIGHEST), rng.randint(0, HIGHEST)), tools=schemas,
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


def answer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last turn says the sum after calling add; otherwise 0.25 for each number the call got right (a
    signal to learn from while the answers are still wrong)."""
    out = []
    for prompt, completion, expected in zip(prompts, completions, answer):
        wanted = [int(word) for word in prompt[-1]["content"].split() if word.isdigit()]
        said = completion[-1]["content"].strip() if completion[-1]["role"] == "assistant" else ""
        called = any(m["role"] == "tool" for m in completion)
        if said == expected and called:
            out.append(1.0)
            continue
        arguments = next((c["function"].get("arguments") for m in completion for c in m.get("tool_calls") or []), None)
        arguments = arguments if isinstance(arguments, dict) else {}
        out.append(0.25 * sum(arguments.get(k) == v for k, v in zip("ab", wanted)))
    return out


class GreedySampler:
    """Greedy turns through transformers' generate (the demo's before/after check, not training)."""

    def __init__(self, model, tokenizer, stop_ids):
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, stop_ids

    def __call__(self, inputs, budgets, generators):
        import torch

        from ..methods.generation import left_pad

        pad = self.tokenizer.pad_token_id
        ids, mask = left_pad(inputs, pad)
        width = ids.shape[1]
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(budgets),
                                      eos_token_id=self.stop_ids, pad_token_id=pad)[:, width:].tolist()
        turns = []
        for row, budget in zip(out, budgets):
            end = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
            row = row[:end + 1] if end is not None else row
            turns.append((row[:budget], end is not None and end < budget))
        return turns


def success_rate(model_dir: Path, rows: list[dict], max_completion_length: int = 96) -> tuple[float, list]:
    """(the share of `rows` whose greedy trajectory ends with the right sum, after calling add; the trajectories)."""
    from ..methods.tool_rollout import TemplateTools, run_tool_rollouts
    from ..methods.tools import ToolSet
    from transformers.utils import logging as hf_logging

    from ..models.inference import load_for_inference, stop_token_ids

    hf_logging.disable_progress_bar()
    model, tokenizer = load_for_inference(Path(model_dir), device="cpu")
    stops = stop_token_ids(model, tokenizer)
    schemas = [_schema()]
    tools = ToolSet({"add": add}, {}, {None: schemas}, timeout=5.0, max_result_length=200)
    trajectories = run_tool_rollouts(GreedySampler(model, tokenizer, stops), TemplateTools(tokenizer, stops), tools,
                                     [r["prompt"] for r in rows], [schemas] * len(rows), [None] * len(rows),
                                     lambda i, t: None, max_prompt_length=64,
                                     max_completion_length=max_completion_length, max_iterations=2)
    scores = answer_reward([r["prompt"] for r in rows], [t.messages for t in trajectories], [r["answer"] for r in rows])
    return sum(s == 1.0 for s in scores) / len(rows), trajectories
