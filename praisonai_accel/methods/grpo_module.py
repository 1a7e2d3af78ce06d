"""GRPO's loss module: what accelerate prepares (DDP / FSDP2). One forward, three uses (`mode`):

- "train": per-token log-probs of the completion tokens under the policy, through the chunked LM head at those
  positions only (lm_loss / preference_logps machinery: never [B, T, V] logits), then grpo_loss.policy_loss;
- "logps": the same without gradients, for the reference (`reference=True`: LoRA's adapters disabled, or the frozen
  copy of a fully fine-tuned model) — KL's ref_logps, computed during the rollout;
- "decode": one step of sampling with the KV cache (generation.py), so that under FSDP2 generation runs through the
  prepared module, whose forward gathers the sharded weights.

Log-probs are of logits divided by the sampling temperature, as TRL computes them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..data.chat_masking import IGNORE_INDEX
from . import grpo_loss
from .generation import cache_argument, decode_step
from .lm_loss import CausalLMLoss, transformers_model
from .preference_logps import row_logps
from .reference_model import ReferenceModel


class GRPOLoss(ReferenceModel, CausalLMLoss):
    def __init__(self, causal_lm, config, chunked: bool = True):
        super().__init__(causal_lm, chunked=chunked)
        self.temperature = config.temperature
        self.loss_settings = {"loss_type": config.loss_type, "beta": config.beta, "epsilon_low": config.epsilon,
                              "epsilon_high": config.epsilon_high,
                              "max_completion_length": config.max_completion_length}
        if self.softcap is not None and self.temperature != 1.0:
            self.chunked = False  # the chunked head applies scale before softcapping; temperature comes after it
        self.init_reference(causal_lm, config.beta > 0)
        self._cache_name = cache_argument(causal_lm)

    def forward(self, input_ids, attention_mask, position_ids=None, labels=None, completion_mask=None,
                advantages=None, old_logps=None, ref_logps=None, mode: str = "train", reference: bool = False,
                past=None):
        if mode == "decode":
            return self.decode(input_ids, attention_mask, position_ids, past)
        if mode == "logps":
            # the reference in eval mode; the rollout runs the policy in eval mode too (grpo.GRPO.rollout)
            which = self._reference_model() if reference else contextlib.nullcontext(self.causal_lm)
            with torch.no_grad(), which as model:
                return self.token_logps(model, input_ids, attention_mask, position_ids, labels, completion_mask)
        logps = self.token_logps(self.causal_lm, input_ids, attention_mask, position_ids, labels, completion_mask)
        loss_sum, _units, metrics = grpo_loss.policy_loss(logps, old_logps, ref_logps, advantages, completion_mask,
                                                          **self.loss_settings)
        return loss_sum, metrics

    def decode(self, input_ids, attention_mask, position_ids, past):
        return decode_step(self.causal_lm, self._cache_name, input_ids, attention_mask, position_ids, past)

    def token_logps(self, model, input_ids, attention_mask, position_ids, labels, completion_mask) -> torch.Tensor:
        """[N, C] log-probs of the completion tokens (C: completion_mask's width, the last C columns of the rows),
        0 where completion_mask is 0. `labels` holds the completion tokens where completion_mask is 1, -100
        elsewhere, so the trained positions come out in completion_mask's row-major order."""
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        where = targets != IGNORE_INDEX
        inverse_temperature = 1.0 / self.temperature
        if not self.chunked:
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).logits[where].float() * inverse_temperature
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[where][:, None]).squeeze(-1)
        else:
            base = transformers_model(model)
            decoder = getattr(base, base.base_model_prefix)
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state
            head = base.get_output_embeddings()
            scale = (self.scale or 1.0) * inverse_temperature
            logp = row_logps(hidden[where], head.weight, head.bias, targets[where], self.softcap,
                             None if scale == 1.0 else scale)
        out = torch.zeros(completion_mask.shape, dtype=logp.dtype, device=logp.device)
        return out.masked_scatter(completion_mask.bool(), logp)
