"""Sequence parallelism (DeepSpeed-Ulysses): N processes share every row, each holding 1/N of its tokens.

The world splits into data-parallel groups of N consecutive ranks (`sequence_parallel_size: N`); every rank of a
group sees the same rows and keeps one contiguous 1/N slice of each. Everything but attention is per token, so it
runs on the slice as it is. Attention is swapped in through transformers' AttentionInterface: around the model's
own sdpa or eager attention, one all-to-all turns (all heads, 1/N of the tokens) into (1/N of the heads, all
tokens), attention runs on whole rows, and a second all-to-all turns the output back. Both are `all_to_all_single`
(gloo has it, so this runs on CPU; the list form it lacks) inside an autograd Function whose backward is the same
exchange, so gradients flow back to the rank that owns each token. Grouped-query attention with fewer KV heads
than N repeats each KV head so every rank gets one.

Labels are shifted on the whole row before it is split, so each slice's labels are its own next-token targets;
position ids are the row's (packing restarts them at every example, and that is kept); the attention mask is built
once per micro-batch for the whole row, exactly as one process would build it. Each rank's loss is the sum over its
slice's targets: the sum over the group is one process's sum over whole rows, and gradients summed over the group
are one process's gradients (DDP's and FSDP2's averaging over the world then needs the same `world / targets` scale
as without sequence parallelism; README "Long context").

In a training loop (the recipe's: worker/long_context.py, step.py): `sp, layout = SequenceParallel.setup(N)` once
torch.distributed is up; the loss module is methods/lm_loss's `ShardedCausalLMLoss` (after `verify_head`), then
`sp.apply(model)`, both before DDP/FSDP wrapping; the training loader goes through `prepare_loader(accelerator,
loader, layout)` (same rows for a group). Per micro-batch: `shard = sp.shard_batch(batch, pad_id)`, forward on the
shard's four tensors, backward, `sp.end_batch()`; the step's target count is `shard_targets` summed over the world
(or, as the recipe counts, the whole rows' targets summed over the world and divided by N), and the loss is scaled
by world / that count.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.chat_masking import IGNORE_INDEX
from ..config import ConfigError
from .unwrap import transformers_model

# The attention implementations this wraps, and the names the wrappers are registered under.
WRAPPED = {"sdpa": "ulysses_sdpa", "eager": "ulysses_eager"}
WRAPPED_BY = {name: implementation for implementation, name in WRAPPED.items()}
_ACTIVE: "SequenceParallel | None" = None  # the process's sequence-parallel state, read by the attention wrappers


# ---------------------------------------------------------------- checks before launch (pure)

def check_world(world_size: int, n: int) -> str | None:
    """Why `world_size` processes cannot form sequence-parallel groups of `n`, or None."""
    if n < 1:
        return f"sequence_parallel_size: must be 1 or more, got {n}"
    if world_size % n:
        return (f"sequence_parallel_size: {n} does not divide the {world_size} processes; the processes form groups "
                f"of {n}, so launch a multiple of {n}")
    return None


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)


def check_sequence_parallel(model_config, n: int) -> str | None:
    """Why this model's attention heads cannot be split over `n` ranks, as one line, or None.

    Query heads must divide by n; KV heads must divide by n, or n by them (then each KV head is repeated)."""
    if n <= 1:
        return None
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return "sequence_parallel_size: this model's config names no num_attention_heads; its attention cannot be split"
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % n:
        return (f"sequence_parallel_size: {n} does not divide the model's {heads} attention heads; use one of "
                f"{_divisors(heads)}")
    if kv_heads % n and n % kv_heads:
        return (f"sequence_parallel_size: {n} neither divides the model's {kv_heads} key/value heads nor is a multiple "
                f"of them; use one of {_divisors(heads)} that is")
    return None


# ---------------------------------------------------------------- groups

@dataclass(frozen=True)
class Layout:
    """Where a rank sits: groups of `size` consecutive ranks share rows; groups are the data-parallel ranks."""

    rank: int
    world_size: int
    size: int

    @property
    def sp_rank(self) -> int:
        return self.rank % self.size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.size

    def group_ranks(self, dp_rank: int | None = None) -> list[int]:
        first = (self.dp_rank if dp_rank is None else dp_rank) * self.size
        return list(range(first, first + self.size))


def new_group(n: int):
    """This rank's sequence-parallel process group and Layout. Every rank creates every group, in the same order
    (torch.distributed requires it); a group of its own even when n is the whole world, so its all-to-alls never
    interleave with DDP's or FSDP's collectives on the default group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reason = check_world(world, n)
    if reason:
        raise ConfigError(reason)
    layout = Layout(rank, world, n)
    mine = None
    for dp_rank in range(layout.dp_size):
        group = dist.new_group(layout.group_ranks(dp_rank))
        if dp_rank == layout.dp_rank:
            mine = group
    return mine, layout


# ---------------------------------------------------------------- the all-to-all

