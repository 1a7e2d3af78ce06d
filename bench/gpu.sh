#!/usr/bin/env bash
# GPU benchmark: tokens/s and peak GPU memory of a ~0.5B-parameter LoRA run on one GPU,
# with unsloth and without it (transformers + peft).
#
#   bash bench/gpu.sh                 # builds a random-weight 0.5B Llama locally (no network needed)
#   MODEL=/path/to/Qwen2.5-0.5B bash bench/gpu.sh   # or any local / cached model
#   STEPS=40 BATCH=8 SEQ=512 bash bench/gpu.sh
#
# unsloth is measured only if it imports; install it with: pip install 'praisonai-accel[unsloth]'
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-40} BATCH=${BATCH:-8} SEQ=${SEQ:-512}
WORK=${WORK:-$(mktemp -d -t praisonai-accel-gpu-XXXX)}
export WORK STEPS BATCH SEQ MODEL="${MODEL:-}" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false

python3 - <<'PY'
import json, os, random, sys
from pathlib import Path

import torch
import yaml

if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: no CUDA GPU visible; run it on a GPU machine")
from praisonai_accel.demo import make_tiny_model, write_jsonl

work = Path(os.environ["WORK"])
model = os.environ.get("MODEL")
if not model:
    # ~0.5B parameters: Qwen2.5-0.5B-like shapes with a Llama architecture, random weights.
    model = str(make_tiny_model(work / "model-0.5b", hidden_size=896, layers=24))
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg.update(intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
               vocab_size=max(cfg["vocab_size"], 32000))
    (Path(model) / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).to(torch.bfloat16).save_pretrained(model)
rng = random.Random(0)
words = ["ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo"]
records = []
for _ in range(4000):
    text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 180)))
    records.append({"instruction": "repeat the words", "input": text, "output": text})
data = write_jsonl(records, work / "data.jsonl")
for backend in ("transformers", "unsloth"):
    config = {
        "model_name": model, "max_seq_length": int(os.environ["SEQ"]), "dataset": [{"name": str(data), "format": "alpaca"}],
        "finetune_type": "lora", "lora_r": 16, "lora_alpha": 32, "per_device_train_batch_size": int(os.environ["BATCH"]),
        "max_steps": int(os.environ["STEPS"]), "learning_rate": 2e-4, "logging_steps": 1, "group_by_length": True,
        "use_unsloth": backend == "unsloth", "use_gradient_checkpointing": True, "output_dir": str(work / backend),
    }
    (work / f"{backend}.yaml").write_text(yaml.safe_dump(config))
PY

summarise() {
  python3 - "$1" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][3:]
summary = json.loads((out / "train_summary.json").read_text())
print(json.dumps({"backend": summary["backend"],
                  "tokens_per_second": statistics.median(s["tokens_per_second"] for s in steps),
                  "step_seconds": statistics.median(s["step_seconds"] for s in steps),
                  "padding_fraction": statistics.median(s["padding_fraction"] for s in steps),
                  "peak_gpu_memory_mib": summary.get("peak_gpu_memory_mib")}))
PY
}

python3 -m praisonai_accel train "$WORK/transformers.yaml" && summarise "$WORK/transformers" | tee "$WORK/result-transformers.json"
if python3 -c "import unsloth" >/dev/null 2>&1; then
  python3 -m praisonai_accel train "$WORK/unsloth.yaml" && summarise "$WORK/unsloth" | tee "$WORK/result-unsloth.json"
else
  echo "unsloth does not import here; measured transformers + peft only"
fi
echo "results in $WORK"
