"""A run's metrics.jsonl read back (the worker's MetricsLogger writes it line by line), and which of its metrics
are the method's headline."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path


def headline_names(patterns, keys) -> list[str]:
    """The metrics a method declares as its headline (methods' `headline_metrics`, shell-style patterns such as
    rewards/*/mean), in the order declared, among `keys`."""
    keys = [k for k in keys if not k.startswith("eval_")]
    names: list[str] = []
    for pattern in patterns:
        names += [k for k in sorted(keys) if fnmatch.fnmatchcase(k, pattern) and k not in names]
    return names


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl, skipping a last line cut short by a kill."""
    records = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records
