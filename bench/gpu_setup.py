"""The GPU benchmarks' inputs, built on the GPU machine itself (nothing is downloaded): random-weight Llama models
with Llama 3's 128,256-token vocabulary, an alpaca JSONL file, the run configs, and the bf16 matmul peak.

    WORK=DIR STEPS=10 BATCH=4 SEQ=2048 python3 bench/gpu_setup.py           # bench/gpu.sh's inputs (issue 37)
    WORK=DIR python3 bench/gpu_setup.py --small                            # only the small model (gpu_ranks.py)

model-0.5b: hidden 896, 24 layers, 14 heads (2 KV), MLP 4864, tied embeddings: Qwen2.5-0.5B's shape with Llama 3's
vocabulary (~0.49B parameters). model-small: the same with 4 layers (~0.16B), for the two-rank runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
             max_position_embeddings=8192, vocab_size=128256, tie_word_embeddings=True)


def build_model(directory: Path, layers: int) -> int:
    """Save a random-weight bf16 model with the tiny model's tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from praisonai_accel.demo.text import make_tiny_model

    hf_logging.disable_progress_bar()

    done = directory / "params.json"
    if done.exists():
        return json.loads(done.read_text())["parameters"]
    make_tiny_model(directory, hidden_size=64, layers=1)  # for its tokenizer; the weights are replaced below
    cfg = AutoConfig.from_pretrained(directory)
    # GPU_BENCH_SHAPE (JSON) shrinks the model for a CPU rehearsal of the scripts
    cfg.update(dict(SHAPE, num_hidden_layers=layers, **json.loads(os.environ.get("GPU_BENCH_SHAPE", "{}"))))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialising 0.5B parameters on the CPU takes longer than training them
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    count = sum(p.numel() for p in model.parameters())
    done.write_text(json.dumps({"parameters": count, "layers": layers}))
    return count


def write_data(path: Path, count: int, seq: int, seed: int = 0) -> Path:
    """Rows that fit `seq` tokens whole (this tokenizer spends about 2.7 tokens a word, so at most 0.31 x seq words,
    template included): neither tool truncates, and TRL drops none, so both train the same tokens."""
    from praisonai_accel.demo.text import _NAMES, write_jsonl

    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(_NAMES) for _ in range(k))  # noqa: E731
    records = [{"instruction": "repeat the last words", "input": words(rng.randint(seq * 7 // 100, seq * 24 // 100)),
                "output": words(rng.randint(max(1, seq // 100), seq * 7 // 100))} for _ in range(count)]
    return write_jsonl(records, path)


def matmul_peak(work: Path) -> float:
    import torch

    cuda = torch.cuda.is_available()
    n = 8192 if cuda else 1024  # the CPU rehearsal only needs some number
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    for _ in range(3):
        a @ a
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize() if cuda else None
        started = time.perf_counter()
        a @ a
        torch.cuda.synchronize() if cuda else None
        best = min(best, time.perf_counter() - started)
    peak = 2 * n**3 / best
    (work / "peak.json").write_text(json.dumps({"bf16_matmul_flops_per_second": peak}))
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s", flush=True)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    import torch
    import yaml

    if not torch.cuda.is_available() and not os.environ.get("GPU_BENCH_ON_CPU"):
        sys.exit("bench/gpu_setup.py: no CUDA GPU visible; run it on a GPU machine")
    work = Path(os.environ["WORK"])
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.small:
        build_model(work / "model-small", 4)
        print(f"model-small built in {time.perf_counter() - started:.1f} s", flush=True)
        return
    params = build_model(work / "model-0.5b", 24)
    print(f"model-0.5b: {params:,} parameters, built in {time.perf_counter() - started:.1f} s", flush=True)
    data = write_data(work / "data.jsonl", int(os.environ.get("RECORDS", "240")), int(os.environ["SEQ"]))
    base = {"model_name": str(work / "model-0.5b"), "max_seq_length": int(os.environ["SEQ"]),
            "dataset": [{"name": str(data), "format": "alpaca"}], "lora_r": 16, "lora_alpha": 32,
            "per_device_train_batch_size": int(os.environ["BATCH"]), "max_steps": int(os.environ["STEPS"]),
            "learning_rate": 2e-4, "logging_steps": 1, "use_unsloth": False, "plot_loss": False}
    runs = {"lora": {}, "lora-packed": {"packing": True}, "qlora": {"finetune_type": "qlora"},
            "unsloth": {"use_unsloth": True, "use_gradient_checkpointing": "unsloth"}}
    for name, extra in runs.items():
        (work / f"{name}.yaml").write_text(yaml.safe_dump({**base, **extra, "output_dir": str(work / name)}))
    matmul_peak(work)


if __name__ == "__main__":
    main()
