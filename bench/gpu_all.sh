#!/usr/bin/env bash
# The one device call for issues 37, 47 and 38: install the carried wheels (.whl), run bench/gpu.sh (one process),
# bench/reward.py --gpu (110 s at most) and bench/gpu_ranks.py (two ranks on one GPU), and leave logs and JSON in $OUT
# (at most 8 files come back).
#   OUT=/tmp/out bash bench/gpu_all.sh           # TOTAL_S (default 390) bounds the whole
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out} TOTAL_S=${TOTAL_S:-390} WORK=${WORK:-/tmp/gpu-work}
mkdir -p "$OUT" "$WORK"
export OUT WORK RESULTS=$OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import sys, torch, transformers, accelerate, peft; print(sys.version.split()[0], torch.__version__, transformers.__version__, accelerate.__version__, peft.__version__)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout $((TOTAL_S * 55 / 100)) bash bench/gpu.sh 2>&1 | tee "$OUT/gpu37.log"
[ -f "$OUT/gpu37.json" ] || python3 bench/gpu_report.py "$WORK" "$OUT/gpu37.json"  # stopped by its timeout: what ran
echo "issue 37 done at ${SECONDS} s"
# issue 47: the reward model's step and memory against TRL's RewardTrainer, bf16 (ours with and without prefix sharing,
# and with the embedding table on the GPU instead of offload_embedding)
timeout 110 python3 bench/reward.py --work "$WORK/reward" --gpu --steps 10 > "$OUT/reward.log" 2>&1
cp "$WORK/reward/reward_bench.json" "$OUT/reward.json" 2>/dev/null
echo "issue 47 done at ${SECONDS} s"
left=$((TOTAL_S - SECONDS - 15))
BUDGET_S=$((left - 40)) timeout "$left" python3 bench/gpu_ranks.py 2>&1 | tee "$OUT/gpu38.log"
echo "issue 38 done at ${SECONDS} s"
tar czf "$OUT/logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls -d *.log *.stderr */logs 2>/dev/null) 2>/dev/null
ls -la "$OUT"
