"""Long rows: activation memory per rank against row length, sequence parallel size 1 and 2, tiled MLP off and on.

    python bench/long_context.py [--lengths 2048,4096,8192,16384,32768] [--budget-mib 512] [--out FILE]

Each (sequence parallel size, tiled MLP, length) runs one training step (forward and backward of the recipe's loss
module on one unpadded row, a small random-weight Llama, fp32, full fine-tuning) in fresh processes: 1 process, or 2
gloo processes each holding half of the row. Per rank it measures the resident memory the step adds: Linux's peak
RSS (VmHWM) is reset just before the step and read after it, less the RSS before it; glibc is told to hand large
blocks back at once (MALLOC_MMAP_THRESHOLD_), so the RSS follows the live tensors. Then, for a memory budget per
rank, the longest row that fits: measured, and extrapolated from a fit of the step's memory against length.
On CUDA (--device cuda, 1 GPU: sequence parallel size 1 only) it reads torch.cuda.max_memory_allocated instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # inherited by the spawned workers


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model(options: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=options["vocab"], hidden_size=options["hidden"], intermediate_size=options["intermediate"],
                         num_hidden_layers=options["layers"], num_attention_heads=options["heads"],
                         num_key_value_heads=options["heads"], max_position_embeddings=max(options["lengths"]) * 2,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(options["device"]).train()


def worker(rank: int, world: int, options: dict, length: int, tiled: bool, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from praisonai_accel.methods.lm_loss import CausalLMLoss, ShardedCausalLMLoss
    from praisonai_accel.models.sequence_parallel import SequenceParallel
    from praisonai_accel.models.tiled_mlp import apply_tiled_mlp

    torch.set_num_threads(options["threads"])
    cuda = options["device"] == "cuda"
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = _model(options)
    if tiled:
        apply_tiled_mlp(model)
    sp = None
    if world > 1:
        sp, _layout = SequenceParallel.setup(world)
        sp.apply(model)
    module = (ShardedCausalLMLoss if sp else CausalLMLoss)(model)

    def step(tokens: int) -> None:
        generator = torch.Generator().manual_seed(tokens)
        ids = torch.randint(1, options["vocab"], (1, tokens), generator=generator).to(options["device"])
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        if sp is not None:
            batch = sp.shard_batch(batch)
        loss = module(batch["input_ids"], batch["labels"], batch["attention_mask"], batch.get("position_ids"))
        loss.backward()
        if sp is not None:
            sp.end_batch()
        model.zero_grad(set_to_none=True)

    step(256 * world)  # lazy initialisation, outside the measurement
    import gc

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
        before = _status_kib("VmRSS") * 1024
    started = time.perf_counter()
    step(length)
    seconds = time.perf_counter() - started
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"step_mib": (peak - before) / 2**20, "peak_mib": peak / 2**20,
                                                          "seconds": seconds}))
    if world > 1:
        dist.destroy_process_group()


def measure(options: dict, world: int, tiled: bool, length: int, work: Path) -> dict:
    import shutil

    import torch.multiprocessing as mp

    run = work / f"sp{world}-{'tiled' if tiled else 'plain'}-{length}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    mp.spawn(worker, args=(world, options, length, tiled, str(run / "store"), str(run)), nprocs=world, join=True)
    ranks = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(world)]
    return {"step_mib": max(r["step_mib"] for r in ranks), "peak_mib": max(r["peak_mib"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks)}


def longest_fitting(points: dict[int, float], budget: float) -> tuple[int | None, int | None]:
    """(longest measured length within the budget, the length where a least-squares line through the points meets it)."""
    measured = max((n for n, mib in points.items() if mib <= budget), default=None)
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / max(sum((x - mean_x) ** 2 for x in xs), 1e-9)
    fitted = int((budget - (mean_y - slope * mean_x)) / slope) if slope > 0 else None
    return measured, fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--budget-mib", type=float, default=512, help="memory a step may add per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--sizes", default="1,2", help="sequence parallel sizes (cuda: 1)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "long_context.json"))
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    options = {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers, "heads": args.heads,
               "vocab": args.vocab, "lengths": lengths, "device": args.device, "threads": args.threads}
    work = Path(args.out).parent / "long_context_runs"
    results = {"options": options, "budget_mib": args.budget_mib, "runs": {}}
    started = time.perf_counter()
    for world in (int(x) for x in args.sizes.split(",")):
        for tiled in (False, True):
            name = f"sp={world}, tiled_mlp={'on' if tiled else 'off'}"
            rows = results["runs"][name] = {}
            for length in lengths:
                rows[length] = measure(options, world, tiled, length, work)
                print(f"{name:26} {length:>6} tokens: {rows[length]['step_mib']:8.1f} MiB added per rank "
                      f"(peak {rows[length]['peak_mib']:.0f} MiB), {rows[length]['seconds']:.1f} s", flush=True)
            measured, fitted = longest_fitting({n: r["step_mib"] for n, r in rows.items()}, args.budget_mib)
            results["runs"][name] = {"by_length": rows, "longest_measured_within_budget": measured,
                                     "longest_fitted_within_budget": fitted}
    results["seconds"] = time.perf_counter() - started
    print("\n| run | " + " | ".join(f"{n // 1024}k" for n in lengths) + f" | longest row within {args.budget_mib:.0f} MiB "
          "(measured / fitted) |")
    print("|---|" + "---|" * len(lengths) + "---|")
    for name, run in results["runs"].items():
        cells = " | ".join(f"{run['by_length'][n]['step_mib']:.0f} MiB" for n in lengths)
        print(f"| {name} | {cells} | {run['longest_measured_within_budget'] or '-'} / "
              f"{run['longest_fitted_within_budget'] or '-'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{results['seconds']:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
