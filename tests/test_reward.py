"""Reward models (methods/reward.py), in process on the tiny model:

- the loss and metrics equal TRL's own RewardTrainer.compute_loss on the same model and inputs (margin and
  centring included), to 1e-6, with each pair's prompt computed once (shared-prefix rows);
- shared-prefix rows give the rewards and LoRA gradients of the pairs' own padded rows (Llama, Qwen3-MoE, Mistral,
  Qwen2; sdpa and eager; pad and eos the same token), and are turned off, with the reason in one line, where they
  could not (flash attention, a sliding window or other layer types, dropout, no pad id, a probe pair whose
  rewards differ, left padding, prefix_sharing: false);
  on LLaMA-Factory's real DPO pairs (Phi-3's template) each reward token sees exactly its own row;
- one batch of 2B gives the gradients of two batches of B accumulated (the recipe's summed-loss normalisation);
- LoRA trains the score head in full (peft's modules_to_save), and accuracy rises on the training pairs;
- a reward model as a GRPO reward (reward_funcs: model:PATH) scores each completion as the model's own forward on
  the text alone; a path that is not a reward model is refused in one line; under FSDP2 (2 processes over gloo) it
  is sharded (every parameter a DTensor, each rank holding part of it, again after scoring) and the ranks run the
  same number of forwards when one has fewer completions, giving the plain model's rewards;
- rows: a margin column rides along exactly; a bad margin is named; the config keys and a head of several labels
  are refused in one line; `reward_model_problem` names a path that is not a sequence classifier.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from praisonai_accel.data import ensure_chat_template
from praisonai_accel.config import ConfigError
from praisonai_accel.methods.reward import (
    RewardLoss, RewardMethod, base_head_problem, margin_bits, margin_value, reward_model_problem, score_texts)

CONFIG = dict(method="reward", max_prompt_length=64, max_seq_length=128, center_rewards_coefficient=None,
              model_fields_set=set())


def _config(**overrides):
    return SimpleNamespace(**{**CONFIG, **overrides})


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ensure_chat_template(tokenizer)
    return tiny_model, tokenizer


def _classifier(path, tokenizer, lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, task_type="SEQ_CLS"))
    return model


def _rows(count=16, seed=0, margins=False):
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        row = {"prompt": [{"role": "user", "content": f"add {a} and {b}"}],
               "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}"}],
               "rejected": [{"role": "assistant", "content": f"{a} and {b} make {a + b + rng.randint(1, 5)} i think"}]}
        if margins:
            row["margin"] = [0.0, 0.5, 1.25, -0.3][i % 4]
        rows.append(row)
    return rows


def _examples(method, tokenizer, rows, config=None):
    out = [method.encode(r, "paired", tokenizer, config or _config()) for r in rows]
    assert all(isinstance(e, dict) for e in out), out
    return out


def _trl_loss(model, batch, coefficient):
    """TRL's RewardTrainer.compute_loss itself, on a stand-in for the trainer holding what it reads."""
    from accelerate import Accelerator
    from trl import RewardTrainer

    trainer = SimpleNamespace(model=model, args=SimpleNamespace(center_rewards_coefficient=coefficient),
                              accelerator=Accelerator(cpu=True), _total_train_tokens=0, _tp_size=1,
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "margin")}
    loss = RewardTrainer.compute_loss(trainer, model, inputs)
    mode = "train" if model.training else "eval"
    return loss, {k: v[-1] for k, v in trainer._metrics[mode].items()}


