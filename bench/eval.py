"""`praisonai-accel eval` against the `lm_eval` CLI (hf model, peft adapter, the same batch size), in one run: requests
per second at 1 and 2 processes on the same local tasks and model.

    python bench/eval.py --work DIR [--hidden 256 --layers 4 --mc-docs 200 --gen-docs 48 --batch-size 16 --device cpu]
                         [--repeat 3]

The model is the tiny Llama at --hidden/--layers with random weights and a random LoRA adapter (r16, q/v/o); the
tasks are local YAML tasks: a multiple-choice one (--mc-docs documents x 4 choices = loglikelihood requests) and a
generate_until/exact_match one (--gen-docs, up to 16 new tokens). Each side runs in a fresh process and is timed
whole (start, imports, model load, scoring, writing), as a user waits for it; requests/s = the requests lm-eval
builds (loglikelihood + generation) over that wall time. The peer at 2 processes is `accelerate launch -m lm_eval`,
which on CPU runs both ranks on every request (lm-eval splits only across CUDA devices), the way the peers ship it.
Both sides' scores are compared too: they must be equal. --repeat N runs the four commands N times, in turn, and
takes each one's median (a shared machine's noise is a second either way).
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
NAMES = ["ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo"]


def build(work: Path, hidden: int, layers: int, mc_docs: int, gen_docs: int) -> tuple[Path, Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from praisonai_accel.demo.text import make_tiny_model

    model_dir = make_tiny_model(work / "model", hidden_size=hidden, layers=layers)
    torch.manual_seed(1)
    tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"],
                                      init_lora_weights=False))
    adapter = work / "adapter"
    tuned.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(adapter)
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    mc = [{"question": f"which colour does {NAMES[i % 10]} like after {NAMES[(i * 7) % 10]} and {NAMES[(i * 3) % 10]}",
           "choices": ["red", "blue", "green", "black"], "label": i % 4} for i in range(mc_docs)]
    gen = [{"question": f"repeat {NAMES[i % 10]} {NAMES[(i // 10) % 10]} {NAMES[(i * 7) % 10]}",
            "answer": f"{NAMES[i % 10]}"} for i in range(gen_docs)]
    for name, rows in (("bench_mc", mc), ("bench_gen", gen)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / "bench_mc.yaml").write_text(
        "task: bench_mc\n" + common.format(data=tasks / "bench_mc.jsonl") +
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
    (tasks / "bench_gen.yaml").write_text(
        "task: bench_gen\n" + common.format(data=tasks / "bench_gen.jsonl") +
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    return model_dir, adapter, tasks


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode not in (0,):
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")
    return seconds


def scores(results: dict) -> dict:
    return {task: {k: v for k, v in m.items() if "," in k} for task, m in results["results"].items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mc-docs", type=int, default=200)
    parser.add_argument("--gen-docs", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, adapter, tasks = build(args.work, args.hidden, args.layers, args.mc_docs, args.gen_docs)
    requests = args.mc_docs * 4 + args.gen_docs
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    task_args = ["--tasks", "bench_mc,bench_gen"]
    peer = ["-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model_dir},peft={adapter}",
            *task_args, "--include_path", str(tasks), "--batch_size", str(args.batch_size), "--device", args.device]
    ours = ["-m", "praisonai_accel", "eval", str(adapter), *task_args, "--include-path", str(tasks),
            "--batch-size", str(args.batch_size)] + (["--cpu"] if args.device == "cpu" else [])
    accel = args.work / "accelerate_2.yaml"
    from praisonai_accel.atomic import write_yaml_atomic
    from praisonai_accel.launcher.accelerate_config import build_accelerate_config

    write_yaml_atomic(build_accelerate_config(2), accel)
    py = sys.executable
    runs = {
        "lm_eval_1": [py] + peer + ["--output_path", str(args.work / "peer1")],
        "ours_1": [py] + ours + ["--output", str(args.work / "ours1.json")],
        "lm_eval_2": [py, "-m", "accelerate.commands.launch", "--config_file", str(accel), "--main_process_port",
                      "29671"] + peer[0:] + ["--output_path", str(args.work / "peer2")],
        "ours_2": [py] + ours + ["--num-processes", "2", "--output", str(args.work / "ours2.json")],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, command in runs.items():
            times[name].append(timed(command, env))
    seconds = {name: statistics.median(values) for name, values in times.items()}
    peer1 = scores(json.loads(next((args.work / "peer1").rglob("results_*.json")).read_text()))
    ours1 = scores(json.loads((args.work / "ours1.json").read_text())["tuned"])
    ours2 = scores(json.loads((args.work / "ours2.json").read_text())["tuned"])
    record = {
        "machine": f"{os.cpu_count()} cores" + (" (shared)" if args.device == "cpu" else ""), "device": args.device,
        "model": {"hidden": args.hidden, "layers": args.layers}, "requests": requests, "batch_size": args.batch_size,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "runs": {k: [round(v, 2) for v in values] for k, values in times.items()},
        "requests_per_second": {k: round(requests / v, 2) for k, v in seconds.items()},
        "ratio_1_process": round(seconds["lm_eval_1"] / seconds["ours_1"], 2),
        "ratio_2_processes": round(seconds["lm_eval_2"] / seconds["ours_2"], 2),
        "scores_equal_to_lm_eval": ours1 == peer1, "scores_equal_at_2_processes": ours2 == ours1,
        "scores": ours1,
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
