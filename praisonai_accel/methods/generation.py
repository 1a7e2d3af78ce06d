"""Rollouts: completions sampled from the policy being trained, every prompt x num_generations in one batch.

Our own sampling loop over the model with a KV cache (transformers' DynamicCache) rather than `model.generate`: on
small models generate's per-token bookkeeping (logits processors, stopping criteria, cache checks) costs more than
the model's forward. Prompts are left-padded, so every row's next token is in the last column; position ids count
real tokens only (as generate computes them), and the training forward uses the same positions.

Sampling draws from torch.Generators the caller seeds (one per prompt's group, or one for the batch); `forward` is
how the model is called (the unwrapped model, or, under FSDP2, the prepared module, whose every forward is a
collective); `all_done` (FSDP2) tells whether every
rank has finished, so a rank whose rows ended (or whose token budget is spent: the tool rollouts' budgets differ from
rank to rank) keeps running forwards until all have (TRL's synced_gpus).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.unwrap import transformers_model


def left_pad(rows: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Id lists as one left-padded batch (every row's next token in the last column) and its attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: real tokens count from 0; padding gets 0 (it is never attended)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generators) -> torch.Tensor:
    """One token per row from logits [N, V]: temperature, then nucleus (top_p) filtering, then a draw. `generators`:
    one torch.Generator for the whole batch, or a list of them, one per equal slice of rows (a prompt's group): a
    group's draws then depend on its own generator and rows alone, whatever else is in the batch."""
    logits = logits.float() / temperature
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the ones before it already hold top_p of the mass (the first is always kept)
        drop = (probs.cumsum(-1) - probs) > top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    # Inverse-CDF sampling, one uniform draw per row: the same distribution as torch.multinomial, which on CPU draws
    # one random number per vocabulary entry (6x slower than the whole step at a 128k vocabulary).
    cdf = logits.softmax(-1).double().cumsum(-1)
    groups = generators if isinstance(generators, (list, tuple)) else [generators]
    size = logits.size(0) // len(groups)
    uniform = torch.cat([torch.rand(size, generator=g, dtype=torch.float64, device=logits.device) for g in groups])
    # the first token whose cumulative probability exceeds the draw: never one of probability 0 (cut by top_p)
    token = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return token.clamp_(max=logits.size(-1) - 1)


def completion_mask(completions: torch.Tensor, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [N, C]: each completion's tokens up to and including its first stop token, ended [N]: whether it
    stopped, rather than being cut at max_completion_length)."""
    is_stop = torch.isin(completions, stop_ids)
    ended = is_stop.any(-1)
    width = completions.size(1)
    first = torch.where(ended, is_stop.int().argmax(-1), torch.full_like(ended, width, dtype=torch.long))
    return torch.arange(width, device=completions.device)[None, :] <= first[:, None], ended


@dataclass
class Continuation:
    """What a turn leaves in the KV cache, for the next turn to continue from instead of prefilling it all again:
    the cache, its attention mask (0 where a row had ended: those tokens were padding), each row's last position,
    and the ids it holds."""

    past: object
    mask: torch.Tensor  # [N, L]
    last: torch.Tensor  # [N, 1]
    ids: torch.Tensor  # [N, L]

    def rows(self) -> list[list[int]]:
        """The ids each row's cache holds (its real tokens)."""
        return [row[keep].tolist() for row, keep in zip(self.ids, self.mask.bool())]

    def select(self, indices: list[int]) -> "Continuation":
        index = torch.as_tensor(indices, dtype=torch.long, device=self.mask.device)
        self.past.batch_select_indices(index)
        return Continuation(self.past, self.mask[index], self.last[index], self.ids[index])


@torch.no_grad()
def sample_completions(forward: Callable, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                       max_new_tokens: int, temperature: float, top_p: float, stop_ids: list[int], pad_id: int,
                       generators, all_done: Callable[[bool], bool] | None = None):
    """Sample a completion for every (left-padded) prompt row. `forward(input_ids, attention_mask, position_ids,
    past) -> (logits of the last position [N, V], past)`. Returns (completion ids [N, C] padded with pad_id after
    the stop, mask [N, C], ended [N])."""
    return sample_turn(forward, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_p=top_p, stop_ids=stop_ids, pad_id=pad_id, generators=generators, all_done=all_done)[:3]


@torch.no_grad()
def sample_turn(forward: Callable, new_ids: torch.Tensor, new_mask: torch.Tensor, *, max_new_tokens: int,
                temperature: float, top_p: float, stop_ids: list[int], pad_id: int, generators,
                all_done: Callable[[bool], bool] | None = None, start: Continuation | None = None):
    """sample_completions, continuing from `start` where given (then `new_ids` are only each row's tokens after what
    its cache holds, left-padded; every row has at least one). Returns its three results and the Continuation."""
    stops = torch.as_tensor(stop_ids, dtype=torch.long, device=new_ids.device)
    new_mask = new_mask.long()
    if start is None:
        mask, positions, past, prefilled = new_mask, positions_of(new_mask), None, new_ids
    else:
        mask, past = torch.cat([start.mask, new_mask], dim=1), start.past
        positions, prefilled = start.last + new_mask.cumsum(-1), torch.cat([start.ids, new_ids], dim=1)
    logits, past = forward(new_ids, mask, positions, past)
    last = positions[:, -1:]
    done = torch.zeros(new_ids.size(0), dtype=torch.bool, device=new_ids.device)
    tokens = []
    while True:
        token = sample_next(logits, temperature, top_p, generators)
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        real = (~done).long()[:, None]  # a row's stop token is its own; the padding after it is attended by nothing
        done |= torch.isin(token, stops)
        if len(tokens) >= max_new_tokens:
            if all_done is None:
                break
            done[:] = True  # this rank's budget is spent; it keeps up the forwards while another rank's is not
        finished = bool(done.all())
        if all_done(finished) if all_done is not None else finished:
            break
        mask = torch.cat([mask, real], dim=1)
        last = last + real
        logits, past = forward(token[:, None], mask, last, past)
    completions = torch.stack(tokens[:max_new_tokens], dim=1)
    keep, ended = completion_mask(completions, stops)
    fed = torch.cat([prefilled, *(token[:, None] for token in tokens[:-1])], dim=1)  # every token but the last went in
    return completions.masked_fill(~keep, pad_id), keep, ended, Continuation(past, mask, last, fed)


def cache_argument(model) -> str:
    """The keyword a transformers causal LM (a PeftModel too) takes its KV cache under: transformers 5 renames
    past_key_values to cache, model by model."""

    return "cache" if "cache" in inspect.signature(transformers_model(model).forward).parameters else "past_key_values"


def decode_step(model, cache_name: str, input_ids, attention_mask, position_ids, past):
    """One forward with the KV cache and only the last position's logits: (those logits [N, V], the cache)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                logits_to_keep=1, **{cache_name: past})
    return out.logits[:, -1], getattr(out, cache_name)
