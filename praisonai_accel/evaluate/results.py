"""The results file of an eval: lm-eval's own results structure for the tuned model (and the base), plus which model,
adapter, checkpoint step and configuration were scored. Default `<output_dir>/eval/<timestamp>.json`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..atomic import write_text_atomic

EVAL_DIR = "eval"


def default_path(output_dir: Path | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    directory = (Path(output_dir) if output_dir else Path.cwd()) / EVAL_DIR
    path, n = directory / f"{stamp}.json", 1
    while path.exists():  # two evals in one second: neither replaces the other
        n += 1
        path = directory / f"{stamp}-{n}.json"
    return path


def write_results(path: Path, target: dict, request: dict, scored: dict, table: list[dict]) -> Path:
    payload = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **target,
               "tasks": request["tasks"], "options": {k: v for k, v in request.items() if k not in ("target", "tasks")},
               "comparison": table, **scored}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(payload, indent=2))


def latest_eval(output_dir: Path) -> dict | None:
    """The newest results file under output_dir/eval/, or None."""
    def order(path: Path):
        parts = path.stem.split("-")  # <date>-<time>[-<n>]
        return parts[:2], int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 1

    files = sorted((Path(output_dir) / EVAL_DIR).glob("*.json"), key=order)
    for path in reversed(files):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "comparison" in data:
            return {**data, "path": str(path)}
    return None


def eval_rows(output_dir: Path) -> list[tuple[str, str]]:
    """The latest eval as `report` shows it: one row per task and metric, base -> tuned where both were scored."""
    latest = latest_eval(output_dir)
    if latest is None:
        return []
    out = [("eval", f"{latest['path']} (step {latest.get('checkpoint_step')}, {latest.get('created')})")]
    for row in latest["comparison"]:
        name = f"eval {row['task']}/{row['metric'].replace(',none', '')}"
        if row.get("base") is None:
            out.append((name, f"{row['tuned']:.4f}"))
        else:
            out.append((name, f"{row['base']:.4f} -> {row['tuned']:.4f} ({row['change']:+.4f} vs base)"))
    return out
