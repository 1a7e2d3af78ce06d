"""GRPO in process, without the recipe (the real processes are test_grpo_runs.py):

- sampling (methods/generation.py): the KV-cache loop draws exactly what a loop without a cache draws from the same
  generators; a group's draws do not depend on the rest of the batch; temperature -> 0 is argmax, top_p -> 0 too;
  completions stop at the stop token (padded after it) and at max_completion_length;
- data (methods/grpo_data.py): a conversational prompt is the chat template's rendering with the generation prompt,
  prompts are cut from the left, a row without a usable prompt is named;
- a rollout through the loss module: deterministic given seed and step, kl 0 at step 0 with beta > 0 (LoRA's
  reference is the adapter disabled), and the recipe's normalisation: one micro-batch of 2B prompts gives the loss and
  gradients of two of B (what 2 ranks x B = 1 rank x 2B rests on, given the same completions).
"""

from __future__ import annotations

import torch
import pytest

from praisonai_accel.methods.generation import completion_mask, sample_completions, sample_next

from grpo_reference import completions_of, model_forward, naive_sample


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    return model, tokenizer


def _prompts(tokenizer, texts, repeat):
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids.repeat_interleave(repeat, 0), enc.attention_mask.repeat_interleave(repeat, 0)


def _generators(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


SAMPLING = dict(max_new_tokens=16, temperature=1.0, top_p=0.95)


def test_the_kv_cache_loop_draws_what_a_loop_without_cache_draws(tiny):
    model, tokenizer = tiny
    ids, mask = _prompts(tokenizer, ["reverse the words ada bob", "hi", "eve fay gus hal ivy"], 4)
    common = dict(SAMPLING, stop_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id)
    cached = sample_completions(model_forward(model), ids, mask, generators=_generators(3), **common)
    naive = naive_sample(model, ids, mask, generators=_generators(3), **common)
    assert torch.equal(cached[0], naive[0]) and torch.equal(cached[1], naive[1])
    again = sample_completions(model_forward(model), ids, mask, generators=_generators(3), **common)
    assert torch.equal(cached[0], again[0])  # deterministic given the generators
    other = sample_completions(model_forward(model), ids, mask, generators=_generators(3, seed=7), **common)
    assert not torch.equal(cached[0], other[0])


def test_a_groups_draws_do_not_depend_on_the_rest_of_its_batch(tiny):
    model, tokenizer = tiny
    common = dict(SAMPLING, stop_ids=[-1], pad_id=tokenizer.pad_token_id)
    ids, mask = _prompts(tokenizer, ["ada bob cy", "a much longer prompt: eve fay gus hal ivy jo"], 4)
    both = sample_completions(model_forward(model), ids, mask, generators=_generators(2), **common)[0]
    ids, mask = _prompts(tokenizer, ["ada bob cy"], 4)
    alone = sample_completions(model_forward(model), ids, mask, generators=_generators(1), **common)[0]
    assert torch.equal(both[:4], alone)


def test_draws_follow_the_softmax_of_the_logits_at_the_temperature():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1e9, 0.5]]).repeat(100_000, 1)
    drawn = sample_next(logits, 0.7, 1.0, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(drawn, minlength=5) / drawn.numel()
    assert (frequencies - (logits[0] / 0.7).softmax(-1)).abs().max() < 0.005 and frequencies[3] == 0


def test_low_temperature_and_small_top_p_are_argmax():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    assert torch.equal(sample_next(logits, 1e-4, 1.0, torch.Generator().manual_seed(1)), argmax)
    assert torch.equal(sample_next(logits, 1.0, 1e-6, torch.Generator().manual_seed(1)), argmax)
    # top_p keeps the smallest set of tokens holding top_p of the mass: never one outside it
    probs = logits.softmax(-1)
    drawn = torch.stack([sample_next(logits, 1.0, 0.5, torch.Generator().manual_seed(s)) for s in range(20)])
    ordered, order = probs.sort(-1, descending=True)
    allowed = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (ordered.cumsum(-1) - ordered) <= 0.5)
    assert allowed.gather(-1, drawn.t()).all()


