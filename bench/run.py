"""praisonai-accel vs a plain TRL SFTTrainer run, side by side, on this machine's CPUs.

    python bench/run.py [--case all|toy|realistic|full|sweep] [--repeats 2] [--out bench/results]

Same model (a 4-layer Llama built locally), same rows, batch, LoRA and process count; runs alternate
A B A B and every number quoted is a median. Each run reports the rows it trained and its MFU: model
FLOPs per second (praisonai_accel/flops.py) over a matmul peak measured around it. Prints tables and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from praisonai_accel.atomic import write_yaml_atomic  # noqa: E402
from praisonai_accel.launcher.accelerate_config import build_accelerate_config  # noqa: E402
from praisonai_accel.demo.text import demo_config, demo_records, make_tiny_model, write_jsonl  # noqa: E402
from praisonai_accel.launcher.plan import free_port  # noqa: E402

TARGETS = {"step_time_ratio": 0.9, "padding_fraction": 0.05, "help_seconds": 0.5, "cached_preprocess_ratio": 0.10,
           # realistic case (128k vocabulary, 512-token rows, no packing): ahead of every peer, not only of TRL
           "realistic_step_time_ratio": 0.5, "realistic_peak_rss_ratio": 0.5,
           # model FLOPs per second over the in-run matmul peak (flops.py; docs/benchmarks.md)
           "realistic_mfu": 0.65}
REALISTIC_VOCAB = 128256  # Llama 3's vocabulary
WARMUP_STEPS = 3  # the first steps include lazy initialisation; left out of step-time medians


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class PeakRss:
    """Polls the process tree under `pid`; keeps each training worker's peak resident memory."""

    def __init__(self, pid: int, marker: str):
        import psutil

        self.root, self.marker, self.peaks, self._stop = psutil.Process(pid), marker, {}, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        import psutil

        while not self._stop.is_set():
            try:
                for proc in [self.root] + self.root.children(recursive=True):
                    try:
                        if self.marker in " ".join(proc.cmdline()):
                            self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), proc.memory_info().rss)
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    def stop(self) -> float | None:
        self._stop.set()
        self.thread.join()
        return max(self.peaks.values()) / 2**20 if self.peaks else None


def run_command(command: list[str], marker: str, env: dict) -> tuple[float, float | None, float]:
    """Runs a contender; returns when it started, its peak RSS, and the matmul peak measured just before and just after
    it (their mean: what the machine could do, on average, while it ran)."""
    before = PEAK.measure()
    started = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = PeakRss(proc.pid, marker)
    output, _ = proc.communicate()
    peak = rss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{command[:4]}... failed ({proc.returncode}):\n{output[-3000:]}")
    return started, peak, (before + PEAK.measure()) / 2


def cpu_env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class MatmulPeak:
    """The machine's matmul rate, measured in this run (a 2048^3 product, all of torch's threads, at the dtype the
    runs compute in) just before and just after every contender. A shared machine drifts by tens of percent within
    seconds, so a measurement is the mean of 3 bursts half a second apart (each the best of 5 products, which only
    drops scheduler blips), and a run's MFU divides by the mean of its two: a run's FLOPs per second are an average
    over its steps, and so is the rate it is compared with. The highest burst alone would understate MFU on a busy
    machine."""

    def __init__(self, dtype: str = "float32", size: int = 2048):
        self.dtype, self.size, self.samples = dtype, size, []

    def measure(self, bursts: int = 3) -> float:
        import torch

        a = torch.randn(self.size, self.size, dtype=getattr(torch, self.dtype))
        b = torch.randn(self.size, self.size, dtype=a.dtype)
        a @ b
        rates = []
        for burst in range(bursts):
            if burst:
                time.sleep(0.5)
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - started)
            rates.append(2 * self.size**3 / best)
        self.samples.append(sum(rates) / len(rates))
        return self.samples[-1]

    @property
    def best(self) -> float:
        return max(self.samples)

    def summary(self) -> dict:
        return {"dtype": self.dtype, "size": self.size, "best_flops_per_second": self.best,
                "lowest_flops_per_second": min(self.samples), "measurements": len(self.samples)}


PEAK = MatmulPeak()


