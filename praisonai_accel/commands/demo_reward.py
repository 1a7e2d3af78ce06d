"""praisonai-accel demo --method reward: a reward model learns, from preference pairs, which of two answers is right.

The pairs hold the same names in the same format: reversed (chosen, the task's answer) or left in the prompt's order
(rejected), so only a model that reads the prompt can rank them, and a fresh head ranks about half. The reward model
is the SFT demo's model with a one-label score head, trained with LoRA (the head in full). Held-out pairwise accuracy
(reward of chosen > reward of rejected) is shown before (a fresh head) and after.
"""

from __future__ import annotations

from pathlib import Path

import typer

TRAIN_PAIRS, HELD_OUT_PAIRS, STEPS, SEED = 512, 100, 80, 3407


def reward_demo_config(base_model: Path, data: Path, output: Path, steps: int | None = None) -> dict:
    """The demo's reward-model run (bench/reward.py trains TRL's RewardTrainer with the same settings)."""
    from ..demo.text import demo_config

    return demo_config(base_model, data.resolve(), output, method="reward", max_steps=steps or STEPS,
                       dataset=[{"name": str(data.resolve())}], finetune_type="lora", lora_r=16, lora_alpha=32,
                       max_seq_length=64, per_device_train_batch_size=8, learning_rate=5e-3, warmup_steps=2,
                       logging_steps=10, seed=SEED, overwrite_output_dir=True)


def reward_demo(directory: Path, processes: int, steps: int | None, train_sft) -> None:
    from ..demo.text import order_records, task_records, write_jsonl
    from ._demo import launch_demo, sft_demo_model

    base = sft_demo_model(directory, train_sft)
    train = task_records(TRAIN_PAIRS, seed=2)
    held_out = order_records(task_records(HELD_OUT_PAIRS, seed=3, exclude={r["input"] for r in train}))
    data = write_jsonl(order_records(train), directory / "reward_data.jsonl")
    output = (directory / "reward_outputs").resolve()
    raw = reward_demo_config(base, data, output, steps)
    before = held_out_accuracy(base, held_out)
    summary = launch_demo(directory / "reward_config.yaml", raw, processes, output)
    after = held_out_accuracy(Path(summary["final_model_dir"]), held_out)
    pair = held_out[0]
    typer.echo(f"{pair['prompt'][0]['content']!r}\n  chosen:   {pair['chosen'][0]['content']}\n"
               f"  rejected: {pair['rejected'][0]['content']}")
    typer.echo(f"held-out reward accuracy (reward of chosen > rejected) on {len(held_out)} pairs: {before:.0%} "
               f"before (a fresh head), {after:.0%} after {summary['global_step']} steps on "
               f"{summary['num_processes']} processes; reward model in {summary['final_model_dir']} "
               f"(praisonai-accel score {summary['final_model_dir']} --prompt ... --completion ...)")


def held_out_accuracy(model_dir: Path, pairs: list[dict]) -> float:
    """Pairwise accuracy of a reward model (or of a causal LM given a fresh head, seeded) on TRL-format pairs."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..methods.reward import reward_model_problem
    from ..methods.reward_scoring import load_scorer, score_texts

    hf_logging.disable_progress_bar()
    if reward_model_problem(model_dir) is None:
        model, tokenizer = load_scorer(model_dir)
    else:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the new head is expected
        torch.manual_seed(SEED)
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1).eval()
        hf_logging.set_verbosity(verbosity)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model.config.pad_token_id = tokenizer.pad_token_id
    texts = [(p["prompt"], side) for p in pairs for side in (p["chosen"], p["rejected"])]
    rewards = score_texts(model, tokenizer, texts)
    return sum(c > r for c, r in zip(rewards[0::2], rewards[1::2])) / max(len(pairs), 1)
