"""bench/gpu.sh's results.jsonl -> one JSON with each case's ratios to the TRL baseline, and a table on stdout.

    python3 bench/gpu_report.py WORK OUT.json
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def with_ratios(rows: list[dict]) -> list[dict]:
    """tokens/s, peak memory and MFU of each measured case over TRL's (none where TRL did not run)."""
    trl = next((r for r in rows if r.get("run") == "trl" and "tokens_per_second" in r), None)
    out = []
    for row in rows:
        row = dict(row)
        if trl is not None and "tokens_per_second" in row and row["run"] != "trl":
            row["speed_vs_trl"] = round(row["tokens_per_second"] / trl["tokens_per_second"], 3)
            if row.get("peak_gpu_memory_mib") and trl.get("peak_gpu_memory_mib"):
                row["memory_vs_trl"] = round(row["peak_gpu_memory_mib"] / trl["peak_gpu_memory_mib"], 3)
            if trl.get("mfu"):
                row["mfu_vs_trl"] = round(row["mfu"] / trl["mfu"], 3)
        out.append(row)
    return out


def environment() -> dict:
    facts = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "bitsandbytes"):
        try:
            facts[name] = __import__(name).__version__
        except Exception as exc:  # absent or broken: say which
            facts[name] = f"unavailable ({type(exc).__name__})"
    try:
        import torch

        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["cuda"] = torch.version.cuda
    except Exception:
        pass
    return facts


def main() -> None:
    work, target = Path(sys.argv[1]), Path(sys.argv[2])
    rows = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines() if line.strip().startswith("{")]
    peak = work / "peak.json"
    report = {"settings": {k: v for k, v in __import__("os").environ.items() if k in ("STEPS", "BATCH", "SEQ", "RECORDS")},
              "matmul_peak_tflops": round(json.loads(peak.read_text())["bf16_matmul_flops_per_second"] / 1e12, 1)
              if peak.exists() else None,
              "environment": environment(), "cases": with_ratios(rows)}
    params = work / "model-0.5b" / "params.json"
    if params.exists():
        report["model"] = json.loads(params.read_text())
    target.write_text(json.dumps(report, indent=1))
    print(f"{'case':<12} {'tokens/s':>9} {'peak MiB':>9} {'MFU':>6} {'x TRL':>6} {'mem x TRL':>9}")
    for row in report["cases"]:
        if "tokens_per_second" not in row:
            print(f"{row['run']:<12} {row.get('skipped') or 'exit ' + str(row.get('exit'))}")
            continue
        print(f"{row['run']:<12} {row['tokens_per_second']:>9} {row.get('peak_gpu_memory_mib') or 0:>9.0f} "
              f"{row['mfu']:>6.3f} {row.get('speed_vs_trl', '-'):>6} {row.get('memory_vs_trl', '-'):>9}")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