# ---------------------------------------------------------------- the two contenders

def ours(work: Path, model: Path, data: Path, processes: int, args, name: str, preprocess: bool = False,
         flags: tuple = (), **overrides) -> dict:
    out = work / name
    settings = dict(max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=2e-4,
                    max_seq_length=256, lora_r=16, lora_alpha=32, logging_steps=1,
                    group_by_length=not overrides.get("packing", False))
    config = demo_config(model, data, out, **{**settings, **overrides})
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    if preprocess:  # tokenize first, as `preprocess` does before a multi-node job: the worker then only reads the cache
        subprocess.run([sys.executable, "-m", "praisonai_accel", "preprocess", str(path)], env=cpu_env(), check=True,
                       capture_output=True)
    command = [sys.executable, "-m", "praisonai_accel", "train", str(path)]
    if processes > 1:
        command += ["--cpu", "--num-processes", str(processes), *flags]
    started, peak, matmul_peak = run_command(command, "praisonai_accel.train", cpu_env())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("time", started) >= started]  # a resumed run keeps earlier lines
    steps = [r for r in records if "loss" in r]
    saves = [r for r in records if "checkpoint" in r]
    summary = json.loads((out / "train_summary.json").read_text())
    first = min(r["time"] - r["step_seconds"] for r in steps)  # when the first step (of this launch) began
    measured = steps[WARMUP_STEPS:]
    flops_per_second = sum(r["model_flops"] for r in measured) / sum(r["step_seconds"] for r in measured)
    return {
        "step_seconds": median([r["step_seconds"] for r in measured]),
        "flops_per_second": flops_per_second,
        "mfu": flops_per_second / matmul_peak,
        "matmul_peak": matmul_peak,
        "model_flops_per_step": statistics.mean(r["model_flops"] for r in measured),
        "examples": sum(r["examples"] for r in steps),
        "targets": sum(r["targets"] for r in steps),
        "tokens_per_second": median([r["tokens_per_second"] for r in steps[WARMUP_STEPS:]]),
        "padding_fraction": 1 - sum(r["tokens"] for r in steps) / sum(r["positions"] for r in steps),
        "to_first_step_seconds": first - started,
        "peak_rss_mib": peak,
        "save_seconds": median([s["save_seconds"] for s in saves]),
        "checkpoint_mib": _size_mib(out / saves[-1]["checkpoint"]) if saves else None,
        "preprocess_seconds": summary["preprocess_seconds"],
        "preprocess_cached": summary["preprocess_cached"],
        "output_dir": str(out),
    }


