"""Tokenizers for the verbatim chat templates that the installed trl ships, one per model family.

Each tokenizer is a small byte-level BPE with that family's real bos/eos/end-of-turn strings (and the
other control strings its template writes) registered as special tokens, as in the real checkpoints, so
the template renders and tokenizes the way it does for the real model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import trl

TEMPLATES_DIR = Path(trl.__file__).parent / "chat_templates"

# family (file-name prefix) -> bos, eos, the other control strings of that family's tokenizer
FAMILIES = {
    "cohere": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>",
               ["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>",
                "<|START_RESPONSE|>", "<|END_RESPONSE|>"]),
    "deepseek": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                  "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                  "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]),
    "diffusion_gemma": ("<bos>", "<turn|>", ["<|turn>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>",
                                             "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                                             '<|"|>', "<|image|>", "<|audio|>", "<|video|>"]),
    "gemma4": ("<bos>", "<turn|>", ["<|turn>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>",
                                    "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
                                    "<|image|>", "<|audio|>", "<|video|>"]),
    "gemma": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]),
    "glm4moe": (None, "<|endoftext|>", ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]),
    "gptoss": ("<|startoftext|>", "<|return|>", ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>",
                                                 "<|constrain|>"]),
    "idefics3": ("<|begin_of_text|>", "<end_of_utterance>", ["<image>"]),
    "lfm2": ("<|startoftext|>", "<|im_end|>", ["<|im_start|>", "<|tool_list_start|>", "<|tool_list_end|>",
                                               "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                                               "<|tool_response_end|>"]),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                                                   "<|python_tag|>"]),
    "llava_next": ("<s>", "</s>", ["<image>"]),
    "muse_glimmer": ("<|startoftext|>", "<|eot|>", ["<|start|>", "<|message|>", "<|eom|>", "<|patch|>", "<|video|>"]),
    "nemotron": ("<s>", "<|im_end|>", ["<|im_start|>"]),
    "phi3": ("<s>", "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "qwen": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                                  "<|image_pad|>"]),
    "smolvlm": ("<|im_start|>", "<end_of_utterance>", ["<image>"]),
}


def family_of(name: str) -> str:
    for family in sorted(FAMILIES, key=len, reverse=True):
        if name.startswith(family):
            return family
    raise KeyError(name)


def original_templates() -> list[str]:
    """Names of the verbatim (non-training) templates trl ships."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja") if not p.stem.endswith("_training"))


def template_text(name: str) -> str:
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def twin_of(name: str) -> str | None:
    """trl's training twin of a verbatim template, when it ships one."""
    base = name
    twin = TEMPLATES_DIR / f"{base}_training.jinja"
    return twin.read_text(encoding="utf-8") if twin.exists() else None


_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "what is the weather in paris today",
    "add two and three", "it is sunny and warm", "call the function with these arguments",
    "system user assistant tool model reasoning think answer", "0123456789 {}[]():,.\"' =-+*/\n\t",
]


@functools.lru_cache(maxsize=None)
def _base_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer.to_str()


def tokenizer_for(name: str, chat_template: str | None = None):
    """A fast tokenizer with family `name`'s special tokens and, by default, its verbatim template."""
    from tokenizers import Tokenizer
    from transformers import AddedToken, PreTrainedTokenizerFast

    bos, eos, specials = FAMILIES[family_of(name)]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_base_tokenizer_json()))
    tokens = [t for t in [bos, eos, *specials] if t]
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t in tokens]})
    tokenizer.bos_token, tokenizer.eos_token = bos, eos
    tokenizer.pad_token = eos
    tokenizer.chat_template = chat_template if chat_template is not None else template_text(name)
    return tokenizer
