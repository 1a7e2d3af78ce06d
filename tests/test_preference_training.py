"""The preference loss module, in process, without the recipe: a tiny model with LoRA (and fully fine-tuned) driven
by a plain torch loop over the method's collate and loss module.

- step-0 sigmoid DPO loss is ln 2 (policy == reference), KTO's is 0.5 per example;
- the reference (base weights with the adapter disabled; the frozen copy) never changes, and rewards/accuracies
  rises on the training pairs;
- the summed-loss normalisation: one batch of 2B == two batches of B accumulated (gradients to 1e-6);
- the chunked head gives the loss and gradients of the model's full logits;
- precomputed reference log-probs give the same loss, and a second load does not recompute them.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from praisonai_accel.data import ensure_chat_template
from praisonai_accel.methods.preference import PreferenceLoss, PreferenceMethod
from praisonai_accel.methods.reference_logps import WithReference, compute_reference_logps, load_or_compute

DEFAULTS = dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=0.5, max_prompt_length=64,
                max_seq_length=128, desirable_weight=1.0, undesirable_weight=1.0, model_fields_set=set())


def _config(method="dpo", **overrides):
    return SimpleNamespace(**{**DEFAULTS, "method": method, **overrides})


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ensure_chat_template(tokenizer)
    return tiny_model, tokenizer


def _model(path, lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"],
                                                 lora_dropout=0.0))
    return model


def _pairs(tokenizer, method, count=16, seed=0):
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        row = {"prompt": [{"role": "user", "content": f"add {a} and {b}"}],
               "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}"}],
               "rejected": [{"role": "assistant", "content": f"{a} and {b} make {a + b + rng.randint(1, 5)} i think"}]}
        examples.append(method.encode(row, "paired", tokenizer, _config()))
    return examples


def _kto_examples(tokenizer, method, count=8):
    rows = [{"prompt": [{"role": "user", "content": f"add {i} and 1"}],
             "completion": [{"role": "assistant", "content": f"{i} plus 1 is {i + 1 + (i % 2)}"}], "label": i % 2 == 0}
            for i in range(count)]
    return [method.encode(r, "unpaired", tokenizer, _config("kto")) for r in rows]


def _frozen_state(module):
    return {k: v.detach().clone() for k, v in module.named_parameters() if not v.requires_grad}


def _train(module, method, examples, pad, steps, batch, lr=5e-3):
    """A plain loop: each step one batch, loss = loss_sum / units (the recipe's normalisation)."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    history = []
    for step in range(steps):
        chunk = [examples[(step * batch + i) % len(examples)] for i in range(batch)]
        data = method.collate(chunk, pad)
        units = method.units(data)
        loss_sum, metrics = module(**data)
        history.append((loss_sum.item() / units, {k: v.item() / units for k, v in metrics.items()}))
        optimizer.zero_grad()
        (loss_sum / units).backward()
        optimizer.step()
    return history


def _evaluate(module, method, examples, pad):
    with torch.no_grad():
        data = method.collate(examples, pad)
        loss_sum, metrics = module(**data)
    return {k: v.item() / method.units(data) for k, v in metrics.items()}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_dpo_learns_from_ln2_and_the_reference_never_changes(tiny, lora):
    path, tokenizer = tiny
    method = PreferenceMethod(_config())
    examples = _pairs(tokenizer, method)
    model = _model(path, lora)
    module = PreferenceLoss(model, _config(), chunked=True).train()
    assert (module.reference is None) == lora  # LoRA: no second copy; full: a frozen copy as a submodule
    frozen = _frozen_state(module)
    pad = tokenizer.pad_token_id
    data = method.collate(examples, pad)
    reference_before = module.reference_logps(data["input_ids"], data["labels"], data["attention_mask"])
    before = _evaluate(module, method, examples, pad)
    assert abs(before["rewards/margins"]) < 1e-6  # policy == reference (accuracies: rounding noise, not 0)
    history = _train(module, method, examples, pad, steps=12, batch=8, lr=5e-3 if lora else 1e-3)
    assert abs(history[0][0] - math.log(2)) < 1e-6
    after = _evaluate(module, method, examples, pad)
    assert after["rewards/accuracies"] >= 0.75 > before["rewards/accuracies"]
    assert after["rewards/margins"] > 0
    for name, value in _frozen_state(module).items():
        assert torch.equal(value, frozen[name]), name
    reference_after = module.reference_logps(data["input_ids"], data["labels"], data["attention_mask"])
    assert torch.allclose(reference_before, reference_after, atol=1e-6)


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("method_name,loss_type", [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "simpo"), ("orpo", "sigmoid")])
def test_one_batch_of_2b_equals_two_batches_of_b(tiny, method_name, loss_type):
    path, tokenizer = tiny
    config = _config(method_name, loss_type=loss_type)
    method = PreferenceMethod(config)
    examples = _pairs(tokenizer, method, count=8)
    module = PreferenceLoss(_model(path, lora=True), config, chunked=True).train()
    with torch.no_grad():  # a policy that differs from the reference
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    pad, total = tokenizer.pad_token_id, len(examples)
    loss_sum, _ = module(**method.collate(examples, pad))
    (loss_sum / total).backward()
    one = _grads(module)
    module.zero_grad()
    for half in (examples[:4], examples[4:]):
        loss_sum, _ = module(**method.collate(half, pad))
        (loss_sum / total).backward()
    two = _grads(module)
    assert one.keys() == two.keys() and one
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_chunked_head_equals_full_logits(tiny, lora):
    path, tokenizer = tiny
    method = PreferenceMethod(_config())
    examples = _pairs(tokenizer, method, count=4)
    data = method.collate(examples, tokenizer.pad_token_id)
    results = []
    for chunked in (True, False):
        module = PreferenceLoss(_model(path, lora), _config(), chunked=chunked).train()
        with torch.no_grad():
            for name, p in module.causal_lm.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.01)  # the same draw for both: seeded by _model
        loss_sum, metrics = module(**data)
        loss_sum.backward()
        results.append((loss_sum.detach(), metrics, _grads(module)))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    for name in metrics_a:
        assert torch.allclose(metrics_a[name], metrics_b[name], atol=1e-4), name
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4), name


