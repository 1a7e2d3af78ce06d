"""Test-only references for GRPO's sampling (methods/generation.py): the sampler over a transformers causal LM with
its KV cache, the same draws without a cache, and what identifies a rollout's completions."""

from __future__ import annotations

import functools

import torch

from praisonai_accel.methods.generation import cache_argument, decode_step, positions_of, sample_completions


def model_forward(model):
    """`forward` for sample_completions over a transformers causal LM (a PeftModel too)."""
    return functools.partial(decode_step, model, cache_argument(model))


def naive_sample(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, top_p, stop_ids, pad_id, generators):
    """The same draws without a cache, the whole sequence through the model each token."""
    def forward(input_ids, attention_mask, position_ids, past):
        ids = input_ids if past is None else torch.cat([past, input_ids], dim=1)
        positions = positions_of(attention_mask)
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
        return logits[:, -1], ids

    return sample_completions(forward, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, stop_ids=stop_ids, pad_id=pad_id, generators=generators)


def completions_of(batch: dict) -> list[list[int]]:
    """A scored micro-batch's prompt + completion tokens, -1 where not attended: equal for equal completions."""
    return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -1).tolist()
