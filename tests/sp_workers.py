"""What the sequence-parallel tests run in each of 2 real gloo processes (spawned by torch.multiprocessing).

Each case builds a tiny random-weight model from transformers' config classes, takes the loss and gradients of
one process on whole rows (the recipe's CausalLMLoss), then the same model split over the 2 processes
(sequence_parallel_size 2, each holding half of every row), sums over the group, and records the largest
differences. The test module asserts on them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 101


def spawn(worker: str, directory: Path, nprocs: int = 2, **options) -> list[dict]:
    """Runs `worker` (a function of this module) in nprocs gloo processes; returns each rank's JSON result."""
    import torch.multiprocessing as mp

    directory.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(worker, str(directory), nprocs, options), nprocs=nprocs, join=True)
    return [json.loads((directory / f"rank-{rank}.json").read_text()) for rank in range(nprocs)]


def _entry(rank: int, worker: str, directory: str, world: int, options: dict) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=world)
    try:
        if ":" in worker:  # module:function
            import importlib

            module, name = worker.split(":")
            result = getattr(importlib.import_module(module), name)(**options)
        else:
            result = globals()[worker](**options)
        Path(directory, f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- models and batches

def make_config(kind: str, attention: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "llama":
        config = tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
    elif kind == "qwen3":  # grouped-query attention: 2 KV heads for 4 query heads
        config = tf.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, **common)
    elif kind == "qwen3-1kv":  # fewer KV heads than ranks: the KV head is repeated
        config = tf.Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=8, **common)
    elif kind == "gemma2":  # sliding-window layers (window 6 < the rows), final-logit softcapping
        config = tf.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                                 final_logit_softcapping=30.0,
                                 attn_logit_softcapping=50.0 if attention == "eager" else None, **common)
    else:
        raise ValueError(kind)
    # Gemma 2 declares no sdpa support (for its attention softcapping, off here): built with eager, switched after
    config._attn_implementation = "eager" if kind == "gemma2" else attention
    return config


def make_model(kind: str, attention: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, attention), dtype=torch.float32)
    if kind == "gemma2" and attention == "sdpa":
        model._supports_sdpa = True  # true here: attention softcapping is off
    model.config._attn_implementation = attention
    return model.train()


def padded_batch(seed: int) -> dict:
    """Two rows, right-padded: 13 tokens (odd: sequence parallelism pads it) and 5 (its second half is padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths, width = (13, 5), 13
    input_ids = torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), -100)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        labels[row, 2:n] = input_ids[row, 2:n]  # a 2-token prompt, never a target
        mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def packed_batch(seed: int) -> dict:
    """Two packed rows (PadCollator's layout): examples of 5, 7 and 2 tokens; 9 and 3 then padding."""
    from praisonai_accel.data import PadCollator
    from praisonai_accel.data.packing import PackedDataset

    g = torch.Generator().manual_seed(seed)
    lengths = [5, 7, 2, 9, 3]
    examples = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=g).numpy()
        labels = ids.copy()
        labels[:1] = -100
        examples.append({"input_ids": ids, "labels": labels})
    rows = PackedDataset(examples, lengths, capacity=15)
    return PadCollator(0)([rows[i] for i in range(len(rows))])