def test_kto_step0_and_precomputed_reference(tiny, tmp_path):
    path, tokenizer = tiny
    method = PreferenceMethod(_config("kto"))
    examples = _kto_examples(tokenizer, method)
    module = PreferenceLoss(_model(path, lora=True), _config("kto", desirable_weight=1.5), chunked=True).train()
    data = method.collate(examples, tokenizer.pad_token_id)
    loss_sum, metrics = module(**data)
    desirable = int(data["desirable"].sum())
    # policy == reference: every log-ratio and the KL estimate are 0, so each loss is weight x (1 - sigmoid(0))
    assert loss_sum.item() == pytest.approx(0.5 * (1.5 * desirable + (len(examples) - desirable)), abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-6)
    calls = []

    def compute():
        calls.append(1)
        return compute_reference_logps(method, module, examples, 3, tokenizer.pad_token_id)

    target = tmp_path / "reference_logps" / "train.safetensors"
    tensors, computed = load_or_compute(target, "fp-1", compute)
    again, computed_again = load_or_compute(target, "fp-1", compute)
    assert computed and not computed_again and len(calls) == 1 and torch.equal(tensors["ref_logps"], again["ref_logps"])
    assert load_or_compute(target, "fp-2", compute)[1] and len(calls) == 2  # other data or model: recomputed
    carried = method.collate([WithReference(examples, tensors)[i] for i in range(len(examples))], tokenizer.pad_token_id)
    assert torch.allclose(module(**carried)[0], loss_sum, atol=1e-6)


def test_dpo_precomputed_reference_skips_the_reference_pass(tiny, tmp_path):
    path, tokenizer = tiny
    method = PreferenceMethod(_config())
    examples = _pairs(tokenizer, method, count=6)
    module = PreferenceLoss(_model(path, lora=True), _config(), chunked=True).train()
    tensors = compute_reference_logps(method, module, examples, 4, tokenizer.pad_token_id)
    data = method.collate(examples, tokenizer.pad_token_id)
    live = module(**data)[0]
    carried = method.collate([WithReference(examples, tensors)[i] for i in range(6)], tokenizer.pad_token_id)
    passes = []
    module.reference_logps = lambda *a: passes.append(1)  # must not be called
    assert torch.allclose(module(**carried)[0], live, atol=1e-6) and not passes


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_module_equals_trl_dpo_trainer_on_a_real_model(tiny, loss_type):
    """Our loss module and TRL's own DPOTrainer._compute_loss, each running the same LoRA model (TRL through its
    fused LM head, the reference by disabling the adapter) on the same tokens: loss and metrics agree."""
    from collections import defaultdict

    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    path, tokenizer = tiny
    config = _config(loss_type=loss_type)
    method = PreferenceMethod(config)
    data = method.collate(_pairs(tokenizer, method, count=4), tokenizer.pad_token_id)
    model = _model(path, lora=True)
    with torch.no_grad():  # a policy that differs from the reference
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    module = PreferenceLoss(model, config, chunked=True).train()
    loss_sum, metrics = module(**data)

    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x,
                                  unwrap_model=lambda m: m)
    stub = SimpleNamespace(model=model, ref_model=None, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=[loss_type],
                           loss_weights=[1.0], beta=config.beta, label_smoothing=0.0, use_weighting=False,
                           args=SimpleNamespace(gradient_checkpointing_kwargs=None),
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"],
              "completion_mask": (data["labels"] != -100).long()}
    expected = DPOTrainer._compute_loss(stub, model, inputs, False)
    units = method.units(data)
    assert loss_sum.item() / units == pytest.approx(expected.item(), abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected"):
        assert metrics[name].item() / units == pytest.approx(stub._metrics["train"][name][-1], abs=1e-4), name