@pytest.mark.parametrize("margins,coefficient", [(False, None), (True, None), (True, 0.01)])
def test_loss_and_metrics_equal_trls_reward_trainer(tiny, margins, coefficient):
    path, tokenizer = tiny
    method = RewardMethod(_config(center_rewards_coefficient=coefficient))
    model = _classifier(path, tokenizer, lora=False)
    with torch.no_grad():  # a score head far from zero, so the margin and centring terms matter
        model.score.weight.normal_(0, 2.0)
    rows = _rows(8, margins=margins)
    for row in rows[::2]:  # half the pairs the other way round: an accuracy of neither 0 nor 1
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
    examples = _examples(method, tokenizer, rows)
    batch = method.collate(examples, tokenizer.pad_token_id)
    assert ("margin" in batch) == margins
    module = RewardLoss(model, coefficient)
    assert module.shared_rows(batch["input_ids"], batch["attention_mask"]) is not None  # the prompts computed once
    loss_sum, sums = method.forward(module, batch)
    units = method.units(batch)
    ours = loss_sum / units
    theirs, trl_metrics = _trl_loss(model, batch, coefficient)
    assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
    metrics = method.reduce_metrics({k: v.item() for k, v in sums.items()}, units)
    assert metrics["accuracy"] == pytest.approx(trl_metrics["accuracy"], abs=1e-6)
    assert metrics["margin"] == pytest.approx(trl_metrics["margin"], abs=1e-6)
    assert metrics["mean_reward"] == pytest.approx(trl_metrics["mean_reward"], abs=1e-6)
    assert 0 < metrics["accuracy"] < 1  # the comparison is not trivially all or nothing
    # the gradient of our summed loss / units is the gradient of TRL's mean
    model.zero_grad()
    ours.backward()
    ours_grad = model.score.weight.grad.clone()
    model.zero_grad()
    _trl_loss(model, batch, coefficient)[0].backward()
    assert torch.allclose(ours_grad, model.score.weight.grad, atol=1e-6)


def test_one_batch_of_2b_equals_two_batches_of_b(tiny):
    path, tokenizer = tiny
    method = RewardMethod(_config(center_rewards_coefficient=0.05))
    examples = _examples(method, tokenizer, _rows(8, margins=True))
    grads = []
    for split in ((examples,), (examples[:4], examples[4:])):
        module = RewardLoss(_classifier(path, tokenizer, lora=True), 0.05)
        batches = [method.collate(list(part), tokenizer.pad_token_id) for part in split]
        total = sum(method.units(b) for b in batches)
        for b in batches:
            (method.forward(module, b)[0] / total).backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) <= 1e-6


def test_lora_trains_the_score_head_in_full_and_accuracy_rises(tiny):
    path, tokenizer = tiny
    method = RewardMethod(_config())
    model = _classifier(path, tokenizer, lora=True)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n and "modules_to_save" in n and "lora" not in n for n in trained), trained
    module = RewardLoss(model, None)
    examples = _examples(method, tokenizer, _rows(16))
    batch = method.collate(examples, tokenizer.pad_token_id)

    def accuracy():
        with torch.no_grad():
            return method.reduce_metrics({k: v.item() for k, v in method.forward(module, batch)[1].items()},
                                         method.units(batch))["accuracy"]

    before = accuracy()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for step in range(12):
        part = method.collate(examples[(step % 4) * 4:(step % 4) * 4 + 4], tokenizer.pad_token_id)
        loss = method.forward(module, part)[0] / method.units(part)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert accuracy() > max(before, 0.8), before


def test_margin_rides_through_the_int_cache_exactly_and_a_bad_one_is_named(tiny):
    _, tokenizer = tiny
    for value in (0.0, 0.1, -2.5, 1e-7, 3.4e38):
        assert margin_value(margin_bits(value)) == float(torch.tensor(value, dtype=torch.float32))
    method = RewardMethod(_config())
    row = _rows(1)[0]
    assert method.check_row({**row, "margin": "high"}, "paired") == "'margin' is 'high'; it must be a finite number"
    assert "finite" in method.check_row({**row, "margin": float("nan")}, "paired")
    assert method.check_row({**row, "margin": 2}, "paired") is None
    assert "missing" in method.check_row({k: v for k, v in row.items() if k != "rejected"}, "paired")
    text = {"prompt": "Q: 1+1?", "chosen": " 2", "rejected": " 3", "margin": 0.75}
    example = method.encode(text, "paired", tokenizer, _config())
    assert margin_value(example["margin"]) == 0.75
    assert example["chosen_input_ids"][-1] == tokenizer.eos_token_id  # TRL's text rows end with eos