def test_completions_stop_at_the_stop_token_and_at_max_completion_length():
    vocab, stop, pad = 10, 7, 0

    def forward(input_ids, attention_mask, position_ids, past):  # row i says `stop` at its step i + 1
        step = 0 if past is None else past + 1
        logits = torch.full((input_ids.size(0), vocab), -1e9)
        for row in range(input_ids.size(0)):
            logits[row, stop if step == row + 1 else 3] = 0.0
        return logits, step

    ids, mask = torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)
    completions, keep, ended = sample_completions(forward, ids, mask, max_new_tokens=3, temperature=1.0, top_p=1.0,
                                                  stop_ids=[stop], pad_id=pad, generators=torch.Generator())
    assert completions.tolist() == [[3, stop, pad], [3, 3, stop], [3, 3, 3]]
    assert keep.tolist() == [[True, True, False], [True, True, True], [True, True, True]]
    assert ended.tolist() == [True, True, False]  # the last was cut at max_completion_length
    mask, ended = completion_mask(torch.tensor([[stop, stop, 1]]), torch.tensor([stop]))
    assert mask.tolist() == [[True, False, False]] and ended.tolist() == [True]


def test_the_loop_ends_when_every_row_has_stopped_unless_another_rank_has_not():
    calls = []

    def forward(input_ids, attention_mask, position_ids, past):
        calls.append(1)
        logits = torch.full((input_ids.size(0), 5), -1e9)
        logits[:, 4] = 0.0  # the stop token at once
        return logits, None

    ids = torch.ones(2, 1, dtype=torch.long)
    sample_completions(forward, ids, ids, max_new_tokens=8, temperature=1.0, top_p=1.0, stop_ids=[4], pad_id=0,
                       generators=torch.Generator())
    assert len(calls) == 1
    calls.clear()
    # FSDP2: another rank is still generating for 3 more tokens, so this one keeps running forwards with it
    others = iter([False, False, False, True])
    out = sample_completions(forward, ids, ids, max_new_tokens=8, temperature=1.0, top_p=1.0, stop_ids=[4], pad_id=0,
                             generators=torch.Generator(), all_done=lambda finished: finished and next(others))
    assert len(calls) == 4 and out[1].sum(-1).tolist() == [1, 1]


# ---------------------------------------------------------------- data and rollouts

def _grpo_config(tmp_path, model, **overrides):
    from praisonai_accel.config import parse_config

    raw = {"model_name": str(model), "dataset": [{"name": str(tmp_path / "data.jsonl")}],
           "output_dir": str(tmp_path / "out"), "method": "grpo", "reward_funcs": ["exact_match"],
           "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 8, "max_seq_length": 96,
           "max_prompt_length": 32, "finetune_type": "lora", "lora_dropout": 0.0, **overrides}
    return parse_config(raw)


ROWS = [{"prompt": [{"role": "user", "content": "reverse the words\n\nada bob"}], "answer": "bob ada"},
        {"prompt": "reverse: cy dee eve", "answer": "eve dee cy"},
        {"prompt": [{"role": "user", "content": "reverse the words\n\nfay gus"}], "answer": "gus fay"},
        {"prompt": [{"role": "user", "content": "reverse the words\n\nhal ivy jo"}], "answer": "jo ivy hal"}]


