"""The torch half of training a reward model (methods/reward.py declares the method): the loss module the recipe
prepares, and the shared-prefix rows that compute each pair's prompt once (prefix_sharing). Loading and scoring a
trained reward model is reward_scoring.py's."""

from __future__ import annotations

import torch
from torch import nn

from ..models.unwrap import transformers_model
from .reward_scoring import padded_rows, sequence_rewards


def reward_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """Each pair's loss; their mean is RewardTrainer.compute_loss on the same rewards."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference)
    losses = -nn.functional.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def reward_metric_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    chosen, rejected = chosen.detach(), rejected.detach()
    return {"accuracy": (chosen > rejected).float().sum(), "margin": (chosen - rejected).sum(),
            "mean_reward": ((chosen + rejected) / 2).sum(), "rewards/chosen": chosen.sum(),
            "rewards/rejected": rejected.sum()}


def reward_positions(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Where the classifier reads each row's reward: its rightmost token that is not the pad token (transformers'
    GenericForSequenceClassification rule, so a row ending in eos when pad is eos is read before it)."""
    columns = torch.arange(input_ids.size(1), device=input_ids.device)
    return (columns * (input_ids != pad_token_id)).argmax(-1)


def pair_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(chosen lengths, rejected lengths, shared prefix lengths) of a batch of pairs, chosen rows then rejected rows;
    None unless every row is right-padded (its real tokens first), the layout SharedPrefixRows reads."""
    mask = attention_mask.bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        return None
    chosen, rejected = input_ids.chunk(2)
    chosen_mask, rejected_mask = mask.chunk(2)
    same = (chosen == rejected) & chosen_mask & rejected_mask
    return chosen_mask.sum(1), rejected_mask.sum(1), same.long().cumprod(1).sum(1)


class SharedPrefixRows:
    """A batch of pairs (chosen rows, then rejected rows, right-padded) as one row per pair: the tokens chosen and
    rejected share from the start (the prompt, at least) once, then the rest of chosen, then the rest of rejected.
    Position ids restart the rejected rest where the prefix ends, and a 4D mask lets it see the prefix and itself but
    not chosen's rest: every token sees exactly the tokens and positions it sees in its own row, so each reward is
    the one the two rows give, with the prefix's tokens computed once instead of twice."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int,
                 lengths: tuple[torch.Tensor, ...] | None = None):
        lengths = lengths or pair_lengths(input_ids, attention_mask)
        if lengths is None:
            raise ValueError("SharedPrefixRows reads right-padded rows")
        chosen_length, rejected_length, prefix = lengths
        chosen, rejected = input_ids.chunk(2)
        pairs, width = chosen.shape
        total = chosen_length + rejected_length - prefix
        columns = torch.arange(int(total.max()), device=input_ids.device).expand(pairs, -1)
        in_chosen = columns < chosen_length[:, None]
        in_rejected = ~in_chosen & (columns < total[:, None])
        # the rejected rest: column j holds rejected's token at prefix + (j - chosen_length)
        rejected_column = prefix[:, None] + columns - chosen_length[:, None]
        self.input_ids = torch.where(in_chosen, chosen.gather(1, columns.clamp(max=width - 1)), torch.where(
            in_rejected, rejected.gather(1, rejected_column.clamp(0, width - 1)), pad_token_id))
        self.position_ids = torch.where(in_chosen, columns, torch.where(in_rejected, rejected_column, 0))
        # 0 the shared prefix, 1 chosen's rest, 2 rejected's rest, -1 padding
        segment = torch.where(in_chosen, (columns >= prefix[:, None]).long(), torch.where(in_rejected, 2, -1))
        query, key = segment[:, :, None], segment[:, None, :]
        causal = columns[:, :, None] >= columns[:, None, :]
        sees = causal & (query >= 0) & (key >= 0) & ((key == 0) | (key == query))
        # a padding token sees itself: a query that sees nothing gives NaN, which the zero weights of the tokens
        # that do not see it would still carry into every later layer
        sees |= columns[:, :, None] == columns[:, None, :]
        self.sees = sees[:, None]
        # each reward where the classifier reads it in its own row, moved to where that token now is
        chosen_at = reward_positions(chosen, pad_token_id)
        rejected_at = reward_positions(rejected, pad_token_id)
        rejected_at = torch.where(rejected_at < prefix, rejected_at, rejected_at - prefix + chosen_length)
        row_start = torch.arange(pairs, device=input_ids.device) * columns.size(1)
        self.reward_index = torch.cat([row_start + chosen_at, row_start + rejected_at])

    def attention_mask(self, model: nn.Module) -> torch.Tensor:
        """sdpa takes the boolean mask; eager adds it to its scores, in the dtype it computes them in."""
        if model.config._attn_implementation == "sdpa":
            return self.sees
        device = self.sees.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else next(p for p in model.parameters() if p.is_floating_point()).dtype)
        blocked = torch.zeros(self.sees.shape, dtype=dtype, device=self.sees.device)
        return blocked.masked_fill(~self.sees, torch.finfo(dtype).min)


