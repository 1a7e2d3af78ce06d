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
    """Save a random-weight Llama and its tokenizer with save_pretrained, like a Hub model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
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
