"""Model FLOPs (flops.py), what bench/run.py divides by the matmul peak to report MFU: the counts are checked against
the architecture worked out by hand, and the batch statistics on padded and packed rows."""

from __future__ import annotations

import pytest
import torch

from praisonai_accel.worker.flops import FlopCounts, attended_keys, examples_in, flop_counts

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
# per layer: q and o are hidden x hidden, k and v hidden x (kv heads x head dim), gate/up/down hidden x intermediate
ATTENTION = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM
MLP = 3 * HIDDEN * INTERMEDIATE
DECODER = LAYERS * (ATTENTION + MLP)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, tie_word_embeddings=False))


def test_lora_counts_the_frozen_base_and_the_adapters_apart():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules="all-linear"))
    counts = flop_counts(model)
    # r x (in + out) per adapted projection
    kv = KV_HEADS * HEAD_DIM
    adapters = LAYERS * 4 * (2 * (HIDDEN + HIDDEN) + 2 * (HIDDEN + kv) + 3 * (HIDDEN + INTERMEDIATE))
    assert counts == FlopCounts(frozen=DECODER, trained=adapters, layers=LAYERS, attention_width=HIDDEN,
                                head=HIDDEN * VOCAB, head_trained=False)
    # 4 x frozen + 6 x trained per token, 12 x layers x width per attended key, 4 x hidden x vocab per target
    assert counts.step(tokens=10, attended=30, targets=4) == (
        (4 * DECODER + 6 * adapters) * 10 + 12 * LAYERS * HIDDEN * 30 + 4 * HIDDEN * VOCAB * 4)


def test_full_fine_tuning_trains_every_matrix_and_the_head():
    counts = flop_counts(llama())
    assert (counts.frozen, counts.trained, counts.head_trained) == (0, DECODER, True)
    assert counts.step(1, 0, 1) == 6 * DECODER + 6 * HIDDEN * VOCAB


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_moe_layer_counts_only_the_experts_a_token_is_routed_to(top_k):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def counts(k):
        config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=k, num_hidden_layers=LAYERS,
                                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
        return flop_counts(Qwen3MoeForCausalLM(config)).trained

    experts = LAYERS * 4 * 3 * HIDDEN * 32  # 4 experts of 3 hidden x 32 matrices per layer
    assert counts(4) - counts(top_k) == experts * (4 - top_k) // 4


def test_attended_keys_and_examples_on_padded_and_packed_rows():
    padded = {"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])}
    assert attended_keys(padded["attention_mask"]) == (1 + 2 + 3) + (1 + 2)
    assert examples_in(padded) == 2  # an all-padding row trains nothing
    packed = {"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
              "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0]])}  # two examples, then padding at position 0
    assert attended_keys(packed["attention_mask"], packed["position_ids"]) == (1 + 2) + (1 + 2 + 3)
    assert examples_in(packed) == 2