# the attention implementations that take a 4D mask and position ids as given
SHARED_PREFIX_ATTENTION = ("sdpa", "eager")


def shared_prefix_problem(classifier: nn.Module) -> str | None:
    """Why pairs cannot share their prefix in one row with this classifier, or None."""
    base = transformers_model(classifier)
    config = base.config.get_text_config()
    implementation = getattr(base.config, "_attn_implementation", None)
    if implementation not in SHARED_PREFIX_ATTENTION:
        return f"attention {implementation} takes no 4D mask (only {' and '.join(SHARED_PREFIX_ATTENTION)} do)"
    if getattr(config, "pad_token_id", None) is None:
        return "the model has no pad token id"
    other_layers = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if other_layers:
        return f"its {', '.join(other_layers)} layers do not take a mask given whole"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < (
            getattr(config, "max_position_embeddings", None) or float("inf")):
        return f"its sliding window ({window} tokens) is not applied to a mask given whole"
    dropout = dropout_in(classifier, config)
    if dropout:
        return f"{dropout} would be drawn once for a pair's shared tokens instead of once per row"
    if not isinstance(getattr(base, "score", None), nn.Module) or not isinstance(
            getattr(base, base.base_model_prefix, None), nn.Module):
        return f"{type(base).__name__} has no score head over a decoder"
    return None


def dropout_in(classifier: nn.Module, config) -> str | None:
    """The first dropout the classifier trains with, in words (a dropout module, LoRA's included, or an attention
    dropout its config names), or None."""
    for name, module in classifier.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"dropout {module.p:g} ({name})"
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("pdrop")) and "classifier" not in key and isinstance(
                value, (int, float)) and not isinstance(value, bool) and value > 0:
            return f"{key} {value:g}"
    return None


def layer_costs(config) -> tuple[float, float]:
    """(multiply-adds per token in a layer's linear maps, per query-key pair in its attention): what decides whether
    a batch is cheaper with its prefixes shared (rows longer, and attention quadratic in them) or not."""
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    experts = getattr(config, "num_experts_per_tok", None) or 1
    intermediate = getattr(config, "moe_intermediate_size", None) if experts > 1 else None
    intermediate = (intermediate or getattr(config, "intermediate_size", 0) or 4 * hidden) * experts
    linear = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    return float(linear or 12 * hidden * hidden), float(2 * heads * head_dim)


