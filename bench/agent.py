"""GRPO with tools, ours against TRL's GRPOTrainer(tools=[...]) in one run: trajectories per second of training and
held-out success after the same training.

    python bench/agent.py --work DIR [--steps 60 --prompts 4 --generations 8 --completion 80 --lr 1e-3]

Both sides start from the same tiny model taught the shape of a tool call (praisonai_accel.demo.agent, as the agent
demo), train it fully (fp32, CPU, one process, no gradient checkpointing) on the same "add A and B" prompts in the
same order is not guaranteed (each side's sampler), with the same tool (`add`), reward (`answer_reward`),
num_generations, per-device batch (prompts x generations), max_completion_length, max_tool_calling_iterations 2,
temperature 1, beta 0, loss_type dapo, AdamW at the same learning rate with 2 warmup steps then linear decay.
Trajectories per second: the trajectories trained on over the training's own runtime (TRL: train_runtime; ours:
train_summary.json's train_seconds), the rollouts with their tool calls included. Held-out success: the same greedy
evaluation (praisonai_accel.demo.agent.success_rate) of both final models on 100 prompts neither trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_ours(args, model: Path, data: Path, out: Path) -> dict:
    import yaml

    from praisonai_accel.demo.text import demo_config

    raw = demo_config(model, data, out, method="grpo", dataset=[{"name": str(data)}],
                      tools=["praisonai_accel.demo.agent:add"], max_tool_calling_iterations=2,
                      reward_funcs=["praisonai_accel.demo.agent:answer_reward"], num_generations=args.generations,
                      per_device_train_batch_size=args.prompts * args.generations,
                      max_completion_length=args.completion, max_prompt_length=64, max_seq_length=64 + args.completion,
                      finetune_type="full", final_model_dir="model", learning_rate=args.lr, warmup_steps=2,
                      max_steps=args.steps, logging_steps=5, save_strategy="no", overwrite_output_dir=True,
                      plot_loss=False, use_gradient_checkpointing=False, seed=args.seed)
    config = out.parent / "ours.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    subprocess.run([sys.executable, "-m", "praisonai_accel", "train", str(config), "--cpu"], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    summary = json.loads((out / "train_summary.json").read_text())
    return {"train_runtime": summary["train_seconds"], "final_model": summary["final_model_dir"]}


def run_trl(args, model: Path, data: Path, out: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from praisonai_accel.demo.agent import add, answer_reward

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    config = GRPOConfig(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.prompts * args.generations,
                        num_generations=args.generations, max_completion_length=args.completion,
                        max_tool_calling_iterations=2, learning_rate=args.lr, warmup_steps=2, logging_steps=5,
                        save_strategy="no", report_to="none", use_cpu=True, seed=args.seed, dataloader_num_workers=0,
                        disable_tqdm=True, temperature=1.0, top_p=1.0, beta=0.0, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                          reward_funcs=[answer_reward], args=config, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=tokenizer, tools=[add])
    result = trainer.train()
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(out / "model")
    return {"train_runtime": result.metrics["train_runtime"], "final_model": str(out / "model"),
            "rewards": [e.get("reward") for e in trainer.state.log_history if "reward" in e]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=80, help="max_completion_length")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (sampling, data order)")
    parser.add_argument("--child", choices=["trl"])
    args = parser.parse_args()
    from praisonai_accel.demo.agent import add_records, make_tool_model, success_rate

    work = Path(args.work).resolve()
    model, data = work / "tool-model", work / "prompts.jsonl"
    if args.child:
        result = run_trl(args, model, data, work / "trl")
        (work / "agent-trl.json").write_text(json.dumps(result))
        return
    work.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        make_tool_model(model)
    data.write_text("".join(json.dumps(r) + "\n" for r in add_records(512, seed=2)))
    held_out = add_records(100, seed=3)
    results = {"ours": run_ours(args, model, data, work / "ours")}
    subprocess.run([sys.executable, __file__, "--child", "trl", "--work", str(work)] + [
        f"--{k}={v}" for k, v in (("steps", args.steps), ("prompts", args.prompts), ("generations", args.generations),
                                  ("completion", args.completion), ("lr", args.lr),
                                  ("seed", args.seed))],
        check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                         "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(REPO)})
    results["trl"] = json.loads((work / "agent-trl.json").read_text())
    trajectories = args.steps * args.prompts * args.generations
    base, _ = success_rate(model, held_out)
    for side in results.values():
        side["trajectories_per_second"] = trajectories / side["train_runtime"]
        side["held_out_success"], _ = success_rate(Path(side["final_model"]), held_out)
    summary = {
        "device": "cpu (fp32), one process each", "steps": args.steps, "seed": args.seed, "trajectories": trajectories,
        "base_held_out_success": base,
        "trajectories_per_second_ratio": results["ours"]["trajectories_per_second"] / results["trl"]["trajectories_per_second"],
        "held_out_success_difference": results["ours"]["held_out_success"] - results["trl"]["held_out_success"],
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), **results}
    (work / f"agent-seed{args.seed}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("ours", "trl")}, indent=2))
    for name, side in results.items():
        print(f"{name}: {side['trajectories_per_second']:.1f} trajectories/s, held-out success "
              f"{side['held_out_success']:.0%}")


if __name__ == "__main__":
    main()
