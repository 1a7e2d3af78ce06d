#!/usr/bin/env bash
# GPU benchmark, one command: a random-weight ~0.5B model with Llama 3's 128,256-token vocabulary, bf16 LoRA,
# 2048-token rows, 1 process. praisonai-accel plain and packed, the TRL SFTTrainer baseline on the same model,
# data and batch, QLoRA if bitsandbytes imports, unsloth if it imports. Prints tokens/s, peak GPU memory and MFU.
#
#   bash bench/gpu.sh                     # no network needed: the model and data are built here
#   STEPS=20 BATCH=4 SEQ=2048 bash bench/gpu.sh
#   WHEELS=.whl bash bench/gpu.sh         # first pip-install the wheels in .whl (datasets, trl, pydantic, ...)
#
# MFU = model FLOPs per second (praisonai_accel/flops.py: real tokens and target tokens of each step, for
# praisonai-accel and TRL alike) / the bf16 matmul peak measured here first (an 8192^3 product, best of 10);
# mfu_datasheet divides by PEAK_TFLOPS instead (default 989: an H100/H200's dense bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-20} BATCH=${BATCH:-4} SEQ=${SEQ:-2048} PEAK_TFLOPS=${PEAK_TFLOPS:-989}
WORK=${WORK:-$(mktemp -d -t praisonai-accel-gpu-XXXX)}
export WORK STEPS BATCH SEQ PEAK_TFLOPS HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

python3 - <<'PY'
import json, os, random, sys
from pathlib import Path

import torch
import yaml

if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: no CUDA GPU visible; run it on a GPU machine")
from praisonai_accel.demo import _NAMES, make_tiny_model, write_jsonl
from transformers import AutoConfig, AutoModelForCausalLM

work = Path(os.environ["WORK"])
model = work / "model-0.5b"
if not (model / "config.json").exists():
    make_tiny_model(model, hidden_size=64, layers=1)  # for its tokenizer; the weights are replaced below
    cfg = AutoConfig.from_pretrained(model)
    cfg.update(dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, max_position_embeddings=8192, vocab_size=128256, tie_word_embeddings=True))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(model)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    (work / "params.json").write_text(json.dumps({"parameters": n}))
rng = random.Random(0)
words = lambda k: " ".join(rng.choice(_NAMES) for _ in range(k))
records = [{"instruction": "repeat the last words", "input": words(rng.randint(200, 900)), "output": words(rng.randint(20, 200))}
           for _ in range(2000)]
data = write_jsonl(records, work / "data.jsonl")
base = {"model_name": str(model), "max_seq_length": int(os.environ["SEQ"]), "dataset": [{"name": str(data), "format": "alpaca"}],
        "lora_r": 16, "lora_alpha": 32, "per_device_train_batch_size": int(os.environ["BATCH"]),
        "max_steps": int(os.environ["STEPS"]), "learning_rate": 2e-4, "logging_steps": 1, "use_unsloth": False}
runs = {"lora": {}, "lora-packed": {"packing": True}, "qlora": {"finetune_type": "qlora"},
        "unsloth": {"use_unsloth": True, "use_gradient_checkpointing": "unsloth"}}
for name, extra in runs.items():
    (work / f"{name}.yaml").write_text(yaml.safe_dump({**base, **extra, "output_dir": str(work / name)}))
import time
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
a @ a
best = float("inf")
for _ in range(10):
    torch.cuda.synchronize()
    started = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    best = min(best, time.perf_counter() - started)
(work / "peak.json").write_text(json.dumps({"bf16_matmul_flops_per_second": 2 * 8192**3 / best}))
print(f"measured bf16 matmul peak: {2 * 8192**3 / best / 1e12:.0f} TFLOP/s")
PY

