"""The training loss: summed next-token cross-entropy over target tokens, without full-vocabulary logits.

With a 128k-token vocabulary the LM head is most of a step: B x T x V fp32 logits (and as much again
for their gradient) for positions that are mostly prompt or padding and never trained. Here the head
is applied only at target positions (labels != -100) and its gradient is computed right away, so
backward does no recompute. A frozen head (LoRA, QLoRA) walks the vocabulary in blocks with an online
softmax: one 32 MiB tile of logits whatever the vocabulary, each block of the weight read once while
in cache. A trained head (full fine-tuning) goes a chunk of targets at a time, one chunk of logits at
once. Same loss and gradients as cross-entropy over the model's logits.

`CausalLMLoss` is the module Accelerate prepares: its forward runs the decoder and the loss, so
DDP sees every parameter the loss uses. Before training, `verify_head` checks that the decoder +
head reproduce the model's own logits (softcapping and logit scaling included); a model where they
do not is trained through its full logits instead. `ShardedCausalLMLoss` is the same for one rank's slice of
every row under sequence parallelism (sequence_parallel.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..data.chat_masking import IGNORE_INDEX
from ..models.unwrap import transformers_model

log = logging.getLogger("praisonai_accel")

CHUNK_ELEMENTS = 2**24  # a trained head: logits per chunk, 64 MiB in fp32 whatever the vocabulary
# A frozen head: targets per row chunk, and logits per (row chunk x vocabulary block) tile, 32 MiB in fp32. Whatever the
# vocabulary, only a tile of logits exists and each vocabulary block of the weight is read from memory once per row
# chunk, while it is in cache, for both of its matmuls.
FROZEN_HEAD_ROWS = 2048
TILE_ELEMENTS = 2**23
VOCAB_BLOCK = 4096  # at most: a block of a 4k-wide weight is 8 MiB in fp32 and stays in cache between its two matmuls


def full_logits_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference: summed cross-entropy over the model's full logits (labels shifted, not logits)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of the head's matmuls: autocast's under mixed precision (matmuls given an out= buffer would
    escape it and run in fp32), else the hidden states' own."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """a @ b, into `out` when given: a reused buffer on CPU, where a fresh 32+ MiB tensor is page-faulted in again."""
    return torch.mm(a, b, out=out) if out is not None else a @ b


def _transform(logits, bias, softcap, scale):
    """The head's logits from the projection, in place: bias, logit scale (Cohere), softcapping (Gemma 2/3).
    Returns the softcap's derivative factor 1 - tanh^2 (None without softcapping)."""
    if bias is not None:
        logits += bias.float()
    if scale is not None:
        logits *= scale
    if softcap is None:
        return None
    capped = logits.div_(softcap).tanh_()
    slope = 1 - capped * capped
    capped.mul_(softcap)
    return slope


