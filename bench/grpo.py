"""GRPO at a realistic shape, ours against TRL's GRPOTrainer (no vLLM), in one run: rollout tokens per second and
step time as ratios.

    python bench/grpo.py --work DIR [--prompts 2 --generations 8 --steps 6 --completion 64 --prompt-length 96
                                     --vocab 128256 --layers 4]

The model is bench/run.py's realistic one (the tiny Llama's layers at hidden 512, a 128k-token vocabulary, random
weights: completions run to --completion tokens, so both sides generate the same number); prompts are conversational,
about --prompt-length tokens; both sides train a LoRA r16 on every linear layer (no dropout) with AdamW at the same
learning rate, loss_type dapo, beta 0 (TRL's defaults), temperature 1, top_p 1, --generations completions per
prompt and --prompts prompts per step (per_device_train_batch_size = prompts x generations, accumulation 1), the
same reward function (`names_reward`, below), fp32 on CPU, gradient checkpointing on (TRL's GRPO default), each in a
fresh process. Rollout tokens/s: completion tokens over the time spent generating them (TRL: its `_generate`; ours:
the sampling loop), medians over the steps after the first; step time: the median whole optimizer step (TRL: its
training step, generation and scoring included; ours: rollout + forward/backward + AdamW).

What "ours" is, honestly: praisonai_accel.methods' GRPO (encode, collate, rollout, forward through the prepared
GRPOLoss) driven by a plain loop over one process's Accelerator: no checkpoints, no metrics file. The recipe drives
the same method and module (and adds those).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def names_reward(completions, **kwargs) -> list[float]:
    """The reward both sides use: how many of the demo's names a completion says, over its words."""
    from praisonai_accel.demo.text import _NAMES

    out = []
    for completion in completions:
        words = (completion[0]["content"] if isinstance(completion, list) else completion).split()
        out.append(sum(w in _NAMES for w in words) / max(len(words), 1))
    return out


def make_prompts(tokenizer_dir: Path, count: int, length: int, seed: int = 4) -> list[dict]:
    from transformers import AutoTokenizer

    from praisonai_accel.demo.text import _NAMES

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        text = "repeat the names:"
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < length - 12:
            text += " " + rng.choice(_NAMES)
        rows.append({"prompt": [{"role": "user", "content": text}]})
    return rows