def test_prompts_are_rendered_with_the_generation_prompt_and_cut_from_the_left(tmp_path, tiny):
    from praisonai_accel.methods import method_for
    from praisonai_accel.methods.grpo_data import row_of

    _, tokenizer = tiny
    config = _grpo_config(tmp_path, "m", max_prompt_length=6)
    data = method_for(config).data(tokenizer)
    rendered = tokenizer.apply_chat_template(ROWS[0]["prompt"], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    encoded = data.encode(ROWS[0], "prompt", tokenizer, config, None)
    assert encoded["prompt_input_ids"] == ids[-6:] and encoded["truncated"]  # the end: the generation prompt stays
    assert row_of(encoded) == ROWS[0]  # every column reaches the reward functions
    assert data.encode(ROWS[1], "prompt", tokenizer, config, None)["prompt_input_ids"] == \
        tokenizer("reverse: cy dee eve", add_special_tokens=False)["input_ids"][-6:]
    assert data.check_row({"prompt": ""}, "prompt", None) == "'prompt' is empty"
    assert "not text or a list of messages" in data.check_row({"prompt": 3}, "prompt", None)
    with pytest.raises(Exception, match="no 'prompt'"):
        data.detect_format(["question", "answer"], None)


def _setup(tmp_path, model_dir, tokenizer, **overrides):
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from praisonai_accel.methods import method_for
    from praisonai_accel.methods.context import RunContext

    config = _grpo_config(tmp_path, model_dir, **overrides)
    method = method_for(config)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    accelerator = Accelerator(cpu=True)
    method.set_up(RunContext(accelerator, tokenizer, config.output_path()))
    collate = method.collator(tokenizer.pad_token_id)
    module = accelerator.prepare(method.loss_module(model, accelerator=accelerator, tokenizer=tokenizer,
                                                    use_cuda=False))
    data = method.data(tokenizer)
    examples = []
    for number, row in enumerate(ROWS):
        example = data.encode(row, "prompt", tokenizer, config, None)
        example["row_number"] = [0, 1, number + 1]  # what the preprocessing driver writes: line number + 1
        examples.append(example)
    return method, module, accelerator, collate, examples


def test_a_rollout_is_deterministic_given_seed_and_step_and_kl_is_0_at_step_0(tmp_path, tiny_model, tiny):
    _, tokenizer = tiny
    method, module, accelerator, collate, examples = _setup(tmp_path, tiny_model, tokenizer, beta=0.1)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in method.stop_ids  # the chat template's end of turn
    first = method.rollout(accelerator, module, [collate(examples[:2]), collate(examples[2:])], 0)
    again = method.rollout(accelerator, module, [collate(examples[:2]), collate(examples[2:])], 0)
    later = method.rollout(accelerator, module, [collate(examples[:2]), collate(examples[2:])], 1)
    assert [completions_of(b) for b in first] == [completions_of(b) for b in again]
    assert [completions_of(b) for b in first] != [completions_of(b) for b in later]
    batch = first[0]
    assert batch["completion_mask"].shape[1] <= 8 and batch["input_ids"].size(0) == 8
    loss, metrics = method.forward(module, batch)
    assert float(metrics["kl"]) == 0.0 and float(metrics["completion_tokens"]) == float(method.units(batch)) > 0
    assert method.examples_in(batch) == 2
    logged = method.reduce_metrics({k: float(v) for k, v in metrics.items()}, float(method.units(batch)))
    assert {"reward", "reward_std", "completions/mean_length", "clip_ratio", "kl", "rewards/exact_match/mean",
            "rewards/exact_match/std"} <= set(logged)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_one_micro_batch_of_2B_prompts_gives_the_loss_and_gradients_of_two_of_B(tmp_path, tiny_model, tiny, loss_type):
    _, tokenizer = tiny
    # a reward that varies within groups on the random model's text (exact_match would score 0 everywhere: every
    # advantage, loss and gradient 0, and nothing compared)
    method, module, accelerator, collate, examples = _setup(tmp_path, tiny_model, tokenizer, loss_type=loss_type,
                                                            beta=0.05, reward_funcs=["format"],
                                                            reward_format_pattern=r"^\s*[a-m]")
    whole = method.rollout(accelerator, module, [collate(examples)], 0)
    halves = method.rollout(accelerator, module, [collate(examples[:2]), collate(examples[2:])], 0)
    # the same completions: a group's draws do not depend on the rest of its batch
    assert [r["completion"] for h in halves for r in h["log_records"]] == \
        [r["completion"] for r in whole[0]["log_records"]]
    assert torch.equal(torch.cat([h["total_rewards"] for h in halves]), whole[0]["total_rewards"])
    assert whole[0]["advantages"].abs().max() > 0

    def gradients(group):
        module.zero_grad(set_to_none=True)
        units = sum(float(method.units(b)) for b in group)
        total = 0.0
        for batch in group:
            loss, _ = method.forward(module, batch)
            (loss / units).backward()
            total += float(loss.detach())
        return total / units, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    loss_whole, grads_whole = gradients(whole)
    loss_halves, grads_halves = gradients(halves)
    assert abs(loss_whole - loss_halves) <= 1e-6
    assert max(g.abs().max().item() for g in grads_whole.values()) > 0
    assert grads_whole and max((grads_whole[n] - grads_halves[n]).abs().max().item() for n in grads_whole) <= 1e-6


def test_completion_log_probs_through_the_chunked_head_are_the_full_logits_ones(tmp_path, tiny_model, tiny):
    _, tokenizer = tiny
    method, module, accelerator, collate, examples = _setup(tmp_path, tiny_model, tokenizer, temperature=0.7)
    batch = method.rollout(accelerator, module, [collate(examples)], 0)[0]
    inner = accelerator.unwrap_model(module)
    args = [batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels", "completion_mask")]
    chunked = inner.token_logps(inner.causal_lm, *args)
    inner.chunked = False
    full = inner.token_logps(inner.causal_lm, *args)
    logits = inner.causal_lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).logits[:, -batch["completion_mask"].size(1) - 1:-1]
    completions = batch["input_ids"][:, -batch["completion_mask"].size(1):]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, completions[..., None]).squeeze(-1)
    expected = expected * batch["completion_mask"]
    assert (chunked - expected).abs().max() <= 1e-5 and (full - expected).abs().max() <= 1e-5