def test_config_refuses_reward_keys_elsewhere_and_other_keys_here(tiny_model, tmp_path):
    from praisonai_accel.config import parse_config

    base = {"model_name": str(tiny_model), "dataset": [{"name": "x.jsonl"}]}
    config = parse_config({**base, "method": "reward", "center_rewards_coefficient": 0.01,
                           "metric_for_best_model": "eval_accuracy"})
    assert config.center_rewards_coefficient == 0.01 and config.model_head == "sequence-classification"
    with pytest.raises(ConfigError, match="center_rewards_coefficient: belongs to method reward, not to method: dpo"):
        parse_config({**base, "method": "dpo", "center_rewards_coefficient": 0.01})
    with pytest.raises(ConfigError, match="beta: belongs to method"):
        parse_config({**base, "method": "reward", "beta": 0.5})
    with pytest.raises(ConfigError, match="packing: method reward trains whole pairs"):
        parse_config({**base, "method": "reward", "packing": True})
    from praisonai_accel.checks import method_rule

    for key, value in (("save_gguf", True), ("ollama_model", "rm:latest")):  # llama.cpp would get the base LM
        with pytest.raises(ConfigError, match=f"{key}: a reward model .* scores text and writes none"):
            method_rule(parse_config({**base, "method": "reward", key: value}))


@pytest.mark.parametrize("command", [["generate", "DIR", "-p", "hi"], ["chat", "DIR"], ["serve", "DIR"],
                                     ["export", "gguf", "DIR"], ["publish", "ollama", "DIR", "--name", "rm"],
                                     ["eval", "DIR", "--tasks", "arc_easy"]])
def test_commands_that_need_a_model_that_writes_refuse_a_reward_model_in_one_line(tiny_model, tmp_path, command,
                                                                                   monkeypatch):
    """A reward model scores; generate gave an AttributeError traceback, serve started a server whose requests
    failed, and export gguf would have merged the adapter onto the base LM (found trying the demo's outputs)."""
    from typer.testing import CliRunner

    import praisonai_accel.serve.target as serve_target
    from praisonai_accel.cli import app

    def no_server(engine):  # past the refusal, serve would start a server and this test would never end
        raise AssertionError(f"serve went on to start {engine}")

    monkeypatch.setattr(serve_target, "require_engine", no_server)
    model = vowel_reward_model(tiny_model, tmp_path / "rm")
    result = CliRunner().invoke(app, [str(model) if a == "DIR" else a for a in command], input="")
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output[-2000:]
    assert f"{model} is a reward model (a one-label sequence classifier): it scores text" in errors[0], errors
    assert f"praisonai-accel score {model}" in errors[0] and "Traceback" not in result.output


def test_heads_and_paths_that_are_not_reward_models_are_named(tiny_model, tmp_path):
    assert base_head_problem(str(tiny_model)) is None  # a causal LM gets a new one-label head
    two = tmp_path / "two-labels"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}}))
    assert base_head_problem(str(two)) == (f"model_name: {two} has a classification head with 2 labels; a reward "
                                           "model has one")
    assert "is not a sequence classifier (architectures: LlamaForCausalLM)" in reward_model_problem(tiny_model)
    assert "has a classification head with 2 labels" in reward_model_problem(two)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM"}))
    assert "not a sequence classifier (SEQ_CLS)" in reward_model_problem(adapter)
    assert "is not a directory" in reward_model_problem(tmp_path / "nothing")


def test_the_method_declares_its_check_head_headline_and_report_row(tmp_path):
    """What the house asks of method: reward goes through its class (the registry's seam), not its name."""
    from praisonai_accel.checks import method_rule
    from praisonai_accel.config import parse_config
    from praisonai_accel.methods.registry import method_class

    assert method_class("reward") is RewardMethod and RewardMethod.model_head == "sequence-classification"
    assert RewardMethod.headline_metrics == ("accuracy", "margin")
    two = tmp_path / "two-labels"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}}))
    config = parse_config({"model_name": str(two), "dataset": "d.jsonl", "method": "reward"})
    with pytest.raises(ConfigError, match="has a classification head with 2 labels; a reward model has one"):
        method_rule(config)
    records = [{"step": 1, "loss": 0.7, "accuracy": 0.5}, {"step": 2, "eval_loss": 0.6, "eval_accuracy": 0.625},
               {"step": 4, "eval_loss": 0.5, "eval_accuracy": 0.75}]
    assert RewardMethod.report_rows(records) == [("eval accuracy (last)", "0.7500 at step 4")]
    assert RewardMethod.report_rows(records[:1]) == []