def _median(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def run_ours(args) -> dict:
    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from praisonai_accel.config import parse_config
    from praisonai_accel.data import ensure_chat_template
    from praisonai_accel.methods import method_for, rollout
    from praisonai_accel.methods.context import RunContext
    from praisonai_accel.methods.rewards import _checked

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ensure_chat_template(tokenizer)
    config = parse_config({
        "model_name": args.model, "dataset": [{"name": args.data}], "output_dir": str(Path(args.out) / "ours"),
        "method": "grpo", "reward_funcs": ["grpo:names_reward"], "num_generations": args.generations,
        "per_device_train_batch_size": args.prompts * args.generations, "max_completion_length": args.completion,
        "max_prompt_length": args.prompt_length + 32, "max_seq_length": args.prompt_length + 32 + args.completion,
        "learning_rate": args.lr, "lora_dropout": 0.0})
    method = method_for(config)
    method.reward_functions = [_checked("grpo:names_reward", names_reward, 1.0, "reward_funcs[0]")]
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    data = method.data(tokenizer)
    examples = []
    for number, row in enumerate(rows):
        example = data.encode(row, "prompt", tokenizer, config, None)
        example["row_number"] = [0, 1, number + 1]
        examples.append(example)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             task_type="CAUSAL_LM"))
    accelerator = Accelerator(cpu=not args.gpu, mixed_precision="bf16" if args.gpu else "no")
    collate = method.collator(tokenizer.pad_token_id)
    method.set_up(RunContext(accelerator, tokenizer, config.output_path()))
    module = method.loss_module(model, accelerator=accelerator, tokenizer=tokenizer, use_cuda=args.gpu)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr)
    module, optimizer = accelerator.prepare(module, optimizer)
    module.train()
    generation = {"seconds": 0.0}
    sample = rollout.sample_completions

    def timed(*a, **k):  # the sampling loop alone, as TRL's _generate
        _sync(args.gpu)
        started = time.perf_counter()
        out = sample(*a, **k)
        _sync(args.gpu)
        generation["seconds"] += time.perf_counter() - started
        return out

    rollout.sample_completions = timed
    steps, rollouts, tokens, losses = [], [], [], []
    for step in range(args.steps):
        chunk = [examples[(step * args.prompts + i) % len(examples)] for i in range(args.prompts)]
        _sync(args.gpu)
        started = time.perf_counter()
        generation["seconds"] = 0.0
        batch = {k: v.to(accelerator.device) if hasattr(v, "to") else v for k, v in collate(chunk).items()}
        scored = method.rollout(accelerator, module, [batch], step)[0]
        loss, _ = method.forward(module, scored)
        accelerator.backward(loss / scored["units"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(args.gpu)
        steps.append(time.perf_counter() - started)
        rollouts.append(generation["seconds"])
        tokens.append(int(scored["completion_mask"].sum()))
        losses.append(float(loss.detach() / scored["units"]))
    return {"step_seconds": steps, "generate_seconds": rollouts, "completion_tokens": tokens, "losses": losses}


def run_trl(args) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from praisonai_accel.data import ensure_chat_template

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ensure_chat_template(tokenizer)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    steps, marks, rollouts, tokens = [], {}, [], []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, _args, state, _control, **_kw):
            _sync(args.gpu)
            marks["start"] = time.perf_counter()

        def on_step_end(self, _args, state, _control, **_kw):
            _sync(args.gpu)
            steps.append(time.perf_counter() - marks["start"])

    config = GRPOConfig(output_dir=str(Path(args.out) / "trl"), max_steps=args.steps,
                        per_device_train_batch_size=args.prompts * args.generations, num_generations=args.generations,
                        max_completion_length=args.completion, learning_rate=args.lr, lr_scheduler_type="constant",
                        logging_steps=1, save_strategy="no", report_to="none", use_cpu=not args.gpu, bf16=args.gpu,
                        seed=0, dataloader_num_workers=0, disable_tqdm=True, temperature=1.0, top_p=1.0)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[names_reward], args=config,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                          peft_config=peft_config, callbacks=[StepTimes()])
    generate = trainer._generate

    def timed(prompts):  # TRL's generation (prompts tokenized, model.generate, decoded), not its scoring
        _sync(args.gpu)
        started = time.perf_counter()
        out = generate(prompts)
        _sync(args.gpu)
        rollouts.append(time.perf_counter() - started)
        tokens.append(sum(len(ids) for ids in out[1]))
        return out

    trainer._generate = timed
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"step_seconds": steps, "generate_seconds": rollouts, "completion_tokens": tokens, "losses": losses,
            "gradient_checkpointing": config.gradient_checkpointing}


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--completion", type=int, default=64, help="max_completion_length")
    parser.add_argument("--prompt-length", type=int, default=96)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, bf16 autocast on both sides")
    parser.add_argument("--child", choices=["ours", "trl"])
    parser.add_argument("--model")
    parser.add_argument("--data")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        result = run_ours(args) if args.child == "ours" else run_trl(args)
        Path(args.out, f"grpo-{args.child}.json").write_text(json.dumps(result))
        return

    sys.path.insert(0, str(REPO / "bench"))
    from run import make_realistic_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{args.vocab}-{args.layers}"
    if not (model / "config.json").exists():
        make_realistic_model(model, vocab=args.vocab, layers=args.layers)
    data = work / f"grpo-prompts-{args.prompt_length}.jsonl"
    rows = make_prompts(model, args.prompts * args.steps, args.prompt_length)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}:{REPO / 'bench'}"}
    if not args.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    results = {}
    for name in ("ours", "trl"):
        command = [sys.executable, __file__, "--child", name, "--model", str(model), "--data", str(data), "--out",
                   str(work), "--work", str(work)] + [f"--{k}={v}" for k, v in (
                       ("prompts", args.prompts), ("generations", args.generations), ("steps", args.steps),
                       ("completion", args.completion), ("prompt-length", args.prompt_length), ("lr", args.lr))]
        subprocess.run(command + (["--gpu"] if args.gpu else []), check=True, env={**os.environ, **env})
        r = results[name] = json.loads((work / f"grpo-{name}.json").read_text())
        r["median_step_seconds"] = _median(r["step_seconds"])
        rates = [t / s for t, s in zip(r["completion_tokens"], r["generate_seconds"])]
        r["rollout_tokens_per_second"] = _median(rates)
    ours, trl = results["ours"], results["trl"]
    summary = {
        "device": "gpu (bf16 autocast)" if args.gpu else "cpu (fp32)",
        "shape": {"vocab": args.vocab, "hidden": 512, "layers": args.layers, "prompt_tokens": args.prompt_length,
                  "max_completion_length": args.completion, "prompts_per_step": args.prompts,
                  "num_generations": args.generations, "steps": args.steps, "lora_r": 16,
                  "gradient_checkpointing": True},
        "rollout_tokens_per_second_ratio": ours["rollout_tokens_per_second"] / trl["rollout_tokens_per_second"],
        "step_time_ratio": ours["median_step_seconds"] / trl["median_step_seconds"],
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "ours": ours, "trl": trl,
    }
    (work / "grpo_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("shape", "rollout_tokens_per_second_ratio", "step_time_ratio",
                                              "uptime")}, indent=2))
    for name, r in results.items():
        print(f"{name}: rollout {r['rollout_tokens_per_second']:.0f} tokens/s, median step {r['median_step_seconds']:.2f} s,"
              f" completion tokens per step {r['completion_tokens']}")


if __name__ == "__main__":
    main()