def frozen_head_walk(hidden, weight, bias, targets, softcap, scale):
    """(log softmax(head(h_i))[y_i] per row, d log p_i / d h_i or None), the head frozen: an online softmax.

    Per row chunk, the vocabulary is walked once in blocks; each block's logits update a running max and sum of
    exponentials (rescaled as the max grows) and add exp(logits - max) @ W_block to a running sum, so
    d log p / dh = W_y - sum_v softmax_v W_v comes out exact at the end without a second pass over the weight."""
    compute = _compute_dtype(hidden)
    w = weight if weight.dtype == compute else weight.to(compute)
    rows_total, width = hidden.shape
    vocab = weight.size(0)
    needs_hidden = hidden.requires_grad
    logps = torch.empty(rows_total, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_hidden else None
    rows = max(1, min(FROZEN_HEAD_ROWS, rows_total))
    block = max(1, min(vocab, VOCAB_BLOCK, TILE_ELEMENTS // rows))
    fp32 = compute == torch.float32
    tile = torch.empty(rows, block, dtype=torch.float32, device=hidden.device) if fp32 and rows_total else None
    for start in range(0, rows_total, rows):
        h, y = hidden[start:start + rows].to(compute), targets[start:start + rows]
        n = h.size(0)
        peak = torch.full((n,), float("-inf"), device=h.device)
        norm = torch.zeros(n, device=h.device)
        target_logit = torch.zeros(n, device=h.device)
        target_slope = torch.ones(n, device=h.device) if softcap is not None else None
        acc = torch.zeros(n, width, device=h.device) if needs_hidden else None
        for v0 in range(0, vocab, block):
            w_block = w[v0:v0 + block]
            logits = _matmul(h, w_block.t(), tile[:n, :w_block.size(0)] if fp32 else None).float()
            slope = _transform(logits, None if bias is None else bias[v0:v0 + block], softcap, scale)
            here = ((y >= v0) & (y < v0 + w_block.size(0))).nonzero().squeeze(1)
            target_logit[here] = logits[here, y[here] - v0]
            if slope is not None:
                target_slope[here] = slope[here, y[here] - v0]
            new_peak = torch.maximum(peak, logits.amax(dim=-1))
            rescale = (peak - new_peak).exp_()
            exp = logits.sub_(new_peak[:, None]).exp_()
            norm.mul_(rescale).add_(exp.sum(dim=-1))
            peak = new_peak
            if acc is None:
                continue
            if slope is not None:
                exp *= slope
            acc.mul_(rescale[:, None])
            if fp32:
                acc.addmm_(exp, w_block)
            else:
                acc += (exp.to(compute) @ w_block).float()
        logps[start:start + n] = target_logit - peak - norm.log()
        if acc is not None:
            target_rows = w[y].float()
            if target_slope is not None:
                target_rows *= target_slope[:, None]
            grad = target_rows.sub_(acc.div_(norm[:, None]))
            grad_hidden[start:start + n] = grad * scale if scale is not None else grad
    return logps, grad_hidden


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """sum_i CE(head(h_i), y_i) and its gradient for h, the head frozen (LoRA, QLoRA): frozen_head_walk's
    log-probs and gradients, negated."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap: float | None, scale: float | None):
        logps, grad_hidden = frozen_head_walk(hidden, weight, bias, targets, softcap, scale)
        ctx.grad_hidden = None if grad_hidden is None else grad_hidden.neg_().to(hidden.dtype)
        return -logps.sum()

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, ctx.grad_hidden = ctx.grad_hidden, None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_output)
        return grad_hidden, None, None, None, None, None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(head(h_i), y_i) over rows of h, a chunk at a time; gradients are made in forward. For a trained head
    (full fine-tuning), whose weight gradient needs each row's normalised softmax."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, softcap: float | None, scale: float | None):
        needs_hidden = hidden.requires_grad
        needs_weight = weight.requires_grad
        needs_bias = bias is not None and bias.requires_grad
        compute = _compute_dtype(hidden)
        fp32 = compute == torch.float32
        w = weight if weight.dtype == compute else weight.to(compute)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        # The one full-size buffer of the loss: the weight's gradient, in the weight's own dtype (fp32 master weights
        # accumulate in fp32), summed into in place chunk by chunk.
        grad_weight = torch.zeros_like(weight, memory_format=torch.contiguous_format) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        buffer = torch.empty(min(chunk, hidden.size(0)), weight.size(0), device=hidden.device) if fp32 else None
        for start in range(0, hidden.size(0), chunk):
            h = hidden[start:start + chunk].to(compute)
            y = targets[start:start + chunk]
            logits = _matmul(h, w.t(), buffer[:h.size(0)] if fp32 else None).float()
            slope = _transform(logits, bias, softcap, scale)
            # log-sum-exp and softmax in the logits' own memory: one chunk-sized buffer, no temporaries
            target_logits = logits.gather(1, y[:, None]).squeeze(1)
            peak = logits.amax(dim=-1, keepdim=True)
            grad = logits.sub_(peak).exp_()
            norm = grad.sum(dim=-1, keepdim=True)
            total += (peak.squeeze(1) + norm.squeeze(1).log() - target_logits).sum()
            if not (needs_hidden or needs_weight or needs_bias):
                continue
            grad.div_(norm)  # softmax
            grad[torch.arange(y.numel(), device=y.device), y] -= 1
            if slope is not None:
                grad *= slope
            if scale is not None:
                grad *= scale
            if needs_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(compute)
            if needs_hidden:
                if fp32:
                    torch.mm(grad, w, out=grad_hidden[start:start + chunk])
                else:
                    grad_hidden[start:start + chunk] = grad @ w
            if needs_weight:  # addmm_ into the buffer: no vocab x hidden temporary per chunk
                same = grad_weight.dtype == compute
                grad_weight.addmm_(grad.t() if same else grad.t().to(grad_weight.dtype), h if same else h.to(grad_weight.dtype))
        # Gradients made here, handed over once in backward: kept on ctx rather than saved tensors, so backward can
        # scale them in place instead of allocating their size again.
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grads, ctx.grads = ctx.grads, None
        grads = tuple(g.mul_(grad_output) if g is not None else None for g in grads)  # in place: no second copy
        return (*grads, None, None, None, None)


def chunked_loss_sum(hidden, weight, bias, targets, softcap=None, scale=None) -> torch.Tensor:
    if not weight.requires_grad and not (bias is not None and bias.requires_grad):
        return _FrozenHeadCrossEntropy.apply(hidden, weight, bias, targets, softcap, scale)
    chunk = max(1, CHUNK_ELEMENTS // weight.size(0))
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, softcap, scale)


def vision_layer_classes(model) -> set[str]:
    """The class of a vision-language model's vision (and audio) encoder layers: the elements of the longest
    ModuleList in its towers. Some models' _no_split_modules name only a part of such a layer (Idefics3 / SmolVLM:
    Idefics3VisionAttention), which would leave the layer's MLP and norms in the root FSDP2 unit."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None or not hasattr(model, "get_encoder"):
        return set()
    classes = set()
    for modality in ("image", "audio"):
        tower = model.get_encoder(modality=modality)
        if tower is model or tower is getattr(model, "base_model", None):
            continue
        lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList) and len(m)]
        if lists:
            classes |= {type(layer).__name__ for layer in max(lists, key=len)}
    return classes


