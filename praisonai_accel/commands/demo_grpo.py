"""praisonai-accel demo --method grpo: the SFT demo's model learns, from a reward alone, what it cannot do yet.

The SFT demo teaches a tiny model to reverse 2 or 3 names. Asked to reverse FOUR, it answers with three (0% exact
match). Here GRPO samples 8 answers per prompt and rewards each by how many names it puts in the right place
(`reversal_reward`, below: the reward function the run's config names, as a user's would be); nothing shows it a
right answer. The held-out exact match on four names is shown before and after.
"""

from __future__ import annotations

import random
from pathlib import Path

import typer

TRAIN_PROMPTS, HELD_OUT_PROMPTS, STEPS, NAMES_PER_PROMPT, LOGGING_STEPS = 512, 100, 150, 4, 10


def reversal_reward(completions, answer, **kwargs) -> list[float]:
    """Names in the right place, over the longer of the answer and the completion: 1.0 for the exact reversal."""
    out = []
    for completion, expected in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        words, wanted = text.split(), expected.split()
        out.append(sum(w == x for w, x in zip(words, wanted)) / max(len(words), len(wanted)))
    return out


def four_name_records(count: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    from ..demo.text import _NAMES

    rng, records, seen = random.Random(seed), [], set(exclude)
    while len(records) < count:
        words = [rng.choice(_NAMES) for _ in range(NAMES_PER_PROMPT)]
        text = " ".join(words)
        if text not in seen:
            seen.add(text)
            records.append({"instruction": "reverse the words", "input": text, "output": " ".join(reversed(words))})
    return records


def grpo_demo(directory: Path, processes: int, steps: int | None, train_sft) -> None:
    from ..demo.text import demo_config, demo_prompt, write_jsonl
    from ._demo import launch_demo, sft_demo_model, text_answers

    sft_model = sft_demo_model(directory, train_sft)
    train = four_name_records(TRAIN_PROMPTS, seed=4)
    held_out = four_name_records(HELD_OUT_PROMPTS, seed=5, exclude={r["input"] for r in train})
    data = write_jsonl([{"prompt": demo_prompt(r), "answer": r["output"]} for r in train],
                       directory / "grpo_data.jsonl")
    output = (directory / "grpo_outputs").resolve()
    # The tiny model is fully fine-tuned, as in the SFT demo (LoRA on its few random weights learns slowly).
    raw = demo_config(sft_model, data.resolve(), output, method="grpo", dataset=[{"name": str(data.resolve())}],
                      reward_funcs=["praisonai_accel.commands.demo_grpo:reversal_reward"], num_generations=8,
                      per_device_train_batch_size=32, max_completion_length=10, max_prompt_length=48,
                      max_seq_length=64, finetune_type="full", final_model_dir="model", learning_rate=1e-3,
                      warmup_steps=2, max_steps=steps or STEPS, logging_steps=LOGGING_STEPS, save_strategy="no",
                      overwrite_output_dir=True, num_completions_to_print=2)
    before = text_answers(sft_model, held_out)
    summary = launch_demo(directory / "grpo_config.yaml", raw, processes, output)
    after = text_answers(Path(summary["final_model_dir"]), held_out)
    _report(held_out, before, after, summary, output)


def _report(held_out, before, after, summary, output: Path) -> None:
    from ..demo.text import exact_match
    from ..run_dir.metrics import read_metrics

    from .demo import show_examples

    show_examples(held_out, before, after)
    rewards = [m["reward"] for m in read_metrics(output / "metrics.jsonl") if "reward" in m]
    if rewards:
        typer.echo(f"reward (names in place, of sampled answers): {rewards[0]:.2f} over the first {LOGGING_STEPS} "
                   f"steps, {rewards[-1]:.2f} over the last; samples in {output / 'logs' / 'completions.jsonl'}")
    typer.echo(f"exact-match accuracy on {len(held_out)} held-out four-name prompts: "
               f"{exact_match(before, held_out):.0%} before, {exact_match(after, held_out):.0%} after {summary['global_step']} GRPO steps on "
               f"{summary['num_processes']} processes; model in {summary['final_model_dir']}")
