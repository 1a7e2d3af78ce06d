"""DPO at the realistic shape, ours against TRL's DPOTrainer, in one run: step time and peak RSS as ratios.

    python bench/dpo.py --work DIR [--pairs 8 --batch 2 --steps 5 --length 512 --vocab 128256 --layers 4]

The model is bench/run.py's realistic one (the tiny Llama's layers at hidden 512, a 128k-token vocabulary); the data
are conversational prompt / chosen / rejected pairs whose rows (prompt + completion) take 60% to 100% of --length
tokens; both sides train a LoRA r16 on every linear layer (lora_alpha 32, no dropout), AdamW at the same learning
rate, sigmoid DPO with beta 0.1, the reference being the base model with the adapter disabled, batch --batch pairs,
fp32 on CPU, in a fresh process each (peak RSS is that process's ru_maxrss, step time the median of the steps after
the first two). --gpu: one CUDA GPU, fp32 weights under bf16 autocast on both sides, memory = peak GPU allocated.

What "ours" is, honestly: praisonai_accel.methods' PreferenceMethod (encode, collate) and PreferenceLoss (reference
pass + policy pass of chosen and rejected in one batch, through the chunked head) driven by a plain loop of AdamW
steps: no accelerate, no checkpoints, no logging. The recipe drives the same module (and adds those); this measures
the method itself, against the whole of TRL's DPOTrainer step (which also logs entropy, mean logits and token
accuracy every step).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WARMUP = 2


def make_pairs(tokenizer_dir: Path, count: int, length: int, seed: int = 3) -> list[dict]:
    """Pairs whose rows fit in `length` whole: a prompt of 30-50% of the row, completions of the rest."""
    from transformers import AutoTokenizer

    from praisonai_accel.demo.text import _NAMES

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    size = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def words(tokens: int) -> str:
        text = ""
        while size(text) < tokens - 4:
            text += " ".join(rng.choice(_NAMES) for _ in range(max(1, (tokens - size(text)) // 3))) + " "
        while size(text) > tokens and " " in text.strip():
            text = text.strip().rsplit(" ", 1)[0]
        return text.strip()

    pairs = []
    for _ in range(count):
        row = int(length * rng.uniform(0.6, 1.0)) - 16  # 16: the chat template's own tokens
        prompt = int(row * rng.uniform(0.3, 0.5))
        pairs.append({"prompt": [{"role": "user", "content": "repeat: " + words(prompt)}],
                      "chosen": [{"role": "assistant", "content": words(row - prompt)}],
                      "rejected": [{"role": "assistant", "content": words(row - prompt)}]})
    return pairs


def _peak_mib(gpu: bool = False) -> float:
    """Peak memory: the GPU's allocated peak with --gpu, else this process's peak RSS."""
    if gpu:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


def run_ours(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from praisonai_accel.data import ensure_chat_template
    from praisonai_accel.methods.preference import PreferenceLoss, PreferenceMethod

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ensure_chat_template(tokenizer)
    config = argparse.Namespace(method="dpo", beta=0.1, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=0.5,
                                max_prompt_length=args.length // 2, max_seq_length=args.length, desirable_weight=1.0,
                                undesirable_weight=1.0, model_fields_set={"max_prompt_length"})
    method = PreferenceMethod(config)
    pairs = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    examples = [method.encode(p, "paired", tokenizer, config) for p in pairs]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             task_type="CAUSAL_LM"))
    device = "cuda" if args.gpu else "cpu"
    module = PreferenceLoss(model.to(device), config, chunked=True).train()
    # --gpu: fp32 weights under bf16 autocast, as TRL's bf16=True runs them
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.gpu)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr)
    if args.precompute:  # once, before the first step, as precompute_ref_log_probs does (not timed, as in TRL)
        from praisonai_accel.methods.reference_logps import WithReference, compute_reference_logps

        with autocast:
            tensors = compute_reference_logps(method, module, examples, args.batch, tokenizer.pad_token_id, device)
        examples = [WithReference(examples, tensors)[i] for i in range(len(examples))]
    times, losses = [], []
    for step in range(args.steps):
        batch = [examples[(step * args.batch + i) % len(examples)] for i in range(args.batch)]
        _sync(args.gpu)
        started = time.perf_counter()
        data = {k: v.to(device) for k, v in method.collate(batch, tokenizer.pad_token_id).items()}
        with autocast:
            loss_sum, _ = module(**data)
        (loss_sum / method.units(data)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(args.gpu)
        times.append(time.perf_counter() - started)
        losses.append(loss_sum.item() / method.units(data))
    tokens = sum(len(e["chosen_input_ids"]) + len(e["rejected_input_ids"]) for e in examples) / len(examples)
    return {"step_seconds": times, "losses": losses, "peak_rss_mib": _peak_mib(args.gpu), "tokens_per_pair": tokens}


def run_trl(args) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from praisonai_accel.data import ensure_chat_template

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ensure_chat_template(tokenizer)
    pairs = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    times, marks = [], {}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, _args, state, _control, **_kw):
            _sync(args.gpu)
            marks["start"] = time.perf_counter()

        def on_step_end(self, _args, state, _control, **_kw):
            _sync(args.gpu)
            times.append(time.perf_counter() - marks["start"])

    config = DPOConfig(output_dir=str(Path(args.out) / "trl"), max_steps=args.steps, per_device_train_batch_size=args.batch,
                       learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                       report_to="none", max_length=args.length, use_cpu=not args.gpu, bf16=args.gpu, seed=0, dataloader_num_workers=0,
                       disable_tqdm=True, beta=0.1, loss_type=["sigmoid"],
                       precompute_ref_log_probs=args.precompute)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(pairs),
                         processing_class=tokenizer, peft_config=peft_config, callbacks=[StepTimes()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"step_seconds": times, "losses": losses, "peak_rss_mib": _peak_mib(args.gpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, bf16 autocast; memory = peak GPU allocated")
    parser.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs on both sides")
    parser.add_argument("--child", choices=["ours", "trl"])
    parser.add_argument("--model")
    parser.add_argument("--data")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        result = run_ours(args) if args.child == "ours" else run_trl(args)
        Path(args.out, f"{args.child}.json").write_text(json.dumps(result))
        return

    sys.path.insert(0, str(REPO / "bench"))
    from run import make_realistic_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{args.vocab}-{args.layers}"
    if not (model / "config.json").exists():
        make_realistic_model(model, vocab=args.vocab, layers=args.layers)
    data = work / f"pairs-{args.pairs}-{args.length}.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in make_pairs(model, args.pairs, args.length)))
    results, env = {}, {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not args.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    import os

    for name in ("ours", "trl"):
        command = [sys.executable, __file__, "--child", name, "--model", str(model), "--data", str(data), "--out",
                   str(work), "--work", str(work), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--length", str(args.length), "--lr", str(args.lr)] + (["--gpu"] if args.gpu else []) + (["--precompute"] if args.precompute else [])
        started = time.time()
        subprocess.run(command, check=True, env={**os.environ, **env, "PYTHONPATH": str(REPO)})
        results[name] = json.loads((work / f"{name}.json").read_text())
        results[name]["wall_seconds"] = time.time() - started
        results[name]["median_step_seconds"] = statistics.median(results[name]["step_seconds"][WARMUP:] or
                                                                  results[name]["step_seconds"])
    summary = {
        "device": "gpu (bf16 autocast); memory: peak GPU allocated" if args.gpu else "cpu (fp32); memory: peak RSS",
        "shape": {"vocab": args.vocab, "hidden": 512, "layers": args.layers, "length": args.length, "batch_pairs": args.batch,
                  "steps": args.steps, "lora_r": 16, "precompute_ref_log_probs": args.precompute, "tokens_per_pair": results["ours"]["tokens_per_pair"]},
        "step_time_ratio": results["ours"]["median_step_seconds"] / results["trl"]["median_step_seconds"],
        "peak_rss_ratio": results["ours"]["peak_rss_mib"] / results["trl"]["peak_rss_mib"],
        "ours": results["ours"], "trl": results["trl"],
    }
    (work / "dpo_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("shape", "step_time_ratio", "peak_rss_ratio")}, indent=2))
    for name in ("ours", "trl"):
        r = results[name]
        print(f"{name}: median step {r['median_step_seconds']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
              f"losses {[round(x, 4) for x in r['losses']]}")


if __name__ == "__main__":
    main()
