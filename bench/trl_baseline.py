"""The baseline a user would write instead: TRL's SFTTrainer + a peft LoRA, launched with accelerate.

    accelerate launch bench/trl_baseline.py --model DIR --data FILE.jsonl --out DIR --steps N ...

Writes <out>/bench_steps.rank<N>.jsonl: one line per optimizer step (rank 0: wall time; every rank: the examples,
real and padded tokens, target tokens and model FLOPs of the batches it was handed, FLOPs counted by
praisonai_accel/flops.py exactly as for praisonai-accel), plus checkpoint save times. --steps 0 trains one epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def alpaca_to_prompt_completion(row: dict) -> dict:
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return {"prompt": [{"role": "user", "content": prompt}], "completion": [{"role": "assistant", "content": row["output"]}]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps; 0: one epoch over the data")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="bf16 on the GPU instead of fp32 on CPU processes")
    args = parser.parse_args()

    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from praisonai_accel.data import batch_targets
    from praisonai_accel.worker.flops import attended_keys, flop_counts

    rank = int(os.environ.get("RANK", 0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"bench_steps.rank{rank}.jsonl"
    log = open(log_path, "a")

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    train = datasets.Dataset.from_list([alpaca_to_prompt_completion(r) for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)

    class StepTimes(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_kw):
            log.write(json.dumps({"step": state.global_step, "time": time.time()}) + "\n")
            log.flush()

        def on_save(self, _args, state, _control, **_kw):
            log.write(json.dumps({"saved": state.global_step, "time": time.time()}) + "\n")
            log.flush()

    config = SFTConfig(
        output_dir=str(out),
        max_steps=args.steps if args.steps > 0 else -1,
        num_train_epochs=1,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        max_length=args.max_length,
        use_cpu=not args.gpu,
        bf16=args.gpu,
        seed=42,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_r * 2, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[StepTimes()])

    collate = trainer.data_collator
    counts = flop_counts(trainer.model)

    def counting_collator(features):
        batch = collate(features)
        mask = batch["attention_mask"] if "attention_mask" in batch else (batch["input_ids"] != tokenizer.pad_token_id)
        tokens, targets = int(mask.sum()), batch_targets(batch)
        attended = int(attended_keys(mask, batch.get("position_ids")))
        log.write(json.dumps({"tokens": tokens, "positions": int(mask.numel()), "examples": len(features),
                              "targets": targets, "model_flops": counts.step(tokens, attended, targets),
                              "time": time.time()}) + "\n")
        return batch

    trainer.data_collator = counting_collator
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    import torch

    if torch.cuda.is_available():
        log.write(json.dumps({"peak_gpu_memory_mib": torch.cuda.max_memory_allocated() / 2**20, "time": time.time()}) + "\n")
    log.close()
    import torch.distributed as dist

    if dist.is_initialized():  # without this a rank can abort at interpreter exit
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
