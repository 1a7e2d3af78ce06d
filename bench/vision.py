"""Vision-language SFT, ours against TRL's SFTTrainer with images, in one run: step time and peak RSS as ratios, and
held-out exact match after training for both.

    python bench/vision.py --work DIR [--processes 2 --steps 120 --kind idefics3] [--record bench/recorded/X.json]

Both sides train the same tiny random-weight VLM (demo_vision.make_tiny_vlm) on the same drawn-shape rows in TRL's
vision format (`messages` with image parts + `images`), with `praisonai-accel demo --vision`'s settings: the whole
language model and the projector trained, the vision tower frozen, AdamW at 3e-3 (5 warm-up steps, linear decay),
batch 8 per process, fp32, `--processes` CPU processes under DDP, seed 42, loss on the assistant's tokens only (TRL:
assistant_only_loss=True, which swaps in its training chat template). Ours is the real CLI (`praisonai-accel train`);
TRL's is SFTTrainer under `accelerate launch` (OMP_NUM_THREADS = cores / processes, as bench/run.py runs it).

Step time: the median wall time per optimizer step after the first two (ours from metrics.jsonl with logging_steps 1;
TRL's between consecutive on_step_end calls of rank 0), data loading and image processing included on both sides.
Peak RSS: the largest of the training processes' peaks (bench/run.py's PeakRss). Exact match: greedy answers to the
held-out images (demo_vision.held_out_answers) from each side's saved model.
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

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WARMUP = 2


def cpu_env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO)}


def run_measured(command: list[str], marker: str, env: dict) -> tuple[float, float | None]:
    sys.path.insert(0, str(REPO / "bench"))
    from run import PeakRss

    started = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = PeakRss(proc.pid, marker)
    output, _ = proc.communicate()
    peak = rss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:5])}... failed ({proc.returncode}):\n{output[-3000:]}")
    return started, peak


def run_ours(work: Path, model: Path, data: Path, args) -> dict:
    from praisonai_accel.demo.vision import vision_demo_config

    out = work / "ours"
    config = vision_demo_config(model, data, out, max_steps=args.steps, logging_steps=1, overwrite_output_dir=True,
                                plot_loss=False, dataset_prepared_path=str(work / "prepared"))
    path = work / "ours.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "praisonai_accel", "train", str(path), "--cpu", "--num-processes",
               str(args.processes)]
    started, peak = run_measured(command, "praisonai_accel.train", cpu_env())
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    summary = json.loads((out / "train_summary.json").read_text())
    return {"step_seconds": [r["step_seconds"] for r in steps], "losses": [r["loss"] for r in steps],
            "peak_rss_mib": peak, "wall_seconds": time.time() - started, "model_dir": summary["final_model_dir"]}


def run_trl(work: Path, model: Path, data: Path, args) -> dict:
    from praisonai_accel.atomic import write_yaml_atomic
    from praisonai_accel.launcher.accelerate_config import build_accelerate_config
    from praisonai_accel.launcher.plan import free_port

    out = work / "trl"
    accel = work / f"accelerate_{args.processes}.yaml"
    write_yaml_atomic(build_accelerate_config(args.processes, "no"), accel)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel), "--main_process_port",
               str(free_port()), __file__, "--child", "--model", str(model), "--data", str(data), "--out", str(out),
               "--steps", str(args.steps), "--work", str(work)]
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.processes))}
    started, peak = run_measured(command, "vision.py --child", {**cpu_env(), **threads})
    result = json.loads((out / "trl_steps.json").read_text())
    times = result["step_end_times"]
    return {"step_seconds": [b - a for a, b in zip(times, times[1:])], "losses": result["losses"],
            "peak_rss_mib": peak, "wall_seconds": time.time() - started, "model_dir": str(out / "model")}


def trl_child(args) -> None:
    """One rank of TRL's SFTTrainer over the same rows and settings (run under accelerate launch)."""
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from praisonai_accel.models.vision import part_of

    data = Path(args.data)
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    for row in rows:  # paths relative to the dataset file, as ours reads them
        row["images"] = [str((data.parent / image).resolve()) for image in row["images"]]
    train = datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    for name, parameter in model.named_parameters():  # freeze_vision_tower: true, as ours
        if part_of(name) == "vision":
            parameter.requires_grad_(False)
    rank, out = int(os.environ.get("RANK", 0)), Path(args.out)
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_kw):
            ends.append(time.time())

    config = SFTConfig(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=8, learning_rate=3e-3,
                       lr_scheduler_type="linear", warmup_steps=5, weight_decay=0.0, max_grad_norm=1.0,
                       optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none", max_length=128,
                       use_cpu=True, seed=42, data_seed=42, dataloader_num_workers=0, disable_tqdm=True,
                       gradient_checkpointing=False, assistant_only_loss=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=processor,
                         callbacks=[StepTimes()])
    trainer.train()
    trainer.save_model(str(out / "model"))
    if rank == 0:
        processor.save_pretrained(out / "model")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (out / "trl_steps.json").write_text(json.dumps({"step_end_times": ends, "losses": losses}))
    import torch.distributed as dist

    if dist.is_initialized():  # without this a rank can abort at interpreter exit
        dist.barrier()
        dist.destroy_process_group()


