"""A tiny local model and dataset, so the whole pipeline runs offline on a CPU in seconds.

The model is a 2-layer Llama with random weights; the tokenizer is trained here, on the demo
data, with a ChatML chat template. Tests and `praisonai-accel demo` both build on this.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_NAMES = ["ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo"]
_COLOURS = ["red", "blue", "green", "black", "white", "gold"]


def demo_records(count: int = 256, seed: int = 0) -> list[dict]:
    """Alpaca-style records with learnable answers and varied lengths (some with an input)."""
    rng = random.Random(seed)
    records = []
    for index in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        name, colour = rng.choice(_NAMES), rng.choice(_COLOURS)
        kind = index % 3
        if kind == 0:
            records.append({"instruction": f"add {a} and {b}", "input": "", "output": f"{a} plus {b} is {a + b}"})
        elif kind == 1:
            words = " ".join(rng.choice(_NAMES) for _ in range(rng.randint(1, 6)))
            records.append({"instruction": "repeat the words", "input": words, "output": words})
        else:
            records.append({"instruction": f"what colour does {name} like", "input": None, "output": f"{name} likes {colour}"})
    return records


def task_records(count: int, seed: int = 0, exclude: set[str] = frozenset()) -> list[dict]:
    """A task with one checkable answer: repeat 2 or 3 names in reverse order. 10 names, so 1,100 inputs,
    and held-out prompts (`exclude`: inputs already used) were never seen in training."""
    rng = random.Random(seed)
    records, seen = [], set(exclude)
    while len(records) < count:
        words = [rng.choice(_NAMES) for _ in range(rng.randint(2, 3))]
        text = " ".join(words)
        if text in seen:
            continue
        seen.add(text)
        records.append({"instruction": "reverse the words", "input": text, "output": " ".join(reversed(words))})
    return records


def write_jsonl(records: list[dict], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # it writes blank lines to the terminal's stdout directly, past Python
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=4096,
    )


def make_tiny_model(directory: Path, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> Path:
    """Save a random-weight Llama and its tokenizer with save_pretrained, like a Hub model, printing nothing."""
    import contextlib
    import io

    from transformers.utils import logging as hf_logging

    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return _make_tiny_model(Path(directory), seed, hidden_size, layers)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()


def _make_tiny_model(directory: Path, seed: int, hidden_size: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = []
    for r in demo_records(512, seed):
        texts += [r["instruction"], r["input"] or "", r["output"], "user", "assistant", "system"]
    tokenizer = _train_tokenizer(texts, vocab_size=320)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def demo_prompt(record: dict) -> list[dict]:
    """A record's prompt as the alpaca format renders it (instruction, blank line, input)."""
    return [{"role": "user", "content": f"{record['instruction']}\n\n{record['input']}"}]


def held_out_answers(model, tokenizer, records: list[dict], max_new_tokens: int = 12) -> list[str]:
    """Greedy answers to every record's prompt, in one left-padded batch."""
    import torch

    from ..models.inference import stop_token_ids

    prompts = [tokenizer.apply_chat_template(demo_prompt(r), tokenize=False, add_generation_prompt=True) for r in records]
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_token_ids(model, tokenizer))
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in output[:, inputs["input_ids"].shape[1]:]]


def exact_match(answers: list[str], records: list[dict]) -> float:
    return sum(a == r["output"] for a, r in zip(answers, records)) / max(len(records), 1)


def shown_prompt(record: dict) -> str:
    """The prompt exactly as it is trained and asked (demo_prompt's text, the blank line visible as \\n\\n), so what
    a user types into `generate` is what the model learned."""
    return repr(demo_prompt(record)[0]["content"])


def examples_to_show(answers: list[str], expected: list[str], count: int = 3) -> list[int]:
    """Which held-out examples a demo shows: right and wrong answers in about the proportion the accuracy has, at
    least one of each where there is one, so the examples never look better (or worse) than the score."""
    right = [i for i, (a, e) in enumerate(zip(answers, expected)) if a == e]
    wrong = [i for i in range(len(expected)) if i not in set(right)]
    rights = round(count * len(right) / max(len(expected), 1))
    rights = min(max(rights, 1 if right else 0, count - len(wrong)), count - (1 if wrong else 0), len(right))
    return sorted(right[:rights] + wrong[:count - rights])


def demo_config(model_dir: Path, data_path: Path, output_dir: Path, **overrides) -> dict:
    config = {
        "model_name": str(model_dir),
        "max_seq_length": 128,
        "dataset": [{"name": str(data_path), "format": "alpaca"}],
        "finetune_type": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "learning_rate": 5e-3,
        "max_steps": 30,
        "warmup_steps": 2,
        "lr_scheduler_type": "linear",
        "logging_steps": 5,
        "seed": 42,
        "output_dir": str(output_dir),
    }
    config.update(overrides)
    return config


def preference_records(records: list[dict]) -> list[dict]:
    """Pairs on the reverse-the-words task with two valid answers, for the reward-model demo: the names reversed and
    joined by commas (chosen) or by spaces (rejected, the SFT demo's way). TRL's conversational prompt / chosen /
    rejected."""
    return [{"prompt": demo_prompt(r),
             "chosen": [{"role": "assistant", "content": ", ".join(r["output"].split())}],
             "rejected": [{"role": "assistant", "content": r["output"]}]} for r in records]


def order_records(records: list[dict]) -> list[dict]:
    """Pairs for the reward-model demo that only reading the prompt can rank: the names reversed (chosen) or left in
    the prompt's order (rejected). Both hold the same words in the same format, so a fresh score head ranks about half
    of them right; inputs that read the same reversed are left out. TRL's conversational prompt / chosen / rejected."""
    return [{"prompt": demo_prompt(r), "chosen": [{"role": "assistant", "content": r["output"]}],
             "rejected": [{"role": "assistant", "content": r["input"]}]} for r in records if r["output"] != r["input"]]


def completion_logps(model, tokenizer, prompt: list[dict], completions: list[str]) -> list[float]:
    """The summed log-probability of each completion's tokens after the chat-templated prompt, its end of turn
    included (as DPO trains it: an answer that stops early is a different answer, not a prefix of the longer one)."""
    import torch

    prefix = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    start = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    out = []
    for completion in completions:
        text = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        out.append(float(logps.gather(-1, targets[:, None])[start - 1:].sum()))
    return out


def preference_accuracy(model, tokenizer, pairs: list[dict]) -> float:
    """The fraction of pairs whose chosen completion the model gives a higher log-probability than the rejected."""
    wins = 0
    for pair in pairs:
        chosen, rejected = completion_logps(model, tokenizer, pair["prompt"],
                                            [pair["chosen"][-1]["content"], pair["rejected"][-1]["content"]])
        wins += chosen > rejected
    return wins / max(len(pairs), 1)