def test_score_texts_is_the_models_own_forward(tiny):
    path, tokenizer = tiny
    model = _classifier(path, tokenizer, lora=False).eval()
    pairs = [("Q: 1+1?", " 2"), ("Q: what is the capital of France?", " Paris, a city on the Seine")]
    rewards = score_texts(model, tokenizer, pairs, chat=False)
    for (prompt, completion), reward in zip(pairs, rewards):
        ids = tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids.append(tokenizer.eos_token_id)
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert reward == pytest.approx(alone, abs=1e-5)


def vowel_reward_model(base, directory):
    """A one-layer reward model built by hand, whose reward grows with the share of tokens holding a vowel (the
    score reads a direction only such tokens' embeddings have, averaged over the row by uniform attention): a
    signal a tiny GRPO policy can climb. Saved as a plain sequence classifier with its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    config = AutoConfig.from_pretrained(str(base))
    config.num_hidden_layers, config.num_labels = 1, 1
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    special = set(tokenizer.all_special_ids)
    good = [i for i in range(len(tokenizer)) if i not in special and any(v in tokenizer.decode([i]) for v in "aeiou")]
    layer = model.model.layers[0]
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings.normal_(0, 1.0)
        embeddings[:, 0] = 0.0
        embeddings[good, 0] = 3.0
        for weight in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
                       layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight, model.score.weight):
            weight.zero_()
        layer.self_attn.v_proj.weight[0, 0] = layer.self_attn.o_proj.weight[0, 0] = 1.0
        model.score.weight[0, 0] = 1.5
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_reward_model_as_grpo_reward_gives_its_own_forward_on_each_text(tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from praisonai_accel.methods.rewards import load_reward_functions, score

    path, tokenizer = tiny
    vowel_reward_model(path, tmp_path / "rm")
    config = SimpleNamespace(reward_funcs=["model:rm", "exact_match"], reward_weights=[1.0, 0.5],
                             reward_format_pattern="")
    functions = load_reward_functions(config, base_dir=tmp_path)  # relative to the config's directory
    assert functions[0].short_name == "rm" and functions[0].columns == ()
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    text_prompts = ["reverse the words: ada bob", "reverse the words: cy eve dan"] * 2
    text_completions = ["bob ada", "dan eve cy", "xyz b", "a e i o u"]
    chat_prompts = [[{"role": "user", "content": p}] for p in text_prompts]
    chat_completions = [[{"role": "assistant", "content": c}] for c in text_completions]
    for prompts, completions in ((text_prompts, text_completions), (chat_prompts, chat_completions)):
        rewards = score(functions, prompts, completions, [[1]] * 4, {"answer": ["bob ada", "x", "y", "z"]},
                        list(range(4)))
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            if isinstance(prompt, str):
                ids = (tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"]
                       + [tokenizer.eos_token_id])
            else:
                ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
            assert rewards[i, 0].item() == pytest.approx(alone, abs=1e-5)
        assert rewards[0, 1].item() == 1.0 and len(set(rewards[:, 0].tolist())) == 4
    assert functions[0].func._model.device.type == "cpu" and not any(
        p.requires_grad for p in functions[0].func._model.parameters())
    assert not functions[0].func.collective  # one process: a plain copy, scored without collectives

    for entry, words in (("model:nowhere", "model:nowhere: "), (f"model:{path}", "not a sequence classifier")):
        with pytest.raises(ConfigError, match=words):
            load_reward_functions(SimpleNamespace(reward_funcs=[entry], reward_weights=None, reward_format_pattern=""),
                                  base_dir=tmp_path)


SHARDED_TEXTS = [("reverse the words: ada bob", c) for c in ("bob ada", "dan eve cy", "xyz b", "a e i o u", "qq")]
SHARDED_CALLS = ((5, 1), (1, 4))  # completions per rank in each call, 2 per batch: 3 then 2 forwards on each rank


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from praisonai_accel.methods.reward_scoring import ModelReward, held_parameters

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_FSDP="true")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))  # a rank out of step
    try:                                                                                      # fails, not hangs
        reward = ModelReward(model_dir, batch_size=2)
        model, _ = reward.load()
        forwards = []
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        rewards = []
        for counts in SHARDED_CALLS:
            texts = SHARDED_TEXTS[:counts[rank]]
            rewards.append(reward(prompts=[p for p, _ in texts], completions=[c for _, c in texts]))
        held, total = held_parameters(model)
        torch.save({"rewards": rewards, "forwards": len(forwards), "collective": reward.collective,
                    "dtensors": all(isinstance(p, DTensor) for p in model.parameters()), "held": held,
                    "total": total, "grads": any(p.requires_grad for p in model.parameters())}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_under_fsdp2_the_reward_model_is_sharded_and_ranks_score_in_lockstep(tiny, tmp_path):
    """A rank with fewer completions still runs the other's number of forwards (dummy batches, dropped): otherwise
    the other rank's all-gather would wait forever. One spawn of two ranks (most of a minute on 2 shared cores)."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForSequenceClassification

    path, tokenizer = tiny
    rm = vowel_reward_model(path, tmp_path / "rm")
    mp.spawn(_sharded_worker, args=(2, _free_port(), str(rm), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert [r["forwards"] for r in ranks] == [5, 5]  # 3 + 2 batches each, whatever its own share
    assert all(r["collective"] and r["dtensors"] and not r["grads"] for r in ranks)
    assert ranks[0]["total"] == ranks[1]["total"] == ranks[0]["held"] + ranks[1]["held"]
    assert all(0 < r["held"] < r["total"] for r in ranks)  # a full copy would hold all of it
    model = AutoModelForSequenceClassification.from_pretrained(str(rm)).eval()
    for rank, r in enumerate(ranks):
        for call, counts in enumerate(SHARDED_CALLS):
            expected = []
            for prompt, completion in SHARDED_TEXTS[:counts[rank]]:
                ids = (tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"]
                       + [tokenizer.eos_token_id])
                with torch.no_grad():
                    expected.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
            assert r["rewards"][call] == pytest.approx(expected, abs=1e-5), (rank, call)


# ---------------------------------------------------------------- pairs sharing their prefix in one row

def _random_classifier(kind: str, attention: str, pad_token_id: int = 0):
    """A tiny random one-label classifier of a real architecture, in float32."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=pad_token_id, num_labels=1)
    config = {"llama": lambda: tf.LlamaConfig(**common),
              "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                     num_experts_per_tok=2),
              "mistral": lambda: tf.MistralConfig(**common, sliding_window=None),
              "qwen2": lambda: tf.Qwen2Config(**common, sliding_window=64, use_sliding_window=False)}[kind]()
    config._attn_implementation = attention
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attention, dtype=torch.float32)


def _pair_batch(pad_token_id: int, ends_with: int | None = None):
    """Pairs of every kind: a long shared prompt, chosen a prefix of rejected and the other way round, the same
    completion, nothing shared; right-padded, chosen rows then rejected, as collate_pairs gives them."""
    g = torch.Generator().manual_seed(1)

    def tokens(n):
        return [int(t) for t in torch.randint(3, 96, (n,), generator=g)]

    prompt, a, b = tokens(9), tokens(5), tokens(3)
    pairs = [(prompt + a, prompt + b), (prompt + a[:2], prompt + a), (prompt + a, prompt[:4]), (prompt + b, prompt + b),
             (tokens(4), tokens(7))]
    if ends_with is not None:  # rows ending in eos where eos is also the pad token: the reward is read before it
        pairs = [(c + [ends_with], r + [ends_with]) for c, r in pairs]
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


@pytest.mark.parametrize("kind,attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen3_moe", "sdpa"),
                                            ("mistral", "sdpa"), ("qwen2", "eager")])
def test_pairs_with_their_prefix_shared_give_the_rewards_and_gradients_of_their_own_rows(kind, attention):
    from peft import LoraConfig, get_peft_model

    from praisonai_accel.methods.reward_module import SharedPrefixRows
    from praisonai_accel.methods.reward_scoring import sequence_rewards

    for pad, eos in ((0, None), (2, 2)):
        model = get_peft_model(_random_classifier(kind, attention, pad), LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="SEQ_CLS"))
        with torch.no_grad():  # LoRA's B away from zero, so the adapter's gradients flow through the attention
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        module = RewardLoss(model, None)
        assert module.prefix_problem is None
        ids, mask = _pair_batch(pad, eos)
        shared = SharedPrefixRows(ids, mask, pad)
        assert shared.input_ids.numel() < ids.numel()  # fewer positions than the padded rows
        results = []
        for rewards_of in (lambda: sequence_rewards(model, ids, mask), lambda: module._shared_rewards(shared)):
            model.zero_grad()
            rewards = rewards_of()
            (rewards * torch.linspace(-1, 1, rewards.numel())).sum().backward()
            results.append((rewards.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.requires_grad}))
        (own, own_grads), (with_shared, shared_grads) = results
        assert torch.allclose(own, with_shared, atol=1e-5), (own, with_shared)
        assert own.std() > 1e-3  # rewards that differ between rows, so a misplaced reward would show
        assert max((own_grads[k] - shared_grads[k]).abs().max().item() for k in own_grads) <= 1e-5
        assert all(g.abs().sum() > 0 for g in shared_grads.values())


def test_shared_rows_lay_each_pair_out_once_and_rejected_never_sees_chosens_rest():
    from praisonai_accel.methods.reward_module import SharedPrefixRows

    ids = torch.tensor([[5, 6, 7, 8], [4, 3, 0, 0], [5, 6, 9, 0], [4, 3, 2, 0]])  # chosen rows, then rejected
    mask = (ids != 0).long()
    shared = SharedPrefixRows(ids, mask, 0)
    assert shared.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 0, 0]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]
    assert shared.reward_index.tolist() == [3, 5 + 1, 4, 5 + 2]  # chosen's last tokens, then rejected's
    sees = shared.sees[0, 0]
    assert sees[4].tolist() == [True, True, False, False, True]  # rejected's 9: the prefix and itself
    assert sees[3].tolist() == [True, True, True, True, False]  # chosen's 8: never what comes after it
    assert shared.sees[1, 0, 4].tolist() == [False, False, False, False, True]  # padding sees itself only


def test_prefix_sharing_is_named_off_where_it_could_not_give_the_same_rewards(caplog):
    import logging

    from praisonai_accel.methods.reward_module import settle_prefix_sharing, shared_prefix_problem

    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="NO"), device="cpu")

    def tokenizer(text, add_special_tokens):  # the probe's text as ids of the 96-token models here
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    import transformers as tf
    from peft import LoraConfig, get_peft_model

    small = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_labels=1, pad_token_id=0)
    assert shared_prefix_problem(tf.MistralForSequenceClassification(tf.MistralConfig(**small, sliding_window=16))) \
        == "its sliding window (16 tokens) is not applied to a mask given whole"
    # a window no row can reach (Phi-3-128k's: as long as the positions) applies nothing
    assert shared_prefix_problem(tf.MistralForSequenceClassification(tf.MistralConfig(
        **small, sliding_window=256, max_position_embeddings=256))) is None
    gemma = tf.Gemma3TextConfig(**small, head_dim=8, sliding_window=16, layer_types=["sliding_attention",
                                                                                       "full_attention"])
    assert shared_prefix_problem(tf.Gemma3TextForSequenceClassification(gemma)) == \
        "its sliding_attention layers do not take a mask given whole"
    # dropout would be drawn once for the shared tokens, once per row otherwise: the same gradients only without it
    assert shared_prefix_problem(tf.LlamaForSequenceClassification(tf.LlamaConfig(**small, attention_dropout=0.1))) \
        .startswith("attention_dropout 0.1 would be drawn once for a pair's shared tokens")
    lora = get_peft_model(_random_classifier("llama", "sdpa"), LoraConfig(r=4, target_modules=["q_proj"],
                                                                          lora_dropout=0.05, task_type="SEQ_CLS"))
    assert shared_prefix_problem(lora).startswith("dropout 0.05 (")
    model = _random_classifier("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    assert shared_prefix_problem(model) == "attention flash_attention_2 takes no 4D mask (only sdpa and eager do)"
    assert shared_prefix_problem(_random_classifier("llama", "sdpa", pad_token_id=None)) == \
        "the model has no pad token id"
    with caplog.at_level(logging.INFO, logger="praisonai_accel"):
        off = settle_prefix_sharing(RewardLoss(_random_classifier("llama", "sdpa"), None, False), accelerator,
                                    tokenizer)
    assert not off.prefix_sharing and "as rows of their own (prefix_sharing: false)" in caplog.text
    # a decoder that drops the position ids gives other rewards with the prefix shared: the probe turns it off
    model = _random_classifier("llama", "sdpa")
    forward = model.model.forward
    model.model.forward = lambda *a, position_ids=None, **k: forward(*a, **k)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="praisonai_accel"):
        probed = settle_prefix_sharing(RewardLoss(model, None), accelerator, tokenizer)
    assert not probed.prefix_sharing and "does not give a pair's rewards with its prefix shared" in caplog.text
    caplog.clear()
    classifier = _random_classifier("llama", "sdpa").eval()
    with caplog.at_level(logging.INFO, logger="praisonai_accel"):
        on = settle_prefix_sharing(RewardLoss(classifier, None), accelerator, tokenizer)
    assert on.prefix_sharing and "shared leading tokens computed once" in caplog.text
    assert not classifier.training  # the probe puts every module back as it found it
    # a batch whose pairs share nothing costs more as one longer row each: it goes through as padded rows
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert on.shared_rows(ids, torch.ones_like(ids)) is None
    ids, mask = _pair_batch(0)
    assert on.shared_rows(ids, mask) is not None
    # left padding is not the layout the rows are read in: such a batch goes through as it is
    assert on.shared_rows(ids.flip(1), mask.flip(1)) is None


def test_on_llamafactorys_real_pairs_each_rows_tokens_are_what_its_reward_token_sees(phi3_tokenizer):
    """LLaMA-Factory's 300 DPO demo pairs through Phi-3's chat template: in the shared rows, the token where each
    reward is read sees exactly its own row's tokens, in order, at positions 0..n-1; and the rows are shorter."""
    from pathlib import Path

    from praisonai_accel.methods.reward_module import SharedPrefixRows

    data = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "llamafactory" / "dpo_en_demo.json"
    if not data.is_file():
        pytest.skip("../shared/fixtures/llamafactory is absent")
    tokenizer = phi3_tokenizer
    config = _config(max_prompt_length=512, max_seq_length=1024)
    method = RewardMethod(config)
    examples = [method.encode(r, "sharegpt_paired", tokenizer, config) for r in json.loads(data.read_text())]
    pad = tokenizer.pad_token_id
    padded = shared_positions = 0
    for start in range(0, len(examples), 4):
        batch = method.collate(examples[start:start + 4], pad)
        shared = SharedPrefixRows(batch["input_ids"], batch["attention_mask"], pad)
        padded, shared_positions = padded + batch["input_ids"].numel(), shared_positions + shared.input_ids.numel()
        pairs = len(examples[start:start + 4])
        width = shared.input_ids.size(1)
        for k, row in enumerate([e["chosen_input_ids"] for e in examples[start:start + 4]]
                                + [e["rejected_input_ids"] for e in examples[start:start + 4]]):
            index = int(shared.reward_index[k])
            i, column = divmod(index, width)
            assert i == k % pairs
            seen = shared.sees[i, 0, column].nonzero().flatten()
            last = max(j for j, t in enumerate(row) if t != pad)  # the classifier's rule: the last non-pad token
            assert shared.input_ids[i, seen].tolist() == list(row[:last + 1])
            assert shared.position_ids[i, seen].tolist() == list(range(last + 1))
    assert shared_positions < 0.8 * padded  # each pair's conversation before the answers, once