def _head_settings(config) -> tuple[float | None, float | None]:
    """Final-logit softcapping (Gemma 2/3) and logit scaling (Cohere), wherever the config keeps them."""
    configs = [config, getattr(config, "text_config", None)]
    softcap = next((c.final_logit_softcapping for c in configs if getattr(c, "final_logit_softcapping", None)), None)
    scale = next((c.logit_scale for c in configs if getattr(c, "logit_scale", None) not in (None, 1, 1.0)), None)
    return softcap, scale


class CausalLMLoss(nn.Module):
    """Decoder + loss in one forward. `causal_lm` is the model being trained (a PeftModel for LoRA)."""

    def __init__(self, causal_lm: nn.Module, chunked: bool = True, liger=None):
        super().__init__()
        self.causal_lm = causal_lm
        self.chunked = chunked
        base = transformers_model(causal_lm)
        self.softcap, self.scale = _head_settings(base.config)
        # liger-kernel's LigerFusedLinearCrossEntropyLoss, for heads without softcapping or scaling
        self.liger = liger if self.softcap is None and self.scale is None else None
        attn = getattr(base.config, "_attn_implementation", "") or ""
        self.flash = attn.startswith("flash") or "kernels-community" in attn

    # The decoder and head live inside causal_lm; they are looked up, not registered twice.
    def _decoder(self):
        base = transformers_model(self.causal_lm)
        return getattr(base, base.base_model_prefix)

    def _head(self):
        return transformers_model(self.causal_lm).get_output_embeddings()

    # What libraries read from the model they wrap, read through to the model being trained: FSDP2's transformer
    # wrapping (a unit per decoder layer, the embeddings, the final norm and the head) and weight tying.
    base_model_prefix = "decoder"

    @property
    def decoder(self) -> nn.Module:
        decoder = self._decoder()
        # A vision-language model's final norm is a child of its language model: FSDP2 gathers the head with it
        # (the chunked loss reads the head's weight without calling the head).
        return getattr(decoder, "language_model", None) or getattr(decoder, "text_model", None) or decoder

    @property
    def _no_split_modules(self):
        model = transformers_model(self.causal_lm)
        names = getattr(model, "_no_split_modules", None)
        layers = vision_layer_classes(model)
        return sorted(set(names or ()) | layers) if layers else names

    def get_input_embeddings(self):
        return transformers_model(self.causal_lm).get_input_embeddings()

    def get_output_embeddings(self):
        return self._head()

    def tie_weights(self, *args, **kwargs):
        return transformers_model(self.causal_lm).tie_weights(*args, **kwargs)

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None, **images) -> torch.Tensor:
        """`images`: a vision-language model's image inputs (pixel_values, ...), passed on to its forward."""
        if position_ids is not None:  # packed rows: the mask comes from the restarting position ids
            attention_mask = None
            if self.flash:  # varlen flash-attention reads one packed row
                input_ids, labels, position_ids = (t.reshape(1, -1) for t in (input_ids, labels, position_ids))
        if not self.chunked:
            logits = self.causal_lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False, **images).logits
            return full_logits_loss_sum(logits, labels)
        hidden = self._decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, **images).last_hidden_state
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        where = targets != IGNORE_INDEX
        hidden, targets = hidden[where], targets[where]
        head = self._head()
        if self.liger is not None:
            return self.liger(head.weight, hidden, targets, head.bias)
        return chunked_loss_sum(hidden, head.weight, head.bias, targets, self.softcap, self.scale)