class RewardLoss(nn.Module):
    """Chosen and rejected rows in one forward of the sequence classifier; (loss summed over pairs, metric sums).
    The classifier is kept as `causal_lm`, the name checkpoints and the final save read. With `prefix_sharing` (and
    a classifier shared_prefix_problem finds nothing against), a batch goes through as SharedPrefixRows when that
    costs less than its padded rows (layer_costs): the same rewards, the shared tokens computed once."""

    base_model_prefix = "decoder"

    def __init__(self, classifier: nn.Module, center_rewards_coefficient: float | None, prefix_sharing: bool = True):
        super().__init__()
        self.causal_lm = classifier
        self.center_rewards_coefficient = center_rewards_coefficient
        self.prefix_problem = shared_prefix_problem(classifier) if prefix_sharing else "prefix_sharing: false"
        self.prefix_sharing = self.prefix_problem is None
        self._costs = layer_costs(self._base().config.get_text_config())

    def _base(self):
        return transformers_model(self.causal_lm)

    @property
    def decoder(self) -> nn.Module:
        base = self._base()
        return getattr(base, base.base_model_prefix)

    @property
    def _no_split_modules(self):
        return getattr(self._base(), "_no_split_modules", None)

    def get_input_embeddings(self):
        return self._base().get_input_embeddings()

    def get_output_embeddings(self):
        return None  # a score head, no LM head

    def _cost(self, rows: int, width: int) -> float:
        linear, attention = self._costs
        return rows * width * (linear + width * attention)

    def shared_rows(self, input_ids, attention_mask) -> SharedPrefixRows | None:
        """The batch's pairs as SharedPrefixRows where that costs at most 0.9 of the padded rows, else None. The
        lengths decide before any row is built."""
        if not self.prefix_sharing or attention_mask is None:
            return None
        lengths = pair_lengths(input_ids, attention_mask)
        if lengths is None:
            return None
        width = int((lengths[0] + lengths[1] - lengths[2]).max())
        if self._cost(input_ids.size(0) // 2, width) > 0.9 * self._cost(*input_ids.shape):
            return None
        return SharedPrefixRows(input_ids, attention_mask, self._base().config.get_text_config().pad_token_id, lengths)

    def _shared_rewards(self, shared: SharedPrefixRows) -> torch.Tensor:
        base = self._base()
        hidden = self.decoder(input_ids=shared.input_ids, attention_mask=shared.attention_mask(base),
                              position_ids=shared.position_ids, use_cache=False).last_hidden_state
        return base.score(hidden.reshape(-1, hidden.size(-1))[shared.reward_index]).squeeze(-1).float()

    def forward(self, input_ids, attention_mask=None, margin=None, labels=None, **_):
        shared = self.shared_rows(input_ids, attention_mask)
        rewards = (sequence_rewards(self.causal_lm, input_ids, attention_mask) if shared is None
                   else self._shared_rewards(shared))
        chosen, rejected = rewards.chunk(2)
        losses = reward_losses(chosen, rejected, margin, self.center_rewards_coefficient)
        return losses.sum(), reward_metric_sums(chosen, rejected)


def settle_prefix_sharing(module: RewardLoss, accelerator, tokenizer) -> RewardLoss:
    """Shared-prefix rows where the classifier allows them and a probe gives the padded rows' rewards with them; one
    line says which, and why not."""
    from .base import log
    from .sft import head_verified

    if module.prefix_sharing:
        probe = tokenizer("The quick brown fox jumps over the lazy dog. It was not amused.",
                          add_special_tokens=False)["input_ids"]
        if not head_verified(accelerator, lambda: verify_shared_prefix(module, probe)):
            module.prefix_sharing, module.prefix_problem = False, "a probe pair's rewards differed with it"
            log.warning("warning: this model does not give a pair's rewards with its prefix shared in one row; "
                        "chosen and rejected go through as rows of their own")
    if module.prefix_sharing:
        log.info("loss: Bradley-Terry; each pair's shared leading tokens computed once (prefix_sharing), in "
                 "batches where that costs less")
    else:
        log.info("loss: Bradley-Terry; chosen and rejected as rows of their own (%s)", module.prefix_problem)
    return module


def verify_shared_prefix(module: RewardLoss, token_ids: list[int]) -> bool:
    """Do two pairs through SharedPrefixRows give the rewards of their padded rows? Checked in eval mode, on the
    device the model is on (under FSDP rank 0's weights are still in host memory here), on ordinary tokens, one
    pair's completions of different lengths."""
    pad = module._base().config.get_text_config().pad_token_id
    ids = [t for t in token_ids if t != pad][:16]
    if len(ids) < 12:
        return False
    prompt, rest = ids[:6], ids[6:]
    rows = [prompt + rest[:4], prompt[:3] + rest[:2], prompt + rest[2:6], prompt[:3] + rest[3:6]]
    input_ids, attention_mask = padded_rows(rows, pad, next(module.parameters()).device)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            expected = sequence_rewards(module.causal_lm, input_ids, attention_mask)
            shared = module._shared_rewards(SharedPrefixRows(input_ids, attention_mask, pad))
    except Exception as exc:  # an architecture whose decoder takes no 4D mask or position ids
        from .base import log

        log.info("prefix sharing: %s: %s", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    finally:
        for m, training in modes:
            m.training = training
    scale = float(expected.abs().max().clamp(min=1e-3))
    exact = all(p.dtype == torch.float32 for p in module.parameters())  # not bf16, not 4-bit
    return bool((shared - expected).abs().max() <= (1e-4 if exact else 5e-2) * scale)