def lonely_batch(seed: int) -> dict:
    """One row whose targets all fall in the first half: rank 1's slice has none, and must still take part."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (1, 10), generator=g)
    labels = torch.full((1, 10), -100)
    labels[0, 1:4] = input_ids[0, 1:4]
    return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)}


BATCHES = {"padded": padded_batch, "packed": packed_batch, "lonely": lonely_batch}


def one_process(module, batch: dict) -> torch.Tensor:
    from praisonai_accel.data import batch_targets

    summed = module(batch["input_ids"], batch["labels"], batch["attention_mask"], batch.get("position_ids"))
    return summed, batch_targets(batch)


def _grads(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- workers

def equality(cases: list[list[str]]) -> dict:
    """Each case (architecture, attention, batch, chunked | full | chunked+checkpointing+tiled): the summed loss and
    gradients of 1 process on whole rows against the group's sums; returns the largest differences of the mean loss
    and of its gradients."""
    from praisonai_accel.methods.lm_loss import CausalLMLoss, ShardedCausalLMLoss
    from praisonai_accel.models.sequence_parallel import SequenceParallel, shard_targets

    sp, _layout = SequenceParallel.setup(2)
    results = {}
    for kind, attention, batch_name, loss_kind in cases:
        model = make_model(kind, attention)
        batch = BATCHES[batch_name](seed=1)
        chunked = loss_kind != "full"
        summed, targets = one_process(CausalLMLoss(model, chunked=chunked), batch)
        (summed / targets).backward()
        expected = _grads(model)
        model.zero_grad(set_to_none=True)

        if loss_kind == "chunked+checkpointing+tiled":  # layers recomputed in backward: all-to-alls again
            from praisonai_accel.models.tiled_mlp import apply_tiled_mlp

            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            apply_tiled_mlp(model, 3)
        sp.apply(model)
        shard = sp.shard_batch(batch)
        local = ShardedCausalLMLoss(model, chunked=chunked)(shard["input_ids"], shard["labels"],
                                                            shard["attention_mask"], shard["position_ids"])
        counts = torch.stack([local.detach(), shard_targets(shard).float()])
        dist.all_reduce(counts, group=sp.group)
        (local / counts[1]).backward()
        sp.end_batch()
        grads = _grads(model)
        for grad in grads.values():
            dist.all_reduce(grad, group=sp.group)
        missing = sorted(set(expected) ^ set(grads))
        results["/".join((kind, attention, batch_name, loss_kind))] = {
            "loss": float(summed.detach() / targets), "loss_diff": abs(float(counts[0] / counts[1] - summed.detach() / targets)),
            "targets": [int(targets), int(counts[1])],
            "grad_diff": max(float((grads[k] - expected[k]).abs().max()) for k in expected if k in grads),
            "grad_max": max(float(g.abs().max()) for g in expected.values()),
            "missing": missing,
        }
    return results


def lora_steps(kind: str = "qwen3", attention: str = "sdpa", steps: int = 3) -> dict:
    """3 AdamW steps of LoRA, 2 micro-batches each (packed, then padded rows): 1 process on whole rows against 2
    processes under DDP with sequence_parallel_size 2 and tiled MLPs, the loss scaled as the recipe scales it (world / the step's
    global target count, DDP averaging over the world). Returns the largest difference of the adapters."""
    from contextlib import nullcontext

    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from praisonai_accel.data import batch_targets
    from praisonai_accel.methods.lm_loss import CausalLMLoss, ShardedCausalLMLoss
    from praisonai_accel.models.sequence_parallel import SequenceParallel, shard_targets
    from praisonai_accel.models.tiled_mlp import apply_tiled_mlp

    def lora_model():
        torch.manual_seed(0)
        model = make_model(kind, attention)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], init_lora_weights=False)
        return get_peft_model(model, lora)

    def adapter(model) -> dict:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    groups = [[packed_batch(10 + 2 * s), padded_batch(11 + 2 * s)] for s in range(steps)]

    reference = lora_model()
    module = CausalLMLoss(reference)
    expected_losses = []
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    for group in groups:

        targets = sum(batch_targets(b) for b in group)
        step_loss = 0.0
        for batch in group:
            summed, _ = one_process(module, batch)
            (summed / targets).backward()
            step_loss += float(summed.detach())
        expected_losses.append(step_loss / targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    expected = adapter(reference)

    sp, _layout = SequenceParallel.setup(2)
    model = lora_model()
    apply_tiled_mlp(model, 2)
    sp.apply(model)
    ddp = DDP(ShardedCausalLMLoss(model), find_unused_parameters=True)  # as the recipe wraps it
    world = dist.get_world_size()
    optimizer = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for group in groups:
        shards = [sp.shard_batch(b) for b in group]
        local = torch.stack([shard_targets(s) for s in shards]).sum().float()
        dist.all_reduce(local)
        scale = world / local
        step_loss = torch.zeros(())
        for index, (batch, shard) in enumerate(zip(group, shards)):
            sp.shard_batch(batch)  # the micro-batch's whole-row facts for attention
            with nullcontext() if index == len(group) - 1 else ddp.no_sync():
                summed = ddp(shard["input_ids"], shard["labels"], shard["attention_mask"], shard["position_ids"])
                (summed * scale).backward()
            sp.end_batch()
            step_loss += summed.detach()
        dist.all_reduce(step_loss)
        losses.append(float(step_loss / local))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    trained = adapter(model)
    start = adapter(lora_model())
    return {"adapter_diff": max(float((trained[k] - expected[k]).abs().max()) for k in expected),
            "moved": min(float((expected[k] - start[k]).abs().max()) for k in expected),
            "names": sorted(trained) == sorted(expected), "losses": losses, "expected_losses": expected_losses}


def proof(cases: list[list[str]]) -> dict:
    """Every proof in one pair of processes."""
    return {"equality": equality(cases), "lora": lora_steps(), "fsdp2": fsdp2()}


def fsdp2(kind: str = "qwen3", attention: str = "sdpa") -> dict:
    """Full fine-tuning with FSDP2 sharding the model over the whole world (2 ranks, which are also the one sequence-
    parallel group) and tiled MLPs: the gradients of one process on whole rows, from the reduce-scatter's average
    and the recipe's world / targets scale."""
    from torch.distributed.fsdp import fully_shard

    from praisonai_accel.methods.lm_loss import CausalLMLoss, ShardedCausalLMLoss
    from praisonai_accel.models.sequence_parallel import SequenceParallel, shard_targets
    from praisonai_accel.models.tiled_mlp import apply_tiled_mlp

    batch = packed_batch(seed=5)
    model = make_model(kind, attention)
    summed, targets = one_process(CausalLMLoss(model), batch)
    (summed / targets).backward()
    expected = _grads(model)

    sp, _layout = SequenceParallel.setup(2)
    model = make_model(kind, attention)
    apply_tiled_mlp(model, 2)
    sp.apply(model)
    module = ShardedCausalLMLoss(model)  # the root, as accelerate prepares the recipe's loss module
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(module)
    shard = sp.shard_batch(batch)
    local = shard_targets(shard).float()
    dist.all_reduce(local)
    loss = module(shard["input_ids"], shard["labels"], None, shard["position_ids"])
    (loss * dist.get_world_size() / local).backward()
    sp.end_batch()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    return {"grad_diff": max(float((grads[k] - expected[k]).abs().max()) for k in expected),
            "same_names": sorted(grads) == sorted(expected)}
