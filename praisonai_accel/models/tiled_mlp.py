"""Tiled MLP (`tiled_mlp: true`): each decoder layer's MLP computed over tiles of the row's tokens, with recompute.

A decoder MLP keeps, for backward, about 4 x intermediate_size values per token (gate, up, activation, product):
for a long row that is most of a layer's activation memory, and it grows with the row. Here the MLP runs one
tile of tokens at a time under no_grad and keeps only its input; backward recomputes each tile and takes its
gradients at once, so at most one tile's intermediates exist at any moment (Snowflake's ALST does the same). The
MLP is per token, so the result is the plain MLP's; the gradients of the MLP's trainable parameters are summed
over tiles inside the Function and handed to autograd as ordinary gradients, so DDP's and FSDP2's hooks see them
as usual (no nested backward that would mark a parameter ready twice).

Shards: `tiled_mlp_shards`, or by default ceil(tokens / hidden_size) as ALST does, so a tile holds about
hidden_size tokens and its intermediates stay the same size whatever the row's length.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

from .unwrap import transformers_model


def _autocast_state(device_type: str):
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward, shards: int, *params):
        ctx.forward, ctx.shards = forward, shards
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x, *params)
        flat = x.reshape(-1, x.size(-1))
        with torch.no_grad():
            outs = [forward(tile) for tile in flat.tensor_split(shards)]
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out.reshape(*x.shape[:-1], out.size(-1))

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        flat, grad = x.reshape(-1, x.size(-1)), grad.reshape(-1, grad.size(-1))
        grad_x = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        grad_params = [None] * len(params)
        enabled, dtype = ctx.autocast
        start = 0
        for tile, tile_grad in zip(flat.tensor_split(ctx.shards), grad.tensor_split(ctx.shards)):
            tile = tile.detach().requires_grad_(grad_x is not None)
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
                out = ctx.forward(tile)
            inputs = ([tile] if grad_x is not None else []) + list(params)
            grads = torch.autograd.grad(out, inputs, tile_grad, allow_unused=True)
            if grad_x is not None:
                grad_x[start:start + tile.size(0)] = grads[0]
                grads = grads[1:]
            for index, g in enumerate(grads):
                if g is not None:
                    grad_params[index] = g if grad_params[index] is None else grad_params[index].add_(g)
            start += tile.size(0)
        ctx.forward = None
        return (None if grad_x is None else grad_x.reshape(x.shape), None, None, *grad_params)


def tile_count(tokens: int, hidden_size: int, shards: int | None) -> int:
    """Tiles for a call over `tokens` tokens: the configured count, or about hidden_size tokens per tile."""
    count = shards if shards is not None else math.ceil(tokens / max(hidden_size, 1))
    return max(1, min(count, tokens))


def _tiled_forward(self, x):
    tokens = x.numel() // x.size(-1)
    shards = tile_count(tokens, x.size(-1), self._tiled_mlp_shards)
    if shards == 1:
        return self._untiled_forward(x)
    if not torch.is_grad_enabled():  # nothing kept for backward: the tiles only bound the intermediates' size
        flat = x.reshape(-1, x.size(-1))
        out = torch.cat([self._untiled_forward(tile) for tile in flat.tensor_split(shards)])
        return out.reshape(*x.shape[:-1], out.size(-1))
    params = [p for p in self.parameters() if p.requires_grad]
    return _TiledMLP.apply(x, self._untiled_forward, shards, *params)


def decoder_mlps(model) -> list[nn.Module]:
    """Each decoder layer's dense MLP (`layer.mlp`); mixture-of-experts blocks (routing, auxiliary outputs) are left
    as they are."""
    base = transformers_model(model)
    found = []
    for name, module in base.named_modules():
        mlp = getattr(module, "mlp", None)
        if not isinstance(mlp, nn.Module) or not name.split(".")[-1].isdigit():  # layers are items of a ModuleList
            continue
        if hasattr(mlp, "experts") or hasattr(mlp, "gate") and not hasattr(mlp, "gate_proj"):
            continue
        found.append(mlp)
    return found


def apply_tiled_mlp(model, shards: int | None = None) -> int:
    """Patches the decoder layers' MLPs to run tiled; returns how many. Idempotent. Call before DDP/FSDP wrapping
    (the patch is on the modules' instances, which wrapping keeps)."""
    mlps = decoder_mlps(model)
    for mlp in mlps:
        if not hasattr(mlp, "_untiled_forward"):
            mlp._untiled_forward = mlp.forward
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        mlp._tiled_mlp_shards = shards
    return len(mlps)
