"""praisonai-accel demo --method dpo: the SFT demo's model learns, by DPO with LoRA, a preference it does not have,
and still answers.

The SFT demo teaches a tiny model to reverse 2 or 3 names. Asked to reverse FOUR, it stops after three ("bob ada
jo" for "gus jo ada bob"). Each pair holds a prompt, the whole reversal (chosen) and the same answer stopped a name
early (rejected: what the model says to four names); half the prompts have four names, half the 2 or 3 it knows, so
the preference is for whole answers and not against the answers it already gives. Shown before and after, all held
out: the preference accuracy on four-name pairs (chosen log-prob > rejected, end of turn included) and the
generation accuracy (greedy answers, exact match) on four names and on the SFT task's own 2 or 3, so a preference
won by breaking the model shows.
"""

from __future__ import annotations

import random
from pathlib import Path

import typer

TRAIN_PAIRS, HELD_OUT_PAIRS, STEPS, SHOWN = 512, 100, 30, 3

# LoRA at this learning rate raises the chosen answers' log-probabilities while the model keeps answering. The SFT
# task's generation accuracy fell from 97% to 91% at 3e-4 (2 processes), from 98% to 57% at 1e-3 (1 process; with
# only four-name pairs, to 26%); at 5e-3, this demo's earlier setting, preference accuracy reached 100% on training
# pairs by pushing the rejected answers' log-probabilities down without limit, and the adapter generated garbage.
# The generation accuracy shown is the check.
DPO_SETTINGS = dict(method="dpo", beta=0.1, finetune_type="lora", lora_r=16, lora_alpha=32, max_seq_length=64,
                    per_device_train_batch_size=8, learning_rate=2e-4, warmup_steps=2, logging_steps=10)


def preference_pairs(records: list[dict]) -> list[dict]:
    """TRL's conversational prompt / chosen / rejected: the whole reversal over the one that stops a name early."""
    from ..demo.text import demo_prompt

    return [{"prompt": demo_prompt(r), "chosen": [{"role": "assistant", "content": r["output"]}],
             "rejected": [{"role": "assistant", "content": " ".join(r["output"].split()[:-1])}]} for r in records]


def dpo_demo(directory: Path, processes: int, steps: int | None, train_sft) -> None:
    from ..demo.text import demo_config, task_records, write_jsonl
    from ._demo import launch_demo, sft_demo_model, text_answers
    from .demo import HELD_OUT_ROWS, TRAIN_ROWS
    from .demo_grpo import four_name_records

    sft_model = sft_demo_model(directory, train_sft)
    train = four_name_records(TRAIN_PAIRS // 2, seed=6)
    held_out = four_name_records(HELD_OUT_PAIRS, seed=7, exclude={r["input"] for r in train})
    sft_train = task_records(TRAIN_ROWS, seed=0)  # the SFT demo's held-out prompts: the task it must keep
    sft_held_out = task_records(HELD_OUT_ROWS, seed=1, exclude={r["input"] for r in sft_train})
    known = task_records(TRAIN_PAIRS // 2, seed=2, exclude={r["input"] for r in sft_held_out})
    mixed = preference_pairs(train) + preference_pairs(known)
    random.Random(0).shuffle(mixed)
    data = write_jsonl(mixed, directory / "dpo_data.jsonl")
    pairs = preference_pairs(held_out)
    output = (directory / "dpo_outputs").resolve()
    raw = demo_config(sft_model, data.resolve(), output, **DPO_SETTINGS, max_steps=steps or STEPS,
                      dataset=[{"name": str(data.resolve())}], overwrite_output_dir=True)
    before = (_accuracy(sft_model, pairs), text_answers(sft_model, held_out), text_answers(sft_model, sft_held_out))
    summary = launch_demo(directory / "dpo_config.yaml", raw, processes, output)
    adapter = Path(summary["final_model_dir"])
    after = (_accuracy(adapter, pairs), text_answers(adapter, held_out), text_answers(adapter, sft_held_out))
    _report(held_out, pairs, sft_held_out, before, after, summary)


def _report(held_out, pairs, sft_held_out, before, after, summary) -> None:
    from ..demo.text import examples_to_show, exact_match, shown_prompt

    for i in examples_to_show(after[1], [r["output"] for r in held_out], SHOWN):
        verdict = "right" if after[1][i] == held_out[i]["output"] else "wrong"
        typer.echo(f"prompt: {shown_prompt(held_out[i])}\n  chosen:   {pairs[i]['chosen'][0]['content']}\n"
                   f"  rejected: {pairs[i]['rejected'][0]['content']}\n  before:   {before[1][i] or '(nothing)'}\n"
                   f"  after:    {after[1][i] or '(nothing)'}   ({verdict})")
    typer.echo(f"held-out preference accuracy (chosen log-prob > rejected) on {len(pairs)} pairs: "
               f"{before[0]:.0%} before, {after[0]:.0%} after {summary['global_step']} DPO steps on "
               f"{summary['num_processes']} processes")
    typer.echo(f"held-out generation accuracy (greedy, exact match): four names {exact_match(before[1], held_out):.0%} "
               f"before, {exact_match(after[1], held_out):.0%} after; the SFT task's 2 or 3 names "
               f"{exact_match(before[2], sft_held_out):.0%} before, {exact_match(after[2], sft_held_out):.0%} after; "
               f"adapter in {summary['final_model_dir']}")


def _accuracy(model_dir: Path, pairs: list[dict]) -> float:
    from transformers.utils import logging as hf_logging

    from ..demo.text import preference_accuracy
    from ..models.inference import load_for_inference

    hf_logging.disable_progress_bar()
    model, tokenizer = load_for_inference(model_dir, device="cpu")
    return preference_accuracy(model, tokenizer, pairs)
