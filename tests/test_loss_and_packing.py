"""The chunked LM-head loss against cross-entropy over full logits, and packing's isolation proof, in process,
on tiny random models of real architectures (Llama with a 128k vocabulary, Gemma 2 with logit softcapping,
Gemma 3 with sliding-window attention, Qwen3-MoE)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from praisonai_accel.methods import lm_loss as loss_module
from praisonai_accel.data import PackedDataset, PadCollator, TokenizedDataset, best_fit_decreasing
from praisonai_accel.methods.lm_loss import CausalLMLoss, chunked_loss_sum, verify_head

LLAMA3_VOCAB = 128256


def tiny(kind: str, vocab: int = 512, attn: str = "sdpa"):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    config = {
        "llama": lambda: tf.LlamaConfig(**common),
        "gemma2": lambda: tf.Gemma2Config(**common, head_dim=16, final_logit_softcapping=3.0, sliding_window=8),
        "gemma3": lambda: tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=4, final_logit_softcapping=None),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**{**common, "intermediate_size": 64}, moe_intermediate_size=32,
                                               num_experts=4, num_experts_per_tok=2, head_dim=16),
    }[kind]()
    config._attn_implementation = attn
    torch.manual_seed(0)
    cls = tf.Gemma3ForCausalLM if kind == "gemma3" else tf.AutoModelForCausalLM
    model = cls.from_config(config) if cls is tf.AutoModelForCausalLM else cls(config)
    return model.float().eval()


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return model


def examples(count: int, vocab: int, seed: int = 0, low: int = 3, high: int = 40) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        n = rng.randint(low, high)
        ids = [rng.randrange(vocab) for _ in range(n)]
        prompt = rng.randint(1, n - 1)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    total = module(batch["input_ids"], batch["labels"], batch["attention_mask"], batch.get("position_ids"))
    total.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return total.detach(), grads


def assert_close_grads(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst


@pytest.mark.parametrize("kind,vocab,attn", [("llama", LLAMA3_VOCAB, "sdpa"), ("gemma2", 512, "eager"), ("qwen3_moe", 512, "sdpa")])
def test_chunked_loss_has_the_same_loss_and_gradients_as_full_logits(kind, vocab, attn, monkeypatch):
    # LoRA freezes the head: several row chunks of 16 targets, and 5 vocabulary blocks (the last one shorter)
    monkeypatch.setattr(loss_module, "FROZEN_HEAD_ROWS", 16)
    monkeypatch.setattr(loss_module, "TILE_ELEMENTS", 16 * (vocab // 5 + 1))
    model = lora(tiny(kind, vocab, attn))
    chunked, full = CausalLMLoss(model, chunked=True), CausalLMLoss(model, chunked=False)
    assert verify_head(chunked, list(range(3, 19)), "cpu")
    assert (chunked.softcap is not None) == (kind == "gemma2")
    batch = PadCollator(0)(examples(3, vocab))
    loss_c, grads_c = loss_and_grads(chunked, batch)
    loss_f, grads_f = loss_and_grads(full, batch)
    assert abs(loss_c.item() - loss_f.item()) <= 1e-5 * max(1.0, loss_f.item())
    assert_close_grads(grads_c, grads_f, 1e-5)


def test_chunked_loss_trains_a_full_lm_head_and_bias_like_autograd():
    torch.manual_seed(0)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    bias = torch.randn(300, requires_grad=True)
    targets = torch.randint(0, 300, (23,))
    for softcap, scale in ((None, None), (5.0, None), (None, 0.25)):
        got = chunked_loss_sum(hidden, weight, bias, targets, softcap, scale)
        grads = torch.autograd.grad(got * 2, (hidden, weight, bias))
        logits = hidden @ weight.t() + bias
        logits = logits * scale if scale else logits
        logits = torch.tanh(logits / softcap) * softcap if softcap else logits
        expected = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        reference = torch.autograd.grad(expected * 2, (hidden, weight, bias))
        assert abs(got.item() - expected.item()) <= 1e-4
        for g, r in zip(grads, reference):
            assert (g - r).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_head_gives_the_loss_and_hidden_gradient_of_autograd(dtype, monkeypatch):
    """The online-softmax path (LoRA/QLoRA: the head takes no gradient), walked over 3 row chunks x 4 vocabulary
    blocks, with a frozen bias, logit scaling and softcapping, and with targets in every block."""
    monkeypatch.setattr(loss_module, "FROZEN_HEAD_ROWS", 10)
    monkeypatch.setattr(loss_module, "TILE_ELEMENTS", 10 * 80)
    torch.manual_seed(0)
    hidden = (torch.randn(23, 16) * 2).to(dtype).requires_grad_()
    weight, bias = torch.randn(300, 16), torch.randn(300)
    targets = torch.randint(0, 300, (23,))
    for with_bias, softcap, scale in ((False, None, None), (True, 5.0, None), (False, None, 0.25), (True, 3.0, 2.0)):
        b = bias if with_bias else None
        got = chunked_loss_sum(hidden, weight, b, targets, softcap, scale)
        (grad,) = torch.autograd.grad(got * 2, (hidden,))
        logits = (hidden @ weight.to(dtype).t()).float() + (b if with_bias else 0)
        logits = logits * scale if scale else logits
        logits = torch.tanh(logits / softcap) * softcap if softcap else logits
        expected = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        (reference,) = torch.autograd.grad(expected * 2, (hidden,))
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert grad.dtype == dtype
        assert abs(got.item() - expected.item()) <= tolerance * abs(expected.item())
        assert (grad.float() - reference.float()).abs().max().item() <= tolerance * reference.float().abs().max().item()
    # no target at all: a zero loss and a zero gradient
    empty = chunked_loss_sum(hidden[:0], weight, None, targets[:0])
    assert empty.item() == 0


def test_under_autocast_the_head_computes_in_autocasts_dtype():
    """bf16 mixed precision: fp32 hidden states from the final norm, the head's matmuls in bf16 as autocast would
    run them (closer to the bf16 reference than to the fp32 one), the gradient handed back in fp32."""
    torch.manual_seed(0)
    hidden = (torch.randn(23, 64) * 2).requires_grad_()
    weight, targets = torch.randn(300, 64), torch.randint(0, 300, (23,))
    for trained_head in (False, True):
        w = weight.clone().requires_grad_(trained_head)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = chunked_loss_sum(hidden, w, None, targets)
        (grad,) = torch.autograd.grad(got, (hidden,))
        assert grad.dtype == torch.float32
        bf16 = torch.nn.functional.cross_entropy((hidden.bfloat16() @ weight.bfloat16().t()).float(), targets,
                                                 reduction="sum")
        fp32 = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
        assert abs(got.item() - bf16.item()) < abs(got.item() - fp32.item()), (got, bf16, fp32)


def test_a_head_that_is_not_a_plain_projection_falls_back_to_full_logits():
    model = tiny("llama")
    module = CausalLMLoss(model)
    module.scale = 2.0  # what the model does not do: decoder + head no longer reproduce its logits
    assert not verify_head(module, list(range(3, 19)), "cpu")


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("gemma3", "sdpa"), ("qwen3_moe", "sdpa")])
def test_packed_examples_have_exactly_their_unpacked_loss_and_gradients(kind, attn):
    """The isolation proof: examples packed into rows (position ids restarting, no 2-D mask) give the loss and
    gradients they give one per row. Gemma 3's sliding window (4 tokens here) must compose with the packing."""
    vocab = 512
    model = lora(tiny(kind, vocab, attn))
    module = CausalLMLoss(model)
    rows = examples(12, vocab, seed=3)
    unpacked = PadCollator(0)(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    data = TokenizedDataset.from_columns({"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]},
                                         [False] * len(rows), [0] * len(rows))
    packed_rows = PackedDataset(data, lengths, capacity=64)
    assert len(packed_rows) < len(rows)  # really packed
    packed = PadCollator(0)([packed_rows[i] for i in range(len(packed_rows))])
    loss_u, grads_u = loss_and_grads(module, unpacked)
    loss_p, grads_p = loss_and_grads(module, packed)
    assert abs(loss_u.item() - loss_p.item()) <= 1e-5 * loss_u.item()
    assert_close_grads(grads_u, grads_p, 1e-5)
    # and the same rows with a plain causal mask (no restarting positions) do see each other
    crossing = dict(packed)
    crossing.pop("position_ids")
    assert abs(module(crossing["input_ids"], crossing["labels"], crossing["attention_mask"]).item() - loss_u.item()) > 1e-3


def test_best_fit_decreasing_fills_rows():
    rng = random.Random(0)
    lengths = [rng.randint(20, 400) for _ in range(2000)]
    rows = best_fit_decreasing(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(2000))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    padding = 1 - sum(lengths) / (len(rows) * 512)
    assert padding <= 0.02, padding
    assert best_fit_decreasing(lengths, 512) == rows  # deterministic: every rank builds the same rows


def test_packed_row_never_trains_across_examples():
    data = TokenizedDataset.from_columns({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[1, 2, 3], [4, 5]]}, [False, False],
                                         [0, 0])
    row = PackedDataset(data, [3, 2], capacity=8)[0]
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5]
    assert row["labels"].tolist() == [-100, 2, 3, -100, 5]  # each example's first token is nobody's target
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1]
    assert np.asarray(row["labels"]).dtype == np.int64


def test_chunked_loss_with_bf16_hidden_states_and_fp32_master_weights(monkeypatch):
    """Full fine-tuning under bf16 autocast: bf16 hidden states, an fp32 head. The weight gradient accumulates in the
    weight's own dtype (fp32), several chunks of it, and matches autograd on the same bf16 products."""
    from praisonai_accel.methods import lm_loss as loss_module

    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 300 * 5)  # 5 rows a chunk: 5 chunks
    torch.manual_seed(0)
    hidden = torch.randn(23, 16).bfloat16().requires_grad_()
    weight = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (23,))
    got = chunked_loss_sum(hidden, weight, None, targets)
    grad_hidden, grad_weight = torch.autograd.grad(got * 3, (hidden, weight))
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.float32
    logits = (hidden @ weight.bfloat16().t()).float()
    expected = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    ref_hidden, ref_weight = torch.autograd.grad(expected * 3, (hidden, weight))
    assert abs(got.item() - expected.item()) <= 1e-3 * abs(expected.item())
    assert (grad_weight - ref_weight).abs().max().item() <= 2e-2 * ref_weight.abs().max().item()
    assert (grad_hidden.float() - ref_hidden.float()).abs().max().item() <= 2e-2 * ref_hidden.float().abs().max().item()
