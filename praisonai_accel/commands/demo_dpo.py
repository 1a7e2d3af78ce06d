"""praisonai-accel demo --method dpo: the SFT demo's model learns, by DPO with LoRA, a preference it does not have.

The SFT demo teaches a tiny model to reverse 2 or 3 names, answering with spaces ("cy bob ada"). Here every pair
holds two valid answers, the names joined by commas (chosen) or by spaces (rejected), and the held-out preference
accuracy (chosen log-prob > rejected) is shown before and after.
"""

from __future__ import annotations

from pathlib import Path

import typer

TRAIN_PAIRS, HELD_OUT_PAIRS, STEPS = 512, 100, 30


def dpo_demo(directory: Path, processes: int, steps: int | None, train_sft) -> None:
    from ..demo import demo_config, preference_records, task_records, write_jsonl
    from ._demo import launch_demo, sft_demo_model

    sft_model = sft_demo_model(directory, train_sft)
    train = task_records(TRAIN_PAIRS, seed=2)
    held_out = task_records(HELD_OUT_PAIRS, seed=3, exclude={r["input"] for r in train})
    data = write_jsonl(preference_records(train), directory / "dpo_data.jsonl")
    held_out_pairs = preference_records(held_out)
    output = (directory / "dpo_outputs").resolve()
    raw = demo_config(sft_model, data.resolve(), output, method="dpo", beta=0.1, max_steps=steps or STEPS,
                      dataset=[{"name": str(data.resolve())}], finetune_type="lora", lora_r=16, lora_alpha=32,
                      max_seq_length=64, per_device_train_batch_size=8, learning_rate=5e-3, warmup_steps=2,
                      logging_steps=10, overwrite_output_dir=True)
    before = _accuracy(sft_model, held_out_pairs)
    summary = launch_demo(directory / "dpo_config.yaml", raw, processes, output)
    after = _accuracy(Path(summary["final_model_dir"]), held_out_pairs)
    pair = held_out_pairs[0]
    typer.echo(f"{pair['prompt'][0]['content']!r}\n  chosen:   {pair['chosen'][0]['content']}\n"
               f"  rejected: {pair['rejected'][0]['content']}")
    typer.echo(f"held-out preference accuracy (chosen log-prob > rejected) on {len(held_out_pairs)} pairs: "
               f"{before:.0%} before, {after:.0%} after {summary['global_step']} DPO steps on "
               f"{summary['num_processes']} processes; adapter in {summary['final_model_dir']}")


def _accuracy(model_dir: Path, pairs: list[dict]) -> float:
    from transformers.utils import logging as hf_logging

    from ..demo import preference_accuracy
    from ..inference import load_for_inference

    hf_logging.disable_progress_bar()
    model, tokenizer = load_for_inference(model_dir, device="cpu")
    return preference_accuracy(model, tokenizer, pairs)
