"""Sequence parallelism (Ulysses) and tiled MLP: equal to one process on whole rows, on CPU.

The proof runs 2 real gloo processes once (tests/sp_workers.py) for Llama, Qwen 3 (grouped-query attention, and a
single KV head repeated over the ranks) and Gemma 2 (sliding-window layers, softcapping), with sdpa and eager
attention, packed rows and padded ones; the rest runs in this process.
"""

from __future__ import annotations

import pytest
import torch

import sp_workers
from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.models.sequence_parallel import (
    Layout, SequenceParallel, check_sequence_parallel, check_world, prepare_loader, shard_targets,
)
from praisonai_accel.models.tiled_mlp import apply_tiled_mlp, decoder_mlps, tile_count

CASES = [[kind, attention, batch, "chunked"] for kind in ("llama", "qwen3", "qwen3-1kv", "gemma2")
         for attention in ("sdpa", "eager") for batch in ("padded", "packed")]
CASES += [["llama", "sdpa", "lonely", "chunked"], ["qwen3", "eager", "packed", "full"],
          ["gemma2", "eager", "padded", "full"], ["qwen3-1kv", "sdpa", "packed", "chunked+checkpointing+tiled"],
          ["gemma2", "eager", "padded", "chunked+checkpointing+tiled"]]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One spawn of 2 gloo processes runs every case and the LoRA steps (process start-up is most of the cost)."""
    return sp_workers.spawn("proof", tmp_path_factory.mktemp("sp"), cases=CASES)


# ---------------------------------------------------------------- 2 processes = 1 process

@pytest.mark.parametrize("case", ["/".join(c) for c in CASES])
def test_two_processes_give_one_process_loss_and_gradients(two_processes, case):
    for rank in two_processes:
        result = rank["equality"][case]
        assert result["missing"] == []
        assert result["targets"][0] == result["targets"][1] > 0
        assert result["loss_diff"] <= 1e-5, result
        assert result["grad_diff"] <= 1e-5, result
        assert result["grad_max"] > 1e-2  # gradients that are there to compare


def test_lora_under_ddp_trains_the_adapter_of_one_process(two_processes):
    for rank in two_processes:
        lora = rank["lora"]
        assert lora["names"]
        assert lora["moved"] > 1e-3  # 3 AdamW steps changed every LoRA matrix
        assert lora["adapter_diff"] <= 1e-5, lora
        assert lora["losses"] == pytest.approx(lora["expected_losses"], abs=1e-5)


def test_fsdp2_over_the_whole_world_with_tiled_mlp_gives_one_process_gradients(two_processes):
    for rank in two_processes:
        assert rank["fsdp2"]["same_names"]
        assert rank["fsdp2"]["grad_diff"] <= 1e-5, rank["fsdp2"]


# ---------------------------------------------------------------- checks before launch

def test_head_counts_that_cannot_be_split_are_named_in_one_line():
    llama = sp_workers.make_config("llama", "sdpa")  # 4 heads, 4 KV heads
    qwen = sp_workers.make_config("qwen3", "sdpa")  # 4 heads, 2 KV heads
    single = sp_workers.make_config("qwen3-1kv", "sdpa")
    assert check_sequence_parallel(llama, 1) is None
    assert check_sequence_parallel(llama, 2) is None and check_sequence_parallel(llama, 4) is None
    assert check_sequence_parallel(single, 4) is None  # the KV head is repeated
    reason = check_sequence_parallel(llama, 3)
    assert reason == "sequence_parallel_size: 3 does not divide the model's 4 attention heads; use one of 1, 2, 4"
    qwen.num_attention_heads, qwen.num_key_value_heads = 12, 3
    assert "neither divides the model's 3 key/value heads" in check_sequence_parallel(qwen, 2)
    assert check_sequence_parallel(qwen, 3) is None and check_sequence_parallel(qwen, 6) is None
    assert check_world(4, 2) is None
    assert check_world(6, 4) == ("sequence_parallel_size: 4 does not divide the 6 processes; the processes form "
                                 "groups of 4, so launch a multiple of 4")


def test_apply_refuses_unsplittable_heads_and_other_attention():
    model = sp_workers.make_model("llama", "sdpa")
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        SequenceParallel(3, rank=0).apply(model)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="works with sdpa or eager attention, and this model uses flex_attention"):
        SequenceParallel(2, rank=0).apply(model)


def test_config_keys():
    base = {"model_name": "m", "dataset": "d"}
    config = parse_config({**base, "sequence_parallel_size": 4, "tiled_mlp": True, "tiled_mlp_shards": 8})
    assert (config.sequence_parallel_size, config.tiled_mlp, config.tiled_mlp_shards) == (4, True, 8)
    assert parse_config(base).sequence_parallel_size == 1 and not parse_config(base).tiled_mlp
    for bad, message in [({"sequence_parallel_size": 0}, "sequence_parallel_size: input should be greater than"),
                         ({"tiled_mlp_shards": 4}, "tiled_mlp_shards: only used with tiled_mlp: true"),
                         ({"sequence_parallel_size": 2, "use_unsloth": True}, "unsloth's own attention")]:
        with pytest.raises(ConfigError, match=message):
            parse_config({**base, **bad})


# ---------------------------------------------------------------- sharding a batch

def test_layout_groups_consecutive_ranks():
    layouts = [Layout(rank, 8, 2) for rank in range(8)]
    assert [(x.dp_rank, x.sp_rank) for x in layouts[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layouts[5].group_ranks() == [4, 5] and layouts[5].dp_size == 4


def test_shard_batch_pads_shifts_then_splits():
    batch = sp_workers.padded_batch(seed=3)  # 13 tokens: padded to 14
    shards = [SequenceParallel(2, rank=r).shard_batch(batch) for r in range(2)]
    whole = {key: torch.cat([s[key] for s in shards], dim=1) for key in shards[0]}
    assert whole["input_ids"].shape == (2, 14)
    assert torch.equal(whole["input_ids"][:, :13], batch["input_ids"])
    assert torch.equal(whole["labels"][:, :12], batch["labels"][:, 1:])  # each position holds its next token
    assert (whole["labels"][:, 12:] == -100).all() and whole["attention_mask"][:, 13].sum() == 0
    assert torch.equal(whole["position_ids"], torch.arange(14).expand(2, 14))
    assert sum(int(shard_targets(s)) for s in shards) == int((batch["labels"][:, 1:] != -100).sum())


def test_shard_batch_keeps_packed_positions_and_gives_padding_its_own():
    batch = sp_workers.packed_batch(seed=3)
    sp = SequenceParallel(4, rank=0)
    shard = sp.shard_batch(batch)
    width = sp.batch.length
    assert width % 4 == 0 and shard["input_ids"].shape[1] == width // 4
    positions = sp.batch.position_ids
    assert torch.equal(positions[:, :batch["position_ids"].shape[1]], batch["position_ids"])
    assert sp.batch.attention_mask is None  # packed rows: isolated by their positions, as on one process
    for row in range(positions.shape[0]):  # the added padding never continues a real example
        real = int(batch["attention_mask"][row].sum())
        tail = positions[row, real:]
        assert tail.numel() == 0 or tail[0] == 0 and torch.equal(tail, torch.arange(tail.numel()))


def test_attention_outside_a_sharded_batch_is_an_error():
    model = sp_workers.make_model("llama", "eager")
    SequenceParallel(2, rank=0).apply(model)
    with pytest.raises(RuntimeError, match="outside a sharded micro-batch"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
    sp = SequenceParallel(2, rank=0)
    sp.apply(model)  # applying twice keeps the original to go back to
    sp.restore(model)
    assert model.config._attn_implementation == "eager"
    model(input_ids=torch.ones(1, 4, dtype=torch.long))


def test_loader_gives_every_rank_of_a_group_the_same_rows():
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                  data_seed=1))
    seen = {}
    for rank in range(4):
        loader = DataLoader(list(range(16)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
        prepared = prepare_loader(accelerator, loader, Layout(rank, 4, 2))
        prepared.set_epoch(0)
        seen[rank] = [b.tolist() for b in prepared]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    assert sorted(x for b in seen[0] + seen[2] for x in b) == list(range(16))


# ---------------------------------------------------------------- tiled MLP

def _mean_loss_and_grads(model, batch):
    from praisonai_accel.methods.lm_loss import CausalLMLoss

    summed, targets = sp_workers.one_process(CausalLMLoss(model), batch)
    (summed / targets).backward()
    return float(summed.detach() / targets), sp_workers._grads(model)


@pytest.mark.parametrize("kind,lora", [("llama", False), ("gemma2", False), ("qwen3", True)])
def test_tiled_mlp_gives_the_plain_mlp_loss_and_gradients(kind, lora):
    def build():
        model = sp_workers.make_model(kind, "eager")
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"],
                                                     init_lora_weights=False))
        return model

    for batch in (sp_workers.padded_batch(seed=4), sp_workers.packed_batch(seed=4)):
        loss, grads = _mean_loss_and_grads(build(), batch)
        for shards in (3, None):
            tiled = build()
            assert apply_tiled_mlp(tiled, shards) == 2
            tiled_loss, tiled_grads = _mean_loss_and_grads(tiled, batch)
            assert abs(tiled_loss - loss) <= 1e-6
            assert sorted(tiled_grads) == sorted(grads)
            assert max(float((tiled_grads[k] - grads[k]).abs().max()) for k in grads) <= 1e-6


def test_tiled_mlp_keeps_one_tile_not_the_row():
    """Bytes saved for backward by the MLPs: plain grows by ~4 x intermediate_size per token, tiled only by its input."""
    def saved_bytes(model, length):
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        x = torch.randn(1, length, 32, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # what forward keeps for backward
            out = sum(mlp(x).sum() for mlp in decoder_mlps(model))
        out.backward()
        return total

    plain, tiled = sp_workers.make_model("llama", "eager"), sp_workers.make_model("llama", "eager")
    apply_tiled_mlp(tiled)
    plain_growth = saved_bytes(plain, 512) - saved_bytes(plain, 128)
    tiled_growth = saved_bytes(tiled, 512) - saved_bytes(tiled, 128)
    input_growth = 2 * 384 * 32 * 4  # each of the 2 MLPs keeps its input
    assert tiled_growth <= input_growth < plain_growth / 4
    assert tile_count(512, 32, None) == 16 and tile_count(3, 32, 8) == 3


def test_tiled_mlp_without_gradients_matches():
    plain, tiled = sp_workers.make_model("llama", "eager"), sp_workers.make_model("llama", "eager")
    apply_tiled_mlp(tiled, 4)
    apply_tiled_mlp(tiled, 4)  # idempotent
    ids = torch.randint(1, sp_workers.VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, tiled(input_ids=ids).logits, atol=1e-6)


def test_padding_added_for_the_split_keeps_the_mask_free_kernel():
    """An unpadded row of odd length gets one padding token; attention may treat it as a token (it comes last), so
    sdpa still needs no mask (a mask is rows x T x T)."""
    sp = SequenceParallel(2, rank=1)
    sp.model_config = sp_workers.make_config("llama", "sdpa")
    row = torch.ones(1, 11, dtype=torch.long)
    shard = sp.shard_batch({"input_ids": row, "labels": row, "attention_mask": row})
    assert shard["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0]]  # counts: the padding is no token
    assert sp.batch.mask(sp.model_config, "sdpa", None, torch.zeros(1)) is None
    assert sp.batch.mask(sp.model_config, "eager", None, torch.zeros(1)).shape == (1, 1, 12, 12)