def exact_match_of(model_dir: str, held_out: list[dict], image_root: Path) -> tuple[float, list[str]]:
    from praisonai_accel.demo.vision import exact_match, held_out_answers
    from praisonai_accel.models.inference import load_for_inference

    model, processor = load_for_inference(Path(model_dir), device="cpu")
    answers = held_out_answers(model, processor, held_out, image_root)
    return exact_match(answers, held_out), answers


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--kind", default="idefics3")
    parser.add_argument("--record", help="also write the result here (bench/recorded/...)")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--data")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        return trl_child(args)

    from praisonai_accel.demo.text import write_jsonl
    from praisonai_accel.demo.vision import make_tiny_vlm, shape_splits, trl_rows

    work = Path(args.work).resolve()
    model = work / f"tiny-{args.kind}"
    if not (model / "config.json").exists():
        make_tiny_vlm(args.kind, model)
    data_dir = work / "data"
    train, held_out = shape_splits(data_dir / "images", args.train, args.held_out)
    data = write_jsonl(trl_rows(train), data_dir / "train.jsonl")
    load_before = uptime()
    results = {"ours": run_ours(work, model, data, args), "trl": run_trl(work, model, data, args)}
    for side in results.values():
        side["median_step_seconds"] = statistics.median(side["step_seconds"][WARMUP:] or side["step_seconds"])
        side["held_out_exact_match"], side["answers"] = exact_match_of(side.pop("model_dir"), held_out, data_dir)
    ours, trl = results["ours"], results["trl"]
    summary = {
        "what": f"tiny {args.kind}, {args.train} drawn-shape images, {args.steps} steps of {args.processes} x 8 on "
                f"{args.processes} CPU processes (DDP), full fine-tuning with the vision tower frozen, fp32",
        "load_before": load_before, "load_after": uptime(),
        "step_time_ratio": ours["median_step_seconds"] / trl["median_step_seconds"],
        "peak_rss_ratio": ours["peak_rss_mib"] / trl["peak_rss_mib"],
        "held_out_exact_match": {"ours": ours["held_out_exact_match"], "trl": trl["held_out_exact_match"]},
        "chance": 0.25, "held_out": len(held_out),
        "ours": ours, "trl": trl,
    }
    (work / "vision_bench.json").write_text(json.dumps(summary, indent=2))
    if args.record:
        Path(args.record).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("what", "load_before", "step_time_ratio", "peak_rss_ratio",
                                              "held_out_exact_match")}, indent=2))
    for name, side in results.items():
        print(f"{name}: median step {side['median_step_seconds']:.3f} s, peak RSS {side['peak_rss_mib']:.0f} MiB, "
              f"wall {side['wall_seconds']:.0f} s, first/last loss {side['losses'][0]:.3f} / {side['losses'][-1]:.3f}, "
              f"held-out exact match {side['held_out_exact_match']:.0%}")


if __name__ == "__main__":
    main()