def trl(work: Path, model: Path, data: Path, processes: int, args, name: str, save_steps: int = 0,
        resume: bool = False, steps: int | None = None, batch: int | None = None, max_length: int = 256) -> dict:
    out = work / name
    script = [str(REPO / "bench" / "trl_baseline.py"), "--model", str(model), "--data", str(data), "--out", str(out),
              "--steps", str(args.steps if steps is None else steps), "--batch", str(batch or args.batch), "--save-steps", str(save_steps),
              "--max-length", str(max_length)]
    if resume:
        script.append("--resume")
    accel = work / f"accelerate_{processes}.yaml"
    write_yaml_atomic(build_accelerate_config(processes, "no"), accel)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel),
               "--main_process_port", str(free_port())] + script
    # accelerate launch sets OMP_NUM_THREADS=1 unless it is set: one process would compute on one core of the two,
    # where praisonai-accel's single process (run without a launcher) uses every core
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    started, peak, matmul_peak = run_command(command, "trl_baseline.py", {**cpu_env(), **threads})
    rank_logs = sorted(out.glob("bench_steps.rank*.jsonl"))
    rank0 = [r for r in map(json.loads, rank_logs[0].read_text().splitlines()) if r.get("time", started) >= started]
    times = [r["time"] for r in rank0 if "step" in r]
    step_seconds = [b - a for a, b in zip(times, times[1:])]
    # each rank's batches in the order its steps took them (a prefetched batch past the last step is left out)
    batches = [[r for r in map(json.loads, log.read_text().splitlines()) if "tokens" in r and r["time"] >= started]
               [:len(times)] for log in rank_logs]
    counts = [c for rank in batches for c in rank]
    tokens, positions = sum(c["tokens"] for c in counts), sum(c["positions"] for c in counts)
    per_step_tokens = tokens / max(len(counts) / processes, 1)
    step_times = step_seconds[WARMUP_STEPS - 1:]
    step_flops = [sum(rank[i]["model_flops"] for rank in batches) for i in range(len(times))]
    saves = [r for r in rank0 if "saved" in r]
    save_seconds = None
    if saves:
        step_end = {r["step"]: r["time"] for r in rank0 if "step" in r}
        save_seconds = median([s["time"] - step_end[s["saved"]] for s in saves if s["saved"] in step_end])
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    first_step_start = times[0] - (median(step_times) or 0)
    flops_per_second = sum(step_flops[WARMUP_STEPS:]) / (times[-1] - times[WARMUP_STEPS - 1])
    return {
        "step_seconds": median(step_times),
        "flops_per_second": flops_per_second,
        "mfu": flops_per_second / matmul_peak,
        "matmul_peak": matmul_peak,
        "model_flops_per_step": statistics.mean(step_flops[WARMUP_STEPS:]),
        "examples": sum(c["examples"] for c in counts),
        "targets": sum(c["targets"] for c in counts),
        "tokens_per_second": per_step_tokens / median(step_times) if step_times else None,
        "padding_fraction": 1 - tokens / max(positions, 1),
        "to_first_step_seconds": first_step_start - started,
        "peak_rss_mib": peak,
        "save_seconds": save_seconds,
        "checkpoint_mib": _size_mib(checkpoints[-1]) if checkpoints else None,
        "output_dir": str(out),
    }


