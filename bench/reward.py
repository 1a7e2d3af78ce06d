"""Reward models, ours against TRL's RewardTrainer, in one run: step time and peak memory as ratios, and held-out
accuracy on the demo task.

    python bench/reward.py --work DIR [--pairs 8 --batch 2 --steps 5 --length 512 --vocab 128256 --layers 4]
    python bench/reward.py --work DIR --accuracy [--steps 80 --seeds 1 --held-out 100]

Speed (default): bench/run.py's realistic model (the tiny Llama's layers at hidden 512, a 128k-token vocabulary)
loaded as a one-label sequence classifier; bench/dpo.py's conversational pairs whose rows take 60% to 100% of
--length tokens; both sides train a LoRA r16 on every linear layer (lora_alpha 32, no dropout) with the score head in
full (modules_to_save), AdamW at the same learning rate with gradients clipped to norm 1.0 (since run 9), batch
--batch pairs, fp32 on CPU, each in a fresh process (peak RSS is that process's ru_maxrss, step time the median of
the steps after the first two). --gpu: one CUDA GPU,
bf16 autocast, memory = peak GPU allocated over the process, loading included, and over the training steps alone
(train_peak_mib: ours from its first step, TRL's from on_train_begin, the model on the GPU in both; ours loads onto
the GPU as the recipe does, and with offload its table then leaves). "Ours" is methods/reward.py's RewardMethod
(encode, collate) and
RewardLoss in a plain AdamW loop (what the recipe drives) with offload_embedding: true (the frozen 128k-row table in
host memory, models/host_embedding.py), against the whole of RewardTrainer's step; "ours-unshared" the same with
prefix_sharing off (chosen and rejected as rows of their own, as TRL has them); "ours-table-on-device" the same as
ours with the table on the device (offload_embedding: false; on CPU the two hold the same memory). Gradient
checkpointing (non-reentrant) is on for both sides by default, as RewardConfig has it (--checkpointing).

Accuracy (--accuracy): the reward demo's task (commands/demo_reward.py: the names reversed, chosen, or left in the
prompt's order, rejected: a fresh head ranks about half) on the same base (the SFT demo's model, trained first by
`praisonai-accel demo`), data, LoRA (r16, alpha 32), batch, learning rate and steps: ours through
`praisonai-accel train` on one CPU process, TRL's RewardTrainer; held-out pairwise accuracy of each saved model,
scored the same way (methods/reward.score_texts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from dpo import LORA_TARGETS, WARMUP, _peak_mib, _sync, make_pairs  # noqa: E402

SIDES = ("ours", "ours-unshared", "ours-table-on-device", "trl")


def _classifier(path, tokenizer, lora_targets, gpu: bool, checkpointing: bool = False, offload: bool = False):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from praisonai_accel.models.host_embedding import keep_on_host

    torch.manual_seed(0)
    placed = {"device_map": {"": 0}} if gpu else {}  # where the recipe loads it (models/loading.py): on its GPU
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32, **placed)
    model.config.pad_token_id = tokenizer.pad_token_id
    if offload:  # offload_embedding: true, as models/loading.py applies it: the table leaves the GPU once loaded
        keep_on_host(model)
    if checkpointing:  # as the recipe does for use_gradient_checkpointing: true, and RewardTrainer by default
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=lora_targets,
                                            task_type="SEQ_CLS")).to("cuda" if gpu else "cpu")


def run_ours(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from praisonai_accel.data import ensure_chat_template
    from praisonai_accel.methods.reward import RewardLoss, RewardMethod

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ensure_chat_template(tokenizer)
    config = argparse.Namespace(method="reward", max_prompt_length=args.length // 2, max_seq_length=args.length,
                                center_rewards_coefficient=None, model_fields_set=set())
    method = RewardMethod(config)
    pairs = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    examples = [method.encode(p, "paired", tokenizer, config) for p in pairs]
    model = _classifier(args.model, tokenizer, LORA_TARGETS, args.gpu, args.checkpointing == "on",
                        offload=args.child in ("ours", "ours-unshared"))
    module = RewardLoss(model, None, prefix_sharing=args.child != "ours-unshared").train()
    device = "cuda" if args.gpu else "cpu"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.gpu)
    trained = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr)
    times, losses, positions = [], [], []
    loaded_peak = _peak_mib(args.gpu)
    if args.gpu:
        torch.cuda.reset_peak_memory_stats()  # from here: the peak of the training steps alone
    for step in range(args.steps):
        batch = [examples[(step * args.batch + i) % len(examples)] for i in range(args.batch)]
        _sync(args.gpu)
        started = time.perf_counter()
        data = {k: v.to(device) for k, v in method.collate(batch, tokenizer.pad_token_id).items()}
        with autocast:
            loss_sum, _ = module(**data)
        (loss_sum / method.units(data)).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)  # max_grad_norm: 1.0, the recipe's default and RewardConfig's
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(args.gpu)
        times.append(time.perf_counter() - started)
        losses.append(loss_sum.item() / method.units(data))
        shared = module.shared_rows(data["input_ids"], data["attention_mask"])  # what the step ran, untimed
        positions.append((data["input_ids"] if shared is None else shared.input_ids).numel())
    tokens = sum(len(e["chosen_input_ids"]) + len(e["rejected_input_ids"]) for e in examples) / len(examples)
    train_peak = _peak_mib(args.gpu) if args.gpu else None
    return {"step_seconds": times, "losses": losses, "peak_rss_mib": max(loaded_peak, _peak_mib(args.gpu)),
            "train_peak_mib": train_peak, "tokens_per_pair": tokens,
            "positions_per_step": statistics.mean(positions), "prefix_sharing": module.prefix_sharing}


def _trl_trainer(model_path: str, pairs: list[dict], out: Path, steps: int, batch: int, lr: float, length: int,
                 gpu: bool, callbacks=(), seed: int = 0, warmup_steps: int = 0, scheduler: str = "constant",
                 checkpointing: bool = True):
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from praisonai_accel.data import ensure_chat_template

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ensure_chat_template(tokenizer)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    config = RewardConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
                          lr_scheduler_type=scheduler, warmup_steps=warmup_steps, logging_steps=1, save_strategy="no",
                          report_to="none", max_length=length, use_cpu=not gpu, bf16=gpu, seed=seed,
                          dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=checkpointing)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="SEQ_CLS",
                             modules_to_save=["score"])
    return RewardTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(pairs),
                         processing_class=tokenizer, peft_config=peft_config, callbacks=list(callbacks))


def run_trl(args) -> dict:
    from transformers import TrainerCallback

    times, marks = [], {}

    class StepTimes(TrainerCallback):
        def on_train_begin(self, _args, state, _control, **_kw):
            if args.gpu:  # the model is on the GPU by now: from here, the peak of the training steps alone
                import torch

                marks["loaded_peak"] = _peak_mib(True)
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, _args, state, _control, **_kw):
            _sync(args.gpu)
            marks["start"] = time.perf_counter()

        def on_step_end(self, _args, state, _control, **_kw):
            _sync(args.gpu)
            times.append(time.perf_counter() - marks["start"])

    pairs = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    trainer = _trl_trainer(args.model, pairs, Path(args.out) / "trl", args.steps, args.batch, args.lr, args.length,
                           args.gpu, [StepTimes()], checkpointing=args.checkpointing != "off")
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    peak = max(marks.get("loaded_peak", 0.0), _peak_mib(args.gpu))
    return {"step_seconds": times, "losses": losses, "peak_rss_mib": peak,
            "train_peak_mib": _peak_mib(True) if args.gpu else None}


def speed(args) -> None:
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
    for name in SIDES:
        command = [sys.executable, __file__, "--child", name, "--model", str(model), "--data", str(data), "--out",
                   str(work), "--work", str(work), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--length", str(args.length), "--lr", str(args.lr), "--checkpointing", args.checkpointing] + (
                      ["--gpu"] if args.gpu else [])
        started = time.time()
        subprocess.run(command, check=True, env={**os.environ, **env, "PYTHONPATH": str(REPO)})
        results[name] = json.loads((work / f"{name}.json").read_text())
        results[name]["wall_seconds"] = time.time() - started
        results[name]["median_step_seconds"] = statistics.median(results[name]["step_seconds"][WARMUP:] or
                                                                  results[name]["step_seconds"])
    summary = {
        "device": "gpu (bf16 autocast); memory: peak GPU allocated" if args.gpu else "cpu (fp32); memory: peak RSS",
        "shape": {"vocab": args.vocab, "hidden": 512, "layers": args.layers, "length": args.length,
                  "batch_pairs": args.batch, "steps": args.steps, "lora_r": 16,
                  "gradient_checkpointing": args.checkpointing,
                  "tokens_per_pair": results["ours"]["tokens_per_pair"]},
        "step_time_ratio": results["ours"]["median_step_seconds"] / results["trl"]["median_step_seconds"],
        "peak_rss_ratio": results["ours"]["peak_rss_mib"] / results["trl"]["peak_rss_mib"],
        "step_time_ratio_unshared": (results["ours-unshared"]["median_step_seconds"]
                                     / results["trl"]["median_step_seconds"]),
        "peak_rss_ratio_unshared": results["ours-unshared"]["peak_rss_mib"] / results["trl"]["peak_rss_mib"],
        "step_time_ratio_table_on_device": (results["ours-table-on-device"]["median_step_seconds"]
                                            / results["trl"]["median_step_seconds"]),
        "peak_rss_ratio_table_on_device": (results["ours-table-on-device"]["peak_rss_mib"]
                                           / results["trl"]["peak_rss_mib"]),
        **({"train_peak_ratio": results["ours"]["train_peak_mib"] / results["trl"]["train_peak_mib"],
            "train_peak_ratio_table_on_device": (results["ours-table-on-device"]["train_peak_mib"]
                                                 / results["trl"]["train_peak_mib"])} if args.gpu else {}),
        **results,
    }
    (work / "reward_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in SIDES}, indent=2))
    for name in SIDES:
        r = results[name]
        print(f"{name}: median step {r['median_step_seconds']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
              f"losses {[round(x, 4) for x in r['losses']]}")


def accuracy(args) -> None:
    import yaml

    from praisonai_accel.commands.demo_reward import SEED, TRAIN_PAIRS, held_out_accuracy, reward_demo_config
    from praisonai_accel.demo.text import order_records, task_records, write_jsonl

    work = Path(args.work).resolve()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    base = work / "outputs" / "model"
    if not (base / "config.json").exists():  # the SFT demo's model: it can read the prompt
        subprocess.run([sys.executable, "-m", "praisonai_accel", "demo", "--dir", str(work)], check=True, env=env)
    train = task_records(TRAIN_PAIRS, seed=2)
    held_out = order_records(task_records(args.held_out, seed=3, exclude={r["input"] for r in train}))
    pairs = order_records(train)
    data = write_jsonl(pairs, work / "reward_data.jsonl")
    runs = []
    for seed in range(SEED, SEED + args.seeds):  # the seed of the head's init, the data order and LoRA's init
        raw = reward_demo_config(base, data, work / f"ours-{seed}", args.steps)
        raw.update(seed=seed, lr_scheduler_type="constant_with_warmup")  # the same schedule on both sides
        config = work / f"reward_config-{seed}.yaml"
        config.write_text(yaml.safe_dump(raw, sort_keys=False))
        subprocess.run([sys.executable, "-m", "praisonai_accel", "train", str(config), "--cpu"], check=True, env=env)
        ours = held_out_accuracy(work / f"ours-{seed}" / "lora_model", held_out)
        trainer = _trl_trainer(str(base), pairs, work / f"trl-{seed}", raw["max_steps"],
                               raw["per_device_train_batch_size"], raw["learning_rate"], raw["max_seq_length"], False,
                               seed=seed, warmup_steps=raw["warmup_steps"], scheduler="constant_with_warmup")
        trainer.train()
        trainer.save_model(str(work / f"trl-{seed}" / "final"))
        theirs = held_out_accuracy(work / f"trl-{seed}" / "final", held_out)
        runs.append({"seed": seed, "accuracy_ours": ours, "accuracy_trl": theirs})
    mean = lambda key: statistics.mean(run[key] for run in runs)
    summary = {"task": "reward demo: the names reversed chosen over the prompt's order",
               "held_out_pairs": len(held_out), "steps": raw["max_steps"],
               "batch_pairs": raw["per_device_train_batch_size"], "learning_rate": raw["learning_rate"],
               "lora_r": raw["lora_r"], "base": "the SFT demo's model",
               "accuracy_before": held_out_accuracy(base, held_out), "runs": runs,
               "mean_accuracy_ours": mean("accuracy_ours"), "mean_accuracy_trl": mean("accuracy_trl"),
               "ours_minus_trl": mean("accuracy_ours") - mean("accuracy_trl")}
    (work / "reward_accuracy.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="default 5 (speed), the demo's 80 (--accuracy)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, bf16 autocast; memory = peak GPU allocated")
    parser.add_argument("--accuracy", action="store_true", help="held-out accuracy on the demo task instead")
    parser.add_argument("--seeds", type=int, default=1, help="--accuracy: train each side once per seed")
    parser.add_argument("--held-out", type=int, default=100, help="--accuracy: held-out inputs (the demo's 100)")
    parser.add_argument("--checkpointing", choices=["on", "off", "trl-default"], default="on",
                        help="gradient checkpointing on both sides (on, as RewardConfig defaults), off on both, or "
                             "trl-default: TRL's default (on) against ours without (how the first record was taken)")
    parser.add_argument("--child", choices=SIDES)
    parser.add_argument("--model")
    parser.add_argument("--data")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        result = run_trl(args) if args.child == "trl" else run_ours(args)
        Path(args.out, f"{args.child}.json").write_text(json.dumps(result))
        return
    if args.accuracy:
        accuracy(args)
    else:
        args.steps = args.steps or 5
        speed(args)


if __name__ == "__main__":
    main()