def test_a_reward_function_that_raises_is_named_with_the_dataset_row(tmp_path, tiny_model, tiny):
    from praisonai_accel.methods.rewards import RewardError, _checked

    def picky(completions, answer, **kwargs):
        if "fay" in answer[0] or "gus fay" in answer:
            raise ValueError("no fay")
        return [0.0] * len(completions)

    _, tokenizer = tiny
    method, module, accelerator, collate, examples = _setup(tmp_path, tiny_model, tokenizer)
    method.reward_functions = [_checked("mine:picky", picky, 1.0, "reward_funcs[0]")]
    method.rollout(accelerator, module, [collate(examples[:2])], 0)
    with pytest.raises(RewardError, match=r"mine:picky failed on .*data\.jsonl line 3: ValueError: no fay"):
        method.rollout(accelerator, module, [collate(examples[2:])], 0)


def test_num_iterations_trains_on_one_rollout_with_the_generating_policys_log_probs(tmp_path, tiny_model, tiny):
    """num_iterations 2: step 1 gets step 0's completions and old log-probs (taken at generation, the policy as it
    was); after an optimizer step the ratio to them moves, and clip_ratio is no longer 0. Mid-way, the rollout is
    saved with the checkpoint (safetensors) and read back as it was."""
    from praisonai_accel.methods import method_for

    _, tokenizer = tiny
    method, module, accelerator, collate, examples = _setup(tmp_path, tiny_model, tokenizer, num_iterations=2,
                                                            beta=0.05, epsilon=0.01)
    from praisonai_accel.methods.rewards import _checked

    def length(completions, **kwargs):  # rewards that differ within a group: advantages that are not 0
        return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]

    method.reward_functions = [_checked("mine:length", length, 1.0, "reward_funcs[0]")]
    group = [collate(examples[:2]), collate(examples[2:])]
    first = method.rollout(accelerator, module, group, 0)
    inner = accelerator.unwrap_model(module)
    for batch in first:
        args = [batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels", "completion_mask")]
        with torch.no_grad():
            assert torch.equal(batch["old_logps"], inner.token_logps(inner.causal_lm, *args))
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
    for batch in first:
        loss, metrics = method.forward(module, batch)
        assert float(metrics["clip_ratio"]) == 0.0  # iteration 0: the ratio is 1
        (loss / float(method.units(batch))).backward()
    old = [b["old_logps"].clone() for b in first]
    optimizer.step()
    second = method.rollout(accelerator, module, group, 1)
    assert [completions_of(b) for b in second] == [completions_of(b) for b in first]
    assert all(torch.equal(b["old_logps"], o) for b, o in zip(second, old))
    assert sum(float(method.forward(module, b)[1]["clip_ratio"]) for b in second) > 0

    method.save_state(tmp_path, accelerator, 1)
    assert (tmp_path / "rollout_0.safetensors").is_file()
    resumed = method_for(method.config)
    resumed.set_up(method.run)
    resumed.load_state(tmp_path, accelerator, 1)
    again = resumed.rollout(accelerator, module, group, 1)
    for a, b in zip(again, first):
        assert {k for k in b if k != "rollout_sums"} <= set(a)
        assert all(torch.equal(a[k], b[k]) for k in b if isinstance(b[k], torch.Tensor))
        assert all(torch.equal(a["rollout_sums"][k], v) for k, v in b["rollout_sums"].items())
        assert a["prompts"] == b["prompts"] and completions_of(a) == completions_of(b)
    from praisonai_accel.methods.rollout import load_buffer, save_buffer

    save_buffer(tmp_path / "rollout_0.safetensors", *load_buffer(tmp_path / "rollout_0.safetensors", "cpu")[:2], 2)
    with pytest.raises(Exception, match="taken by 2 process.*resume it with 2 process.*not 1"):
        method_for(method.config).load_state(tmp_path, accelerator, 1)
    with pytest.raises(RuntimeError, match="step 3 trains on the rollout of step 2"):
        method.rollout(accelerator, module, group, 3)
    (tmp_path / "rollout_0.safetensors").unlink()
    with pytest.raises(Exception, match="holds no rollout for rank 0"):
        method_for(method.config).load_state(tmp_path, accelerator, 3)


def test_resuming_on_another_layout_skips_prompts_not_completions():
    from praisonai_accel.run_dir.checkpoints import CheckpointState, resume_skip

    # 3 steps of 2 processes x 8 completions (2 prompts of 4): 12 prompts of the epoch done
    state = CheckpointState(global_step=3, epoch=0, batches_in_epoch=3, samples_in_epoch=12, samples_seen=12,
                            world_size=2, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                            run_fingerprint="", config_fingerprint="")
    assert resume_skip(state, 2, 8, 2) == (3, None)
    skip, warning = resume_skip(state, 1, 16, 4)  # 1 process x 16 completions: 4 prompts a batch
    assert skip == 3 and "continuing at sample 12" in warning


def test_a_checkpoint_mid_way_through_num_iterations_resumes_only_on_its_layout(tmp_path, tiny_model):
    """Each process holds its own prompts' rollout: refused before launch (and by the worker) on another layout."""
    from praisonai_accel.checks import resume_rule
    from praisonai_accel.run_dir.checkpoints import MARKER, CheckpointState

    config = _grpo_config(tmp_path, tiny_model, num_iterations=2, resume_from_checkpoint=True)
    for step in (2, 3):
        state = CheckpointState(global_step=step, epoch=0, batches_in_epoch=2, samples_in_epoch=8, samples_seen=8,
                                world_size=2, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                run_fingerprint=config.run_fingerprint(), config_fingerprint="")
        directory = tmp_path / "out" / f"checkpoint-{step}"
        directory.mkdir(parents=True)
        state.write(directory)
        (directory / MARKER).write_text(str(step))
        if step == 2:  # on a batch's boundary: another layout continues at the same prompt
            assert resume_rule(config, 1)[:2] == (directory, 4)  # 8 prompts, 2 a batch
    assert resume_rule(config, 2)[:2] == (directory, 2)
    with pytest.raises(Exception, match="checkpoint-3 was taken mid-way .* num_iterations: 2 steps by 2 process"):
        resume_rule(config, 1)


def test_preview_shows_a_prompt_with_nothing_trained():
    from praisonai_accel.config import parse_config
    from praisonai_accel.commands._preview import example_parts

    config = parse_config({"model_name": "m", "dataset": "d.jsonl", "method": "grpo", "reward_funcs": ["exact_match"]})
    (title, ids, labels), = example_parts(config, {"prompt_input_ids": [5, 6, 7], "row": [123], "row_number": [0, 1, 1]})
    assert title.startswith("prompt") and ids == [5, 6, 7] and labels == [-100] * 3