summarise() {
  python3 - "$1" "$2" <<'PY'
import json, os, statistics, sys
from pathlib import Path
name, out = sys.argv[1], Path(sys.argv[2])
every = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
steps = every[3:]  # after warm-up
summary = json.loads((out / "train_summary.json").read_text())
peak = json.loads((Path(os.environ["WORK"]) / "peak.json").read_text())["bf16_matmul_flops_per_second"]
tps = statistics.median(s["tokens_per_second"] for s in steps)
flops = sum(s["model_flops"] for s in steps) / sum(s["step_seconds"] for s in steps)
print(json.dumps({"run": name, "backend": summary["backend"], "tokens_per_second": round(tps),
                  "step_seconds": statistics.median(s["step_seconds"] for s in steps),
                  "rows_trained": sum(s["examples"] for s in every),
                  "peak_gpu_memory_mib": summary.get("peak_gpu_memory_mib"),
                  "mfu": round(flops / peak, 4), "mfu_datasheet": round(flops / (float(os.environ["PEAK_TFLOPS"]) * 1e12), 4)}))
PY
}

for name in lora lora-packed; do
  python3 -m praisonai_accel preprocess "$WORK/$name.yaml" >/dev/null
  python3 -m praisonai_accel train "$WORK/$name.yaml" && summarise "$name" "$WORK/$name" | tee -a "$WORK/results.jsonl"
done
if python3 -c "import bitsandbytes" >/dev/null 2>&1; then
  python3 -m praisonai_accel train "$WORK/qlora.yaml" && summarise qlora "$WORK/qlora" | tee -a "$WORK/results.jsonl"
else
  echo "bitsandbytes does not import here; no QLoRA run"
fi
if python3 -c "import unsloth" >/dev/null 2>&1; then
  UNSLOTH_TRACE=1 python3 -m praisonai_accel train "$WORK/unsloth.yaml" && summarise unsloth "$WORK/unsloth" | tee -a "$WORK/results.jsonl"
else
  echo "unsloth does not import here; no unsloth run"
fi
if python3 -c "import trl" >/dev/null 2>&1; then
  python3 -m accelerate.commands.launch --num_processes 1 --mixed_precision bf16 bench/trl_baseline.py \
    --model "$WORK/model-0.5b" --data "$WORK/data.jsonl" --out "$WORK/trl" --steps "$STEPS" --batch "$BATCH" \
    --max-length "$SEQ" --gpu && python3 - "$WORK/trl" <<'PY'
import json, statistics, sys
from pathlib import Path
import os
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "bench_steps.rank0.jsonl").read_text().splitlines()]
times = [r["time"] for r in rows if "step" in r]
batches = [r for r in rows if "tokens" in r][:len(times)]
step = statistics.median(b - a for a, b in zip(times[3:], times[4:]))
flops = sum(b["model_flops"] for b in batches[4:]) / (times[-1] - times[3])
peak = json.loads((Path(os.environ["WORK"]) / "peak.json").read_text())["bf16_matmul_flops_per_second"]
print(json.dumps({"run": "trl", "tokens_per_second": round(statistics.median(b["tokens"] for b in batches) / step),
                  "step_seconds": step, "rows_trained": sum(b["examples"] for b in batches),
                  "peak_gpu_memory_mib": rows[-1].get("peak_gpu_memory_mib"), "mfu": round(flops / peak, 4),
                  "mfu_datasheet": round(flops / (float(os.environ["PEAK_TFLOPS"]) * 1e12), 4)}))
PY
else
  echo "trl does not import here; no TRL baseline"
fi
echo "results in $WORK/results.jsonl"

# DPO (bench/dpo.py): ours (the preference loss module, plain AdamW loop) vs TRL's DPOTrainer, same model shape
# (128k vocabulary), pairs up to 512 tokens, LoRA r16, bf16 autocast; step time and peak GPU memory as ratios
if python3 -c "import trl" >/dev/null 2>&1; then
  python3 bench/dpo.py --work "$WORK/dpo" --gpu --pairs 16 --batch 4 --steps 12 --length 512 --layers 4  # writes $WORK/dpo/dpo_bench.json
fi
