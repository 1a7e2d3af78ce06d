#!/usr/bin/env bash
# GPU benchmark (issue 37), one command: a random-weight ~0.5B model with Llama 3's 128,256-token vocabulary, bf16
# LoRA, 2048-token rows, 1 process. praisonai-accel plain and packed, the TRL SFTTrainer baseline on the same model,
# data and batch, QLoRA if bitsandbytes imports, unsloth if it imports. Prints tokens/s, peak GPU memory and MFU,
# and writes $RESULTS/gpu37.json (RESULTS defaults to $OUT where that is set, else $WORK).
#
#   bash bench/gpu.sh                     # no network needed: the model and data are built here
#   STEPS=20 BATCH=4 SEQ=2048 bash bench/gpu.sh
#   WHEELS=.whl bash bench/gpu.sh         # first pip-install the wheels in .whl (datasets, trl, pydantic, ...)
#
# MFU = model FLOPs per second (praisonai_accel/flops.py: real tokens and target tokens of each step, for
# praisonai-accel and TRL alike) / the bf16 matmul peak measured here first (an 8192^3 product, best of 10);
# mfu_datasheet divides by PEAK_TFLOPS instead (default 989: an H100/H200's dense bf16).
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-16} BATCH=${BATCH:-4} SEQ=${SEQ:-2048} PEAK_TFLOPS=${PEAK_TFLOPS:-989} RECORDS=${RECORDS:-240}
WORK=${WORK:-$(mktemp -d -t praisonai-accel-gpu-XXXX)}
RESULTS=${RESULTS:-${OUT:-$WORK}}
mkdir -p "$WORK" "$RESULTS"
export WORK RESULTS STEPS BATCH SEQ PEAK_TFLOPS RECORDS HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
: > "$WORK/results.jsonl"

python3 bench/gpu_setup.py || exit 1

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
                  "rows_trained": sum(s["examples"] for s in every), "steps": len(every),
                  "first_loss": summary.get("first_loss"), "final_loss": summary.get("final_loss"),
                  "peak_gpu_memory_mib": summary.get("peak_gpu_memory_mib"),
                  "mfu": round(flops / peak, 4), "mfu_datasheet": round(flops / (float(os.environ["PEAK_TFLOPS"]) * 1e12), 4)}))
PY
}

train_case() {  # name: praisonai-accel train, then its summary line (or a line saying how it failed)
  local name=$1 started=$SECONDS code
  python3 -m praisonai_accel train "$WORK/$name.yaml" 2>&1 | tail -n 25 > "$WORK/$name.log"
  code=${PIPESTATUS[0]}
  if [ "$code" = 0 ]; then
    summarise "$name" "$WORK/$name" | tee -a "$WORK/results.jsonl"
  else
    tail -n 8 "$WORK/$name.log"
    echo "{\"run\": \"$name\", \"exit\": $code, \"error\": $(tail -n 3 "$WORK/$name.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" | tee -a "$WORK/results.jsonl"
  fi
  echo "($name: $((SECONDS - started)) s)"
}

for name in lora lora-packed; do
  python3 -m praisonai_accel preprocess "$WORK/$name.yaml" >/dev/null 2>"$WORK/$name.preprocess.log" || tail -n 3 "$WORK/$name.preprocess.log"
  train_case "$name"
done
if python3 -c "import trl, datasets" >"$WORK/trl-import.log" 2>&1; then
  started=$SECONDS
  on_gpu=(--gpu) precision=bf16
  [ -n "${GPU_BENCH_ON_CPU:-}" ] && on_gpu=() precision=no  # the CPU rehearsal of this script
  python3 -m accelerate.commands.launch --num_processes 1 --num_machines 1 --dynamo_backend no --mixed_precision $precision \
    bench/trl_baseline.py --model "$WORK/model-0.5b" --data "$WORK/data.jsonl" --out "$WORK/trl" --steps "$STEPS" \
    --batch "$BATCH" --max-length "$SEQ" "${on_gpu[@]}" > "$WORK/trl.log" 2>&1
  code=$?
  if [ "$code" = 0 ]; then python3 - "$WORK/trl" <<'PY' | tee -a "$WORK/results.jsonl"
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
                  "step_seconds": step, "rows_trained": sum(b["examples"] for b in batches), "steps": len(times),
                  "peak_gpu_memory_mib": rows[-1].get("peak_gpu_memory_mib"), "mfu": round(flops / peak, 4),
                  "mfu_datasheet": round(flops / (float(os.environ["PEAK_TFLOPS"]) * 1e12), 4)}))
PY
  else
    tail -n 12 "$WORK/trl.log"
    echo "{\"run\": \"trl\", \"exit\": $code}" | tee -a "$WORK/results.jsonl"
  fi
  echo "(trl: $((SECONDS - started)) s)"
else
  echo "trl does not import here ($(tail -n 1 "$WORK/trl-import.log")); no TRL baseline"
  echo "{\"run\": \"trl\", \"skipped\": \"trl does not import\"}" >> "$WORK/results.jsonl"
fi
if python3 -c "import bitsandbytes" >"$WORK/bnb-import.log" 2>&1; then
  train_case qlora
else
  echo "bitsandbytes does not import here ($(tail -n 1 "$WORK/bnb-import.log")); no QLoRA run"
  echo "{\"run\": \"qlora\", \"skipped\": \"bitsandbytes does not import\"}" >> "$WORK/results.jsonl"
fi
if python3 -c "import unsloth" >"$WORK/unsloth-import.log" 2>&1; then
  UNSLOTH_TRACE=1 train_case unsloth
else
  echo "unsloth does not import here ($(tail -n 1 "$WORK/unsloth-import.log")); no unsloth run"
  echo "{\"run\": \"unsloth\", \"skipped\": \"unsloth does not import: $(tail -n 1 "$WORK/unsloth-import.log" | tr -d '"\\')\"}" >> "$WORK/results.jsonl"
fi
python3 bench/gpu_report.py "$WORK" "$RESULTS/gpu37.json"

# DPO (bench/dpo.py): ours (the preference loss module, plain AdamW loop) vs TRL's DPOTrainer, same model shape
# (128k vocabulary), pairs up to 512 tokens, LoRA r16, bf16 autocast; step time and peak GPU memory as ratios
if python3 -c "import trl" >/dev/null 2>&1; then
  python3 bench/dpo.py --work "$WORK/dpo" --gpu --pairs 16 --batch 4 --steps 12 --length 512 --layers 4  # writes $WORK/dpo/dpo_bench.json
fi