def _size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def help_seconds(repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "praisonai_accel", "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---------------------------------------------------------------- scenarios

def throughput(work, model, data, args) -> dict:
    results = {}
    for processes in args.processes:
        runs = {"praisonai-accel": [], "trl": []}
        for rep in range(args.repeats):  # A B A B: drift on a noisy machine hits both alike
            runs["praisonai-accel"].append(ours(work, model, data, processes, args, f"ours_p{processes}_{rep}"))
            runs["trl"].append(trl(work, model, data, processes, args, f"trl_p{processes}_{rep}"))
        results[processes] = {name: {k: median([r[k] for r in rs]) for k in rs[0]
                                     if k != "output_dir" and not isinstance(rs[0][k], bool)}
                              for name, rs in runs.items()}
        a, b = results[processes]["praisonai-accel"], results[processes]["trl"]
        results[processes]["step_time_ratio"] = a["step_seconds"] / b["step_seconds"]
        results[processes]["tokens_per_second_ratio"] = a["tokens_per_second"] / b["tokens_per_second"]
    return results


def checkpoint_and_resume(work, model, data, args) -> dict:
    """Save every 10 steps to step 20, then resume to 30: save time, size, command-to-first-resumed-step."""
    processes = max(args.processes)
    first_ours = ours(work, model, data, processes, args, "ckpt_ours", save_steps=10, max_steps=20)
    resumed_ours = ours(work, model, data, processes, args, "ckpt_ours", save_steps=10, max_steps=30)
    first_trl = trl(work, model, data, processes, args, "ckpt_trl", save_steps=10, steps=20)
    resumed_trl = trl(work, model, data, processes, args, "ckpt_trl", save_steps=10, steps=30, resume=True)
    return {
        "processes": processes,
        "praisonai-accel": {"save_seconds": first_ours["save_seconds"], "checkpoint_mib": first_ours["checkpoint_mib"],
                            "resume_to_first_step_seconds": resumed_ours["to_first_step_seconds"],
                            "fresh_to_first_step_seconds": first_ours["to_first_step_seconds"],
                            "preprocess_first_seconds": first_ours["preprocess_seconds"],
                            "preprocess_cached_seconds": resumed_ours["preprocess_seconds"],
                            "cache_hit": resumed_ours["preprocess_cached"]},
        "trl": {"save_seconds": first_trl["save_seconds"], "checkpoint_mib": first_trl["checkpoint_mib"],
                "resume_to_first_step_seconds": resumed_trl["to_first_step_seconds"],
                "fresh_to_first_step_seconds": first_trl["to_first_step_seconds"]},
    }


def make_realistic_model(directory: Path, vocab: int = REALISTIC_VOCAB, hidden_size: int = 512, layers: int = 4) -> Path:
    """The tiny Llama's layers at hidden 512, its embeddings and LM head resized to a real vocabulary (the tokenizer
    keeps its 320 tokens: the extra rows cost what they cost in a real model), positions up to 4,096."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(directory, hidden_size=hidden_size, layers=layers)
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.config.max_position_embeddings = 4096
    model.save_pretrained(directory)
    return directory


def fitting_records(tokenizer_dir: Path, count: int, length: int, seed: int = 2) -> list[dict]:
    """Alpaca rows that every tool trains whole at max length `length`: 45% to 95% of it each, the answer 50% to 80%
    of the row (chat data: a question, then a longer answer), with room left for the chat template. No tool truncates
    or drops one, so every comparison trains the same rows and the same target tokens."""
    import random

    from transformers import AutoTokenizer

    from praisonai_accel.demo.text import _NAMES

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    size = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    rng = random.Random(seed)
    instruction = "repeat the last words of the input"

    def words_of(tokens: int) -> str:  # names tokenize to 2-3 tokens each: grow, then trim to the budget
        text = " ".join(rng.choice(_NAMES) for _ in range(max(1, tokens // 3)))
        while size(text) < tokens - 6:
            text += " " + " ".join(rng.choice(_NAMES) for _ in range(max(1, (tokens - size(text)) // 3)))
        while size(text) > tokens and " " in text:
            text = text.rsplit(" ", 1)[0]
        return text

    rows = []
    for _ in range(count):
        budget = int(length * rng.uniform(0.45, 0.95)) - size(instruction) - 24  # 24: the template's own tokens
        answer = int(budget * rng.uniform(0.5, 0.8))
        rows.append({"instruction": instruction, "input": words_of(budget - answer), "output": words_of(answer)})
    return rows


def realistic_contenders(work: Path, model: Path, data: Path, args, length: int, batch: int, variants=True) -> dict:
    """ours (plain, and with packing and gradient checkpointing) and TRL, each one epoch over the same rows."""
    common = dict(preprocess=True, max_steps=-1, num_train_epochs=1, per_device_train_batch_size=batch,
                  max_seq_length=length)
    contenders = {"praisonai-accel": lambda name: ours(work, model, data, 1, args, name, **common)}
    if variants:
        contenders["praisonai-accel packed"] = lambda name: ours(work, model, data, 1, args, name, packing=True, **common)
        contenders["praisonai-accel grad ckpt"] = lambda name: ours(work, model, data, 1, args, name,
                                                                    use_gradient_checkpointing=True, **common)
    contenders["trl"] = lambda name: trl(work, model, data, 1, args, name, steps=0, batch=batch, max_length=length)
    return contenders


RESULT_KEYS = ("step_seconds", "tokens_per_second", "peak_rss_mib", "padding_fraction", "flops_per_second",
               "model_flops_per_step", "mfu", "matmul_peak", "examples", "targets")


def compare(contenders: dict, repeats: int, prefix: str) -> dict:
    """Runs A B C A B C ..., medians per contender, each row's MFU and its ratios to TRL."""
    runs = {name: [] for name in contenders}
    for rep in range(repeats):  # drift on a noisy machine hits every contender alike
        for name, run in contenders.items():
            runs[name].append(run(f"{prefix}_{name.replace(' ', '_')}_{rep}"))
    table = {name: {k: median([r[k] for r in rs]) for k in RESULT_KEYS} for name, rs in runs.items()}
    baseline = table["trl"]
    for row in table.values():
        row["step_time_ratio"] = row["step_seconds"] / baseline["step_seconds"]
        row["tokens_per_second_ratio"] = row["tokens_per_second"] / baseline["tokens_per_second"]
        row["peak_rss_ratio"] = row["peak_rss_mib"] / baseline["peak_rss_mib"]
    return table


def realistic(work: Path, args) -> dict:
    """128k vocabulary, hidden 512, batch 2 x rows up to 512 tokens: ours (plain, packed, gradient checkpointing) vs
    TRL, one epoch each over the same rows."""
    model = make_realistic_model(work / "model-128k")
    rows = args.realistic_steps * 2
    data = write_jsonl(fitting_records(model, rows, args.realistic_length), work / f"fit-{args.realistic_length}.jsonl")
    table = compare(realistic_contenders(work, model, data, args, args.realistic_length, 2), args.repeats, "real")
    return {"vocab_size": REALISTIC_VOCAB, "hidden_size": 512, "layers": 4, "batch": 2, "rows": rows,
            "max_seq_length": args.realistic_length, "table": table}


SWEEP_LENGTHS = (512, 1024, 2048)
SWEEP_VOCABS = (32000, 128256, 262144)  # Llama 2 / Mistral, Llama 3, Gemma 3


def sweep(work: Path, args) -> dict:
    """Rows of 512, 1024 and 2048 tokens x vocabularies of 32k, 128k and 262k: ours vs TRL, batch 1, one epoch over the
    same rows. Peak RSS less the LM head's weight (read whole every step; unused embedding rows are never paged in)
    shows what the step itself holds, which should not grow with the vocabulary."""
    points = []
    for vocab in SWEEP_VOCABS:
        model = make_realistic_model(work / f"model-{vocab}", vocab=vocab)
        head_mib = vocab * 512 * 4 / 2**20
        for length in SWEEP_LENGTHS:
            data = write_jsonl(fitting_records(model, args.sweep_rows, length), work / f"sweep-{vocab}-{length}.jsonl")
            table = compare(realistic_contenders(work, model, data, args, length, 1, variants=False), 1,
                            f"sweep_{vocab}_{length}")
            for row in table.values():
                row["rss_less_head_mib"] = row["peak_rss_mib"] - head_mib
            points.append({"vocab_size": vocab, "max_seq_length": length, "head_mib": head_mib, "table": table})
        shutil.rmtree(model, ignore_errors=True)
    return {"hidden_size": 512, "layers": 4, "batch": 1, "rows": args.sweep_rows, "points": points}


def full_fine_tuning(work: Path, args) -> dict:
    """Full fine-tuning at the realistic shape (128k vocabulary: the head and embeddings are 92% of the weights): the
    chunked loss against full logits on 1 process, and DDP against FSDP2 on 2 processes; peak RSS is per process."""
    model = work / "model-128k"
    if not model.exists():
        make_realistic_model(model)
    data = work / f"fit-{args.realistic_length}.jsonl"
    if not data.exists():
        write_jsonl(fitting_records(model, args.realistic_steps * 2, args.realistic_length), data)
    common = dict(preprocess=True, finetune_type="full", final_model_dir="model", learning_rate=1e-5,
                  max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2, max_seq_length=args.realistic_length)
    contenders = {
        "chunked loss, 1 process": (1, (), {}),
        "full logits, 1 process": (1, (), {"chunked_loss": False}),
        "DDP, 2 processes": (2, (), {}),
        "FSDP2, 2 processes": (2, ("--fsdp",), {}),
    }
    table = {}
    for name, (processes, flags, overrides) in contenders.items():
        result = ours(work, model, data, processes, args, f"full_{name.split(',')[0].replace(' ', '_')}_{processes}",
                      flags=flags, **common, **overrides)
        summary = json.loads((Path(result["output_dir"]) / "train_summary.json").read_text())
        table[name] = {key: result[key] for key in ("step_seconds", "tokens_per_second", "peak_rss_mib", "mfu", "examples")}
        table[name]["parameter_mib_per_rank"] = max(summary["parameter_bytes_per_rank"]) / 2**20
    return {"vocab_size": REALISTIC_VOCAB, "hidden_size": 512, "layers": 4, "batch": 2,
            "max_seq_length": args.realistic_length, "steps": args.realistic_steps, "table": table}


def manifest_cost(work: Path, args) -> dict:
    """What MANIFEST.json (size + content hash of every checkpoint file) costs a save: LoRA and full fine-tuning
    checkpoints of the toy model and of the realistic one (128k vocabulary, 143M parameters). save_seconds is the
    whole save as the run logs it, hash included; hash_seconds hashes the same files again right after, as the save
    does (page cache warm); verify_seconds is what a resume adds."""
    from praisonai_accel.run_dir.checkpoints import MARKER
    from praisonai_accel.run_dir.manifest import damage, fast_algorithm, write_manifest

    models = {"toy": make_tiny_model(work / "model-manifest", hidden_size=256, layers=4),
              "realistic": work / "model-128k"}
    if not models["realistic"].exists():
        make_realistic_model(models["realistic"])
    data = work / "manifest.jsonl"
    write_jsonl(demo_records(64, seed=3), data)
    table = {}
    for model_name, model in models.items():
        for method in ("lora", "full"):
            name = f"manifest_{model_name}_{method}"
            out = work / name
            config = demo_config(model, data, out, max_steps=2, save_steps=2, per_device_train_batch_size=2,
                                 max_seq_length=64, logging_steps=1, finetune_type=method, final_model_dir="model",
                                 learning_rate=1e-5)
            (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
            subprocess.run([sys.executable, "-m", "praisonai_accel", "train", str(work / f"{name}.yaml")], env=cpu_env(),
                           check=True, capture_output=True)
            saves = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            save = next(r for r in saves if "checkpoint" in r)
            checkpoint = out / save["checkpoint"]
            started = time.perf_counter()
            write_manifest(checkpoint, MARKER)
            hashed = time.perf_counter() - started
            started = time.perf_counter()
            assert damage(checkpoint, MARKER) is None
            table[f"{model_name}, {method}"] = {"checkpoint_mib": _size_mib(checkpoint), "save_seconds": save["save_seconds"],
                                                "hash_seconds": hashed, "verify_seconds": time.perf_counter() - started}
    return {"algorithm": fast_algorithm(), "table": table}


def report_manifest(result: dict) -> list[str]:
    lines = ["", f"checkpoint manifest ({result['algorithm']}): size, save (hash included), hash alone, verify on resume"]
    for name, row in result["table"].items():
        lines.append(f"  {name:<18} {row['checkpoint_mib']:8.1f} MiB  save {row['save_seconds']:6.2f} s  hash "
                     f"{row['hash_seconds']:6.3f} s ({100 * row['hash_seconds'] / row['save_seconds']:.0f}%)  verify "
                     f"{row['verify_seconds']:6.3f} s")
    return lines


def report_full(full: dict) -> list[str]:
    lines = ["", f"full fine-tuning: vocabulary {full['vocab_size']:,}, hidden {full['hidden_size']}, {full['layers']} "
                 f"layers, batch {full['batch']} x {full['max_seq_length']}-token rows (peak RSS per process)",
             "| run | rows trained | step time | tokens/s | MFU | peak RSS | parameters per rank |",
             "|---|---|---|---|---|---|---|"]
    for name, row in full["table"].items():
        lines.append(f"| {name} | {row['examples']} | {row['step_seconds']:.3g} s | {row['tokens_per_second']:.3g} | "
                     f"{row['mfu']:.2f} | {row['peak_rss_mib']:.0f} MiB | {row['parameter_mib_per_rank']:.0f} MiB |")
    return lines


def report(results: dict) -> str:
    def fmt(value, unit=""):
        return "n/a" if value is None else (f"{value:.3g}{unit}" if isinstance(value, float) else f"{value}{unit}")

    lines = ["| processes | metric | praisonai-accel | TRL SFTTrainer | ratio |", "|---|---|---|---|---|"]
    for processes, row in results["throughput"].items():
        a, b = row["praisonai-accel"], row["trl"]
        for key, unit in [("step_seconds", " s"), ("tokens_per_second", ""), ("mfu", ""), ("examples", ""),
                          ("to_first_step_seconds", " s"), ("peak_rss_mib", " MiB"), ("padding_fraction", "")]:
            ratio = a[key] / b[key] if a.get(key) and b.get(key) else None
            lines.append(f"| {processes} | {key} | {fmt(a.get(key), unit)} | {fmt(b.get(key), unit)} | {fmt(ratio)} |")
    ck = results["checkpoint"] or {}
    for key, unit in [("save_seconds", " s"), ("checkpoint_mib", " MiB"), ("fresh_to_first_step_seconds", " s"),
                      ("resume_to_first_step_seconds", " s")] if ck else []:
        a, b = ck["praisonai-accel"].get(key), ck["trl"].get(key)
        lines.append(f"| {ck['processes']} | {key} | {fmt(a, unit)} | {fmt(b, unit)} | {fmt(a / b if a and b else None)} |")
    real = results.get("realistic")
    if real:
        lines += ["", f"realistic case: vocabulary {real['vocab_size']:,}, hidden {real['hidden_size']}, "
                      f"{real['layers']} layers, batch {real['batch']} x rows up to {real['max_seq_length']} tokens, "
                      f"1 process, one epoch over the same {real['rows']} rows",
                  "| run | rows trained | target tokens | step time | tokens/s | MFU | peak RSS | padding | step time / TRL "
                  "| tokens/s / TRL | peak RSS / TRL |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in real["table"].items():
            lines.append(f"| {name} | {row['examples']} | {row['targets']} | {fmt(row['step_seconds'], ' s')} | "
                         f"{fmt(row['tokens_per_second'])} | {fmt(row['mfu'])} | {fmt(row['peak_rss_mib'], ' MiB')} | "
                         f"{fmt(row['padding_fraction'])} | {fmt(row['step_time_ratio'])} | "
                         f"{fmt(row['tokens_per_second_ratio'])} | {fmt(row['peak_rss_ratio'])} |")
    lines += report_sweep(results.get("sweep"))
    peak = results.get("matmul_peak")
    if peak:
        lines += ["", f"matmul peak ({peak['dtype']}, {peak['size']}^3, {peak['measurements']} measurements in this "
                      f"run): {peak['lowest_flops_per_second'] / 1e9:.0f} to {peak['best_flops_per_second'] / 1e9:.0f} "
                      f"GFLOP/s; each run's MFU = its model FLOPs per second / the mean of the measurements just "
                      f"before and after it"]
    if ck:
        ours_ck = ck["praisonai-accel"]
        lines += ["", f"preprocessing: first run {fmt(ours_ck['preprocess_first_seconds'], ' s')}, cached "
                  f"{fmt(ours_ck['preprocess_cached_seconds'], ' s')} (cache hit: {ours_ck['cache_hit']})"]
    lines += [f"praisonai-accel --help: {fmt(results['help_seconds'], ' s')}", "", "targets:"]
    lines += [f"- {name}: {'PASS' if ok else 'FAIL'} ({detail})" for name, (ok, detail) in results["targets"].items()]
    return "\n".join(lines)


def report_sweep(sweep: dict | None) -> list[str]:
    if not sweep:
        return []
    lines = ["", f"scaling sweep: hidden {sweep['hidden_size']}, {sweep['layers']} layers, batch {sweep['batch']}, "
                 f"1 process, one epoch over the same {sweep['rows']} rows per point (ours | TRL)",
             "| vocabulary | max length | rows trained | step time | MFU | peak RSS | peak RSS less the LM head | "
             "step time / TRL | peak RSS / TRL |", "|---|---|---|---|---|---|---|---|---|"]
    for point in sweep["points"]:
        a, b = point["table"]["praisonai-accel"], point["table"]["trl"]
        lines.append(f"| {point['vocab_size']:,} | {point['max_seq_length']} | {a['examples']} / {b['examples']} | "
                     f"{a['step_seconds']:.3g} s / {b['step_seconds']:.3g} s | {a['mfu']:.2f} / {b['mfu']:.2f} | "
                     f"{a['peak_rss_mib']:.0f} / {b['peak_rss_mib']:.0f} MiB | "
                     f"{a['rss_less_head_mib']:.0f} / {b['rss_less_head_mib']:.0f} MiB | "
                     f"{a['step_time_ratio']:.2f} | {a['peak_rss_ratio']:.2f} |")
    return lines


def check_targets(results: dict) -> dict:
    checks = {}
    for processes, row in results["throughput"].items():
        ratio = row["step_time_ratio"]
        checks[f"step time <= {TARGETS['step_time_ratio']} x TRL ({processes} proc)"] = (ratio <= TARGETS["step_time_ratio"], f"{ratio:.3f}")
        padding = row["praisonai-accel"]["padding_fraction"]
        checks[f"padding <= {TARGETS['padding_fraction']:.0%} ({processes} proc)"] = (padding <= TARGETS["padding_fraction"], f"{padding:.3%}")
    checks[f"--help < {TARGETS['help_seconds']} s"] = (results["help_seconds"] < TARGETS["help_seconds"], f"{results['help_seconds']:.3f} s")
    real = results.get("realistic")
    if real:
        row = real["table"]["praisonai-accel"]
        for key in ("step_time_ratio", "peak_rss_ratio"):
            target = TARGETS[f"realistic_{key}"]
            checks[f"realistic {key.replace('_', ' ')} <= {target} x TRL"] = (row[key] <= target, f"{row[key]:.3f}")
        checks[f"realistic MFU >= {TARGETS['realistic_mfu']}"] = (row["mfu"] >= TARGETS["realistic_mfu"], f"{row['mfu']:.3f}")
        checks["realistic: every tool trained the same rows"] = (len({r["examples"] for r in real["table"].values()}) == 1,
                                                                 ", ".join(f"{n} {r['examples']} rows, {r['targets']} "
                                                                           f"targets" for n, r in real["table"].items()))
    for point in (results.get("sweep") or {}).get("points", []):
        rows = {r["examples"] for r in point["table"].values()}
        checks[f"sweep {point['vocab_size']}/{point['max_seq_length']}: same rows"] = (len(rows) == 1, str(sorted(rows)))
    if results["checkpoint"]:
        ck = results["checkpoint"]["praisonai-accel"]
        ratio = ck["preprocess_cached_seconds"] / ck["preprocess_first_seconds"]
        checks[f"cached preprocessing < {TARGETS['cached_preprocess_ratio']:.0%} of first"] = (
            ck["cache_hit"] and ratio < TARGETS["cached_preprocess_ratio"], f"{ratio:.3%}")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--records", type=int, default=4000, help="training examples")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--case", choices=["all", "toy", "realistic", "full", "sweep", "manifest"], default="all",
                        help="toy: the 30-token rows of the tiny model; realistic: 128k vocabulary, long rows; full: full "
                             "fine-tuning at the realistic shape (chunked vs full logits, DDP vs FSDP2); sweep: 512-2048 "
                             "token rows x 32k-262k vocabularies; manifest: what hashing adds to a save (not in all)")
    parser.add_argument("--realistic-steps", type=int, default=12, help="steps of the realistic case: 2 rows each")
    parser.add_argument("--realistic-length", type=int, default=512, help="max_seq_length of the realistic case")
    parser.add_argument("--sweep-rows", type=int, default=8, help="rows (= steps, batch 1) of each sweep point")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="praisonai-accel-bench-"))
    try:
        if args.case == "manifest":
            result = manifest_cost(work, args)
            print("\n".join(report_manifest(result)))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"manifest-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(result, indent=2))
            return 0
        toy = args.case in ("all", "toy")
        model = make_tiny_model(work / "model", hidden_size=256, layers=4) if toy else None
        data = write_jsonl(demo_records(args.records, seed=1), work / "data.jsonl")
        results = {
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "help_seconds": help_seconds(),
            "throughput": throughput(work, model, data, args) if toy else {},
            "checkpoint": checkpoint_and_resume(work, model, data, args) if toy else None,
            "realistic": realistic(work, args) if args.case in ("all", "realistic") else None,
            "full": full_fine_tuning(work, args) if args.case in ("all", "full") else None,
            "sweep": sweep(work, args) if args.case in ("all", "sweep") else None,
        }
        results["matmul_peak"] = PEAK.summary()
        results["targets"] = check_targets(results)
        print(report(results) + ("\n" + "\n".join(report_full(results["full"])) if results["full"] else ""))
        args.out.mkdir(parents=True, exist_ok=True)
        target = args.out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
        target.write_text(json.dumps(results, indent=2, default=str))
        print(f"\nwrote {target}")
        return 0 if all(ok for ok, _ in results["targets"].values()) else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
