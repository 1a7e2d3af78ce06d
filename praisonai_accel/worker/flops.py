"""Model FLOPs of a training step, counted from the model and the batch's real tokens and targets.

Per real input token: 4 x the frozen decoder matrices (forward, and the gradient for the input) and 6 x the trained
ones (also their weight gradient); per token and layer, 12 x the attention width x the number of keys it attends
(causal, from its own sequence: QK^T and AV, forward and both input gradients); per target token, 4 x hidden x
vocabulary for the LM head (6 x when the head is trained). Embedding lookups, norms and activations count nothing;
a MoE layer counts only the experts a token is routed to; recomputation (gradient checkpointing) is not model work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..models.unwrap import transformers_model


@dataclass(frozen=True)
class FlopCounts:
    frozen: int  # decoder matrix parameters that take no gradient (the base under LoRA/QLoRA)
    trained: int  # decoder matrix parameters that do (LoRA adapters; everything in full fine-tuning)
    layers: int
    attention_width: int  # query heads x head dim
    head: int  # hidden x vocabulary of the LM head
    head_trained: bool

    def step(self, tokens: float, attended: float, targets: float) -> float:
        """FLOPs for `tokens` real input tokens attending `attended` keys in all, and `targets` trained tokens."""
        return ((4 * self.frozen + 6 * self.trained) * tokens + 12 * self.layers * self.attention_width * attended
                + (6 if self.head_trained else 4) * self.head * targets)

    def as_dict(self) -> dict:
        return asdict(self)


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _routed_fraction(config) -> float:
    """Of a MoE layer's expert parameters, the share one token runs through: top-k over the number of experts."""
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0


def flop_counts(model) -> FlopCounts:
    """From the model being trained (a PeftModel for LoRA): its decoder's matrices, split by whether they train."""
    base = transformers_model(model)
    config = _text_config(base.config)
    head = base.get_output_embeddings()
    embeddings = base.get_input_embeddings()
    skip = {id(p) for module in (head, embeddings) if module is not None for p in module.parameters()}
    routed = _routed_fraction(config)
    frozen = trained = 0.0
    for name, param in base.named_parameters():
        if param.ndim < 2 or id(param) in skip or "vision" in name or "audio" in name:
            continue
        quantized = getattr(param, "quant_state", None)  # a 4-bit weight holds its real shape in its quant state
        numel = math.prod(quantized.shape) if quantized is not None else param.numel()
        count = numel * (routed if ".experts." in name and "shared" not in name else 1.0)
        if param.requires_grad:
            trained += count
        else:
            frozen += count
    # an architecture that names these otherwise counts no attention rather than failing the run
    heads = getattr(config, "num_attention_heads", None) or 0
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
    head_weight = head.weight if head is not None else embeddings.weight
    return FlopCounts(frozen=int(frozen), trained=int(trained), layers=getattr(config, "num_hidden_layers", 0) or 0,
                      attention_width=heads * head_dim, head=head_weight.shape[0] * head_weight.shape[1],
                      head_trained=head_weight.requires_grad)


# Both counts are 0-dim integer tensors on the batch's device, so a step sums them over its micro-batches without
# waiting for the device.

def attended_keys(attention_mask, position_ids=None):
    """Keys attended over a batch, summed over real tokens: a token at position p of its sequence attends p + 1.
    Packed rows restart their position ids at every example; padded rows count from each row's first token."""
    import torch

    positions = torch.cumsum(attention_mask, dim=1) - 1 if position_ids is None else position_ids
    return ((positions + 1) * attention_mask.bool()).sum()


def examples_in(batch):
    """Training examples in a batch: rows, or in packed rows the sequences their position ids start."""
    mask = batch["attention_mask"].bool()
    if "position_ids" in batch:
        return ((batch["position_ids"] == 0) & mask).sum()
    return mask.any(dim=1).sum()
