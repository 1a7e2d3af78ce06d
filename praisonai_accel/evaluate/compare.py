"""Base against tuned: one row per task and metric with lm-eval's standard errors, a paired test on the same items
where the samples allow it, and the regression gate (`--max-regression TASK=DELTA`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

_NOT_METRICS = {"name", "alias", "sample_len", "samples"}


@dataclass
class Row:
    task: str
    metric: str  # lm-eval's "metric,filter" key
    tuned: float
    tuned_stderr: float | None
    base: float | None = None
    base_stderr: float | None = None
    higher_is_better: bool = True
    paired_n: int | None = None
    paired_p: float | None = None

    @property
    def change(self) -> float | None:
        return None if self.base is None else self.tuned - self.base

    @property
    def loss(self) -> float:
        """How much worse tuned is than base (positive: a regression), whichever way the metric is better."""
        change = self.change or 0.0
        return -change if self.higher_is_better else change

    def as_dict(self) -> dict:
        return {"task": self.task, "metric": self.metric, "tuned": self.tuned, "tuned_stderr": self.tuned_stderr,
                "base": self.base, "base_stderr": self.base_stderr, "change": self.change,
                "paired_n": self.paired_n, "paired_p": self.paired_p}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rows(tuned: dict, base: dict | None = None) -> list[Row]:
    out = []
    for task, metrics in tuned["results"].items():
        better = tuned.get("higher_is_better", {}).get(task, {})
        for key, value in metrics.items():
            name = key.split(",")[0]
            if key in _NOT_METRICS or "_stderr" in name or _number(value) is None:
                continue
            stderr_key = key.replace(name, f"{name}_stderr", 1)
            row = Row(task, key, float(value), _number(metrics.get(stderr_key)),
                      higher_is_better=better.get(name, True) is not False)
            if base is not None and task in base["results"]:
                row.base = _number(base["results"][task].get(key))
                row.base_stderr = _number(base["results"][task].get(stderr_key))
                row.paired_n, row.paired_p = paired_test(tuned.get("per_item", {}).get(task, {}).get(name),
                                                         base.get("per_item", {}).get(task, {}).get(name))
            out.append(row)
    return out


def paired_test(tuned: dict | None, base: dict | None) -> tuple[int | None, float | None]:
    """(items, two-sided p) of a paired t-test on the items both scored; (None, None) when there are under 2."""
    if not tuned or not base:
        return None, None
    shared = sorted(set(tuned) & set(base))
    if len(shared) < 2:
        return None, None
    diffs = [tuned[k] - base[k] for k in shared]
    n = len(diffs)
    mean = sum(diffs) / n
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    if variance == 0:
        return n, 1.0 if mean == 0 else 0.0
    t = mean / math.sqrt(variance / n)
    try:
        from scipy.stats import t as student

        return n, float(2 * student.sf(abs(t), n - 1))
    except ImportError:  # the normal approximation
        return n, math.erfc(abs(t) / math.sqrt(2))


def parse_max_regression(specs: list[str]) -> dict[str, float]:
    """TASK=DELTA (or TASK/METRIC=DELTA) -> {TASK: DELTA}; one line for a malformed one."""
    out = {}
    for spec in specs:
        name, _, delta = spec.partition("=")
        try:
            out[name.strip()] = float(delta)
        except ValueError:
            raise ConfigError(f"--max-regression {spec}: expected TASK=DELTA, such as arc_easy=0.02") from None
        if not name.strip() or out[name.strip()] < 0:
            raise ConfigError(f"--max-regression {spec}: expected TASK=DELTA with DELTA >= 0")
    return out


def check_gate_tasks(gates: dict[str, float], tasks: list[str]) -> None:
    for name in gates:
        if name.split("/")[0] not in tasks:
            raise ConfigError(f"--max-regression {name}: not one of --tasks ({', '.join(tasks)})")


def regressions(table: list[Row], gates: dict[str, float]) -> list[str]:
    """One line per task and metric that fell by more than its gate's DELTA against the base."""
    found = []
    for row in table:
        metric = row.metric.split(",")[0]
        delta = gates.get(f"{row.task}/{metric}", gates.get(row.task))
        if delta is not None and row.base is not None and row.loss > delta:
            found.append(f"{row.task} {metric}: {row.base:.4f} -> {row.tuned:.4f} ({row.change:+.4f}), more than "
                         f"the {delta:g} allowed")
    return found


def _cell(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr else "")


def render(table: list[Row], title: str) -> None:
    """The table on stdout (rich): task, metric, [base], tuned, [change, paired p]."""
    from rich.console import Console
    from rich.table import Table

    compared = any(row.base is not None for row in table)
    out = Table(title=title)
    for name in ["task", "metric"] + (["base"] if compared else []) + ["tuned"] + (["change", "paired p"] if compared else []):
        out.add_column(name, justify="left" if name in ("task", "metric") else "right")
    for row in table:
        cells = [row.task, row.metric.replace(",none", "")]
        if compared:
            cells.append(_cell(row.base, row.base_stderr))
        cells.append(_cell(row.tuned, row.tuned_stderr))
        if compared:
            change = "-" if row.change is None else f"{row.change:+.4f}"
            if row.paired_p is not None:
                verdict = "noise" if row.paired_p >= 0.05 else ("better" if row.loss < 0 else "worse")
                p = f"{row.paired_p:.3f} ({verdict}, n={row.paired_n})"
            else:
                p = "-"
            cells += [change, p]
        out.add_row(*cells)
    Console(width=140).print(out)