class ShardedCausalLMLoss(CausalLMLoss):
    """CausalLMLoss for a slice made by sequence_parallel.shard_batch: `labels` are targets already shifted on the
    whole row, and the attention mask comes from the whole row (shard_batch), not from the slice. Returns the slice's
    summed loss."""

    def forward(self, input_ids, labels, attention_mask=None, position_ids=None) -> torch.Tensor:
        if not self.chunked:
            logits = self.causal_lm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        hidden = self._decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        where = labels != IGNORE_INDEX
        hidden, targets = hidden[where], labels[where]
        head = self._head()
        if self.liger is not None:
            return self.liger(head.weight, hidden, targets, head.bias)
        return chunked_loss_sum(hidden, head.weight, head.bias, targets, self.softcap, self.scale)


def wraps_head(module: CausalLMLoss) -> bool:
    """Is the LM head a peft layer (LoRA on lm_head, or modules_to_save)? The chunked loss multiplies by the head's
    base weight and would never train what peft added."""
    return type(module._head()).__module__.startswith("peft")


def verify_head(module: CausalLMLoss, token_ids: list[int], device) -> bool:
    """Do decoder + head (+ softcap/scale) give the model's own logits? Checked on a few tokens of plain text
    (ordinary tokens: a multimodal model's image token without an image would fail for another reason)."""
    causal_lm = module.causal_lm
    ids = torch.tensor([token_ids[:16]], device=device)
    was_training = causal_lm.training
    causal_lm.eval()
    try:
        with torch.no_grad():
            expected = causal_lm(input_ids=ids, use_cache=False).logits.float()
            hidden = module._decoder()(input_ids=ids, use_cache=False).last_hidden_state
            head = module._head()
            logits = (hidden @ head.weight.to(hidden.dtype).t()).float()
            if head.bias is not None:
                logits += head.bias.float()
            if module.scale is not None:
                logits *= module.scale
            if module.softcap is not None:
                logits = torch.tanh(logits / module.softcap) * module.softcap
    except Exception as exc:  # an architecture whose decoder cannot be called on its own
        log.info("chunked loss: %s; using the model's full logits", type(exc).__name__)
        return False
    finally:
        causal_lm.train(was_training)
    tolerance = 1e-4 if expected.dtype == torch.float32 and hidden.dtype == torch.float32 else 5e-2
    return logits.shape == expected.shape and bool(torch.allclose(logits, expected, atol=tolerance, rtol=tolerance))


def load_liger(requested, use_cuda: bool):
    """liger-kernel's fused linear cross-entropy, when asked for (true) or available with a GPU (auto)."""
    if requested is False:
        return None
    if not use_cuda:
        if requested is True:
            raise ConfigError("use_liger: true needs a CUDA GPU, and none is visible; set use_liger: auto or false")
        return None
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:
        if requested is True:
            raise ConfigError(f"use_liger: true, but liger-kernel cannot be imported ({type(exc).__name__}); "
                              "pip install 'praisonai-accel[liger]'") from None
        return None
    return LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
