"""Per-sequence log-probs of the trained tokens, through the chunked LM head: never full-vocabulary logits.

Preference losses need log p(y_t | x, y_<t) summed over each completion, with a gradient that differs per sequence
(its weight in the loss). As in loss.py, the head is applied only at target positions (labels != -100):

- a frozen head (LoRA, QLoRA): the vocabulary is walked in blocks with an online softmax, one tile of logits at a
  time; each row's gradient d log p / d h is made in that same walk and scaled per row in backward (no recompute);
- a trained head (full fine-tuning): chunks of rows in forward keep only each row's log-sum-exp; backward recomputes
  a chunk's logits to scale its softmax per row and accumulate the head's gradient.

`sequence_logps` runs decoder + head on a padded batch and sums the rows into their sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.chat_masking import IGNORE_INDEX
from ..models.unwrap import transformers_model
from .lm_loss import CHUNK_ELEMENTS, _compute_dtype, _transform, frozen_head_walk


class _FrozenHeadLogProbs(torch.autograd.Function):
    """log softmax(head(h_i))[y_i] per row, the head frozen; gradients for h made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, scale):
        out, grad_hidden = frozen_head_walk(hidden, weight, bias, targets, softcap, scale)
        ctx.grad_hidden = grad_hidden
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, ctx.grad_hidden = ctx.grad_hidden, None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_output[:, None]).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None


class _TrainedHeadLogProbs(torch.autograd.Function):
    """The same for a trained head: forward keeps each row's log-sum-exp; backward recomputes a chunk of logits at a
    time, so one chunk of logits exists at once whatever the vocabulary."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, scale):
        compute = _compute_dtype(hidden)
        w = weight if weight.dtype == compute else weight.to(compute)
        chunk = max(1, CHUNK_ELEMENTS // weight.size(0))
        out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.size(0), chunk):
            logits = (hidden[start:start + chunk].to(compute) @ w.t()).float()
            _transform(logits, bias, softcap, scale)
            lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            out[start:start + chunk] = logits.gather(1, targets[start:start + chunk, None]).squeeze(1) - lse[start:start + chunk]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.settings = (chunk, softcap, scale, compute)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, softcap, scale, compute = ctx.settings
        w = weight if weight.dtype == compute else weight.to(compute)
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        needs_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        for start in range(0, hidden.size(0), chunk):
            h, y = hidden[start:start + chunk].to(compute), targets[start:start + chunk]
            logits = (h @ w.t()).float()
            slope = _transform(logits, bias, softcap, scale)
            # d log p_y / d logits = onehot(y) - softmax, times each row's upstream gradient
            grad = logits.sub_(lse[start:start + chunk, None]).exp_().neg_()
            grad[torch.arange(y.numel(), device=y.device), y] += 1
            grad *= grad_output[start:start + chunk, None]
            if slope is not None:
                grad *= slope
            if scale is not None:
                grad *= scale
            if needs_bias:
                grad_bias += grad.sum(0)
            if needs_hidden:
                grad_hidden[start:start + chunk] = (grad.to(compute) @ w).to(hidden.dtype)
            if needs_weight:
                grad_weight.addmm_(grad.t(), h.float())
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def row_logps(hidden, weight, bias, targets, softcap=None, scale=None) -> torch.Tensor:
    """log p(target) per row of `hidden` through the head (weight, bias), without full-vocabulary logits."""
    if not weight.requires_grad and not (bias is not None and bias.requires_grad):
        return _FrozenHeadLogProbs.apply(hidden, weight, bias, targets, softcap, scale)
    return _TrainedHeadLogProbs.apply(hidden, weight, bias, targets, softcap, scale)


def full_logits_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: per-sequence summed log-probs and target counts from the model's full logits."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    where = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (logp * where).sum(-1), where.sum(-1)


def sequence_logps(loss_module, causal_lm, input_ids, labels, attention_mask, chunked: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs of each row's trained tokens, their count) for a padded batch, through `causal_lm`
    (the policy, or with its adapter disabled, the reference); `loss_module` knows the head's softcap and scale."""
    if not chunked:
        logits = causal_lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return full_logits_logps(logits, labels)
    base = transformers_model(causal_lm)
    decoder = getattr(base, base.base_model_prefix)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    where = targets != IGNORE_INDEX
    rows = where.nonzero()[:, 0]
    head = base.get_output_embeddings()
    logp = row_logps(hidden[where], head.weight, head.bias, targets[where], loss_module.softcap, loss_module.scale)
    sums = torch.zeros(input_ids.size(0), dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)
    return sums, where.sum(-1)