class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (one chunk per rank). It is a permutation of chunks between ranks, so its
    gradient is the same exchange applied to the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # a gradient can arrive with another layout; the exchange reads and writes raw chunks
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(batch, heads, tokens/n, dim) on each rank -> (batch, heads/n, tokens, dim): this rank's heads, whole rows."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()  # chunk i: the heads rank i gets
    out = _AllToAll.apply(chunks, group)  # chunk j: rank j's tokens of this rank's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_sequence(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(batch, tokens, heads/n, dim), attention's output layout -> (batch, tokens/n, heads, dim)."""
    b, t, h, d = x.shape
    chunks = x.reshape(b, n, t // n, h, d).permute(1, 0, 2, 3, 4).contiguous()  # chunk i: rank i's tokens
    out = _AllToAll.apply(chunks, group)  # chunk j: this rank's tokens of rank j's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, t // n, n * h, d)


# ---------------------------------------------------------------- the attention wrapper

class _LocalHeads:
    """The attention module as the wrapped function sees it after the split: its own count of query heads per KV
    head (different when KV heads were repeated), everything else read through."""

    def __init__(self, module, groups: int):
        self.__dict__["_module"] = module
        self.__dict__["num_key_value_groups"] = groups

    def __getattr__(self, name):
        return getattr(self._module, name)


class _ConfigView:
    """The model config with the wrapped implementation's name, so transformers builds that implementation's mask."""

    def __init__(self, config, implementation: str):
        self.__dict__["_config"] = config
        self.__dict__["_attn_implementation"] = implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


def _eager_for(module):
    """The model's own eager attention (Gemma 2's applies softcapping): its modeling file's eager_attention_forward."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as function
    return function


def _wrapper(implementation: str):
    def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
        sp = _ACTIVE
        if sp is None or sp.batch is None:
            raise RuntimeError("sequence-parallel attention ran outside a sharded micro-batch; call "
                               "SequenceParallel.shard_batch on the batch first")
        n, batch = sp.size, sp.batch
        if query.shape[2] * n != batch.length:
            raise RuntimeError(f"sequence-parallel attention got {query.shape[2]} tokens per row; this rank's share of "
                               f"the sharded micro-batch is {batch.length // n}")
        kv_heads = key.shape[1]
        if kv_heads < n:  # every rank needs a KV head: repeat each so rank r gets the one its query heads use
            key = key.repeat_interleave(n // kv_heads, dim=1)
            value = value.repeat_interleave(n // kv_heads, dim=1)
        query, key, value = (sequence_to_heads(t, sp.group, n) for t in (query, key, value))
        mask = batch.mask(sp.model_config, implementation, kwargs.get("sliding_window"), query)
        inner = _registered(implementation) if implementation == "sdpa" else _eager_for(module)
        out, _weights = inner(_LocalHeads(module, query.shape[1] // key.shape[1]), query, key, value, mask, **kwargs)
        return heads_to_sequence(out, sp.group, n), None

    ulysses_attention.__name__ = f"ulysses_{implementation}_attention"
    return ulysses_attention


def _registered(implementation: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


def register_attention() -> None:
    """Registers the wrappers under WRAPPED's names (idempotent). No mask function is registered for them, so the
    model skips building a mask for its slice; the wrapper builds the whole row's."""
    from transformers import AttentionInterface

    for implementation, name in WRAPPED.items():
        AttentionInterface.register(name, _wrapper(implementation))


class _Batch:
    """The current micro-batch's whole-row facts, and the masks built from them (one per kind of layer)."""

    def __init__(self, attention_mask, position_ids, batch_size: int, length: int):
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.batch_size, self.length = batch_size, length
        self.masks: dict = {}

    def mask(self, model_config, implementation: str, sliding_window, like: torch.Tensor):
        key = (implementation, sliding_window, like.dtype)
        if key not in self.masks:
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            build = create_sliding_window_causal_mask if sliding_window else create_causal_mask
            # Only the batch size, length, dtype and device of inputs_embeds are read: an empty last dimension.
            embeds = like.new_empty((self.batch_size, self.length, 0))
            self.masks[key] = build(config=_ConfigView(model_config, implementation), inputs_embeds=embeds,
                                    attention_mask=self.attention_mask, cache=None, position_ids=self.position_ids)
        return self.masks[key]


# ---------------------------------------------------------------- the process's state

class SequenceParallel:
    """One rank's view: its group of `size` ranks, its place in it, and the micro-batch being trained."""

    def __init__(self, size: int, group=None, rank: int | None = None):
        self.size = size
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        self.batch: _Batch | None = None
        self.model_config = None
        self.original: str | None = None
        self.pad_token_id = 0  # what fills the padding added for the split (it is never attended to nor a target)
        self.layout: Layout | None = None

    @classmethod
    def setup(cls, size: int) -> tuple["SequenceParallel", Layout]:
        """The groups of `size` consecutive ranks (torch.distributed initialised), and this rank's state."""
        group, layout = new_group(size)
        state = cls(size, group, layout.sp_rank)
        state.layout = layout
        return state, layout

    def apply(self, model) -> None:
        """Swaps the model's sdpa or eager attention for its Ulysses wrapper (a PeftModel: its base model's)."""
        global _ACTIVE
        base = transformers_model(model)
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        reason = check_sequence_parallel(config, self.size)
        if reason:
            raise ConfigError(reason)
        current = base.config._attn_implementation
        if current not in WRAPPED and current not in WRAPPED.values():
            raise ConfigError(f"sequence_parallel_size: works with sdpa or eager attention, and this model uses "
                              f"{current}; leave attn_implementation unset or use sdpa")
        register_attention()
        name = WRAPPED.get(current, current)
        base.set_attn_implementation(name)
        if base.config._attn_implementation != name:  # a model that does not call attention through the interface
            raise ConfigError(f"sequence_parallel_size: {type(base).__name__} does not use transformers' attention "
                              "interface, so its attention cannot be split; use sequence_parallel_size: 1")
        self.model_config = config
        self.original = WRAPPED_BY.get(name, current)
        _ACTIVE = self

    def restore(self, model) -> None:
        """Puts the model's own attention back (whole rows in one process again: generation, a later evaluation)."""
        transformers_model(model).set_attn_implementation(self.original)

    def shard_batch(self, batch: dict, pad_token_id: int | None = None) -> dict:
        """This rank's slice of a micro-batch of whole rows, and the rows' facts for attention until the next call.

        Rows are padded to a multiple of the group size (padding: label -100, attention mask 0, never a target);
        labels are shifted on the whole row first, so the slice's `labels` are its targets
        (lm_loss.ShardedCausalLMLoss does not shift again); `position_ids` are the row's own positions over the
        slice (packed rows' restarts kept)."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        pad_token_id = self.pad_token_id if pad_token_id is None else pad_token_id
        rows, length = input_ids.shape
        width = -(-length // self.size) * self.size
        pad = width - length
        attention = batch.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(input_ids)
        positions = batch.get("position_ids")
        packed = positions is not None
        targets = F.pad(labels[:, 1:], (0, 1 + pad), value=IGNORE_INDEX)
        input_ids = F.pad(input_ids, (0, pad), value=pad_token_id)
        # Attention may treat the added padding as tokens: it comes last, so causally no real token sees it, and an
        # unpadded row keeps sdpa's mask-free kernel (a mask is rows x T x T: 16 GiB of booleans for a 128k row).
        attend = F.pad(attention, (0, pad), value=1)
        attention = F.pad(attention, (0, pad), value=0)
        if packed:
            positions = _extend_positions(positions, batch.get("attention_mask"), pad)
        else:
            positions = torch.arange(width, device=input_ids.device).expand(rows, width)
        # What one process would give the model on whole rows: packed rows, position ids and no mask (the loss
        # module drops it); other rows, the padding mask and default positions.
        self.batch = _Batch(None if packed else attend, positions if packed else None, rows, width)
        part = width // self.size
        window = slice(self.rank * part, (self.rank + 1) * part)
        return {"input_ids": input_ids[:, window], "labels": targets[:, window], "attention_mask": attention[:, window],
                "position_ids": positions[:, window]}

    def end_batch(self) -> None:
        """Drops the micro-batch's masks (call after its backward)."""
        self.batch = None


def _extend_positions(positions: torch.Tensor, attention_mask, pad: int) -> torch.Tensor:
    """Positions for `pad` more tokens at the end of packed rows: continuing the row's trailing padding if it has
    some (PadCollator gives padding a sequence of its own), else a new sequence from 0, so padding never joins an
    example."""
    if not pad:
        return positions
    extra = torch.arange(pad, device=positions.device).expand(positions.size(0), pad)
    if attention_mask is not None:
        ends_in_padding = attention_mask[:, -1:] == 0
        extra = torch.where(ends_in_padding, positions[:, -1:] + 1 + extra, extra)
    return torch.cat([positions, extra], dim=1)


def shard_targets(shard: dict) -> torch.Tensor:
    """Targets in a slice made by shard_batch (its labels are already shifted): summed over the world, the step's
    target count of one process on whole rows. data.batch_targets would drop each slice's first target."""
    return (shard["labels"] != IGNORE_INDEX).sum()


def prepare_loader(accelerator, loader, layout: Layout):
    """accelerator.prepare for the training DataLoader, sharded by data-parallel rank: every rank of a sequence-
    parallel group gets the same rows (accelerate would give each process different ones)."""
    from accelerate.data_loader import prepare_data_loader

    prepared = prepare_data_loader(
        loader, accelerator.device, num_processes=layout.dp_size, process_index=layout.dp_rank,
        split_batches=accelerator.split_batches, put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=accelerator.dispatch_batches,
        even_batches=accelerator.even_batches, use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking)
    return prepared  # the caller registers it with accelerate (worker/accelerator.track_loader)
