"""The preprocessing driver: every dataset read with its rows' numbers, each row checked against its format, encoded
by the training method's data half (methods.TrainingMethod.data: SFT's is methods/sft_rows.SFTData) and kept in the cache with what happened to it.

A row that does not fit its format stops the run before training with one line naming the first bad rows and how
many there are; with `skip_invalid_rows: true` the rest is trained, and every row not trained (invalid, or too long
to keep) is written with its number and reason to output_dir/logs/skipped_rows.jsonl. Tokenisation runs once and is
cached with per-dataset statistics, so every run, cached or not, says what was truncated, dropped and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_text_atomic
from ..config import DatasetSpec, TrainConfig
from ..errors import first_line
from .cache import (
    SKIPPED_FILE, STATS_FILE, DatasetStats, PreprocessReport, cache_entries, cache_key, remember_inputs,
)
from .encoding import count_targets
from .formats import TOO_LONG, DataError, RowProblem
from .sources import RawRows, read_rows
from .tokenized import TokenizedDataset

MASKING_SAMPLE = 32  # examples per dataset checked against the masking guarantee
SHOWN_INVALID = 3  # invalid rows named in the error line
_POSITION, _JSON = "__praisonai_position__", "__praisonai_row__"

log = logging.getLogger("praisonai_accel")


@dataclass
class SkippedRow:
    dataset: str
    position: int
    where: str  # `line 7` or `row index 3`
    number: dict  # {"line": 7} or {"index": 3}
    reason: RowProblem

    def record(self) -> dict:
        return {"dataset": self.dataset, **self.number, "reason": str(self.reason), "kind": self.reason.kind}


def invalid_rows_error(invalid: list[SkippedRow], formats: dict[str, str] | None = None) -> str:
    """One line: the first invalid rows, with their numbers and reasons, and how many there are in all."""
    datasets = list(dict.fromkeys(row.dataset for row in invalid))
    fmt = (formats or {}).get(datasets[0])
    shown = "; ".join(f"{row.where}: {row.reason}" if len(datasets) == 1 else f"{row.dataset} {row.where}: {row.reason}"
                      for row in invalid[:SHOWN_INVALID])
    where = (f"dataset {datasets[0]}" + (f" (format {fmt})" if fmt else "")) if len(datasets) == 1 else "datasets"
    counts = Counter(row.dataset for row in invalid)
    total = f"{len(invalid)} invalid row{'s' if len(invalid) > 1 else ''} in all"
    if len(datasets) > 1:
        total += " (" + ", ".join(f"{name} {count}" for name, count in counts.items()) + ")"
    hint = ("; use a chat_template that writes them (Qwen 3's and Llama 3.1's write tool calls and results), "
            if any(row.reason.kind.startswith("chat template drops") for row in invalid) else "; ")
    return (f"{where}: {shown} ({total}{hint}fix them, or set skip_invalid_rows: true to train on the rest and list "
            f"them in output_dir/logs/{SKIPPED_FILE})")


def _table(raw: RawRows, positions: list[int]):
    """The rows at `positions` as a datasets.Dataset for map(): local rows as JSON text (rows that disagree on a
    field's type would not make one Arrow schema), tables as they are."""
    import datasets

    if raw.table is not None:
        return raw.table.select(positions).add_column(_POSITION, positions)
    return datasets.Dataset.from_dict({_JSON: [json.dumps(raw.rows[p]) for p in positions], _POSITION: positions})


def _row_of(raw: RawRows, position: int) -> dict:
    return raw.table[position] if raw.table is not None else raw.rows[position]


def _number_rows(kept, column: str, raw: RawRows, source: int):
    """[dataset index, 1 for a file's line / 0 for a table's row index, the number] of each kept example's row."""
    numbers = [[source, 1, raw.lines[p]] if raw.lines is not None else [source, 0, p] for p in kept[_POSITION]]
    return kept.remove_columns(column).add_column(column, numbers)


def _encode_rows(table, method, fmt: str, spec: DatasetSpec, source: int, config: TrainConfig):
    def encode(example: dict) -> dict:
        row = json.loads(example[_JSON]) if _JSON in example else {k: v for k, v in example.items() if k != _POSITION}
        result = method.encode(row, fmt, method.tokenizer, config, spec)
        if isinstance(result, str):
            out = {name: [] for name in method.columns}
            return {**out, "reason": str(result), "kind": getattr(result, "kind", "invalid"), "truncated": False,
                    "response_cut": False, "length": 0, "num_target_tokens": 0, "source": source,
                    _POSITION: example[_POSITION]}
        return {**{name: result[name] for name in method.columns}, "reason": "", "kind": "",
                "truncated": bool(result.get("truncated")), "response_cut": bool(result.get("response_cut")),
                "length": method.length(result), "source": source, _POSITION: example[_POSITION],
                "num_target_tokens": sum(count_targets(result[n]) for n in method.columns if n.endswith("labels"))}

    try:
        return table.map(encode, remove_columns=table.column_names, num_proc=config.dataset_num_proc,
                         load_from_cache_file=False)
    except Exception as exc:
        cause = exc if isinstance(exc, DataError) else exc.__cause__ if isinstance(exc.__cause__, DataError) else None
        if cause is not None:
            raise cause from None
        raise DataError(f"dataset {spec.name}: {type(exc).__name__}: {first_line(exc, '')}") from None


def _checked_rows(raw: RawRows, method, spec: DatasetSpec) -> tuple[str, dict[int, RowProblem]]:
    """The dataset's format and its rows that do not fit it (or could not be read), by position."""
    bad: dict[int, RowProblem] = dict(raw.unreadable)
    # no row could be read: nothing tells the format, and the rows' own faults are the news
    fmt = method.detect_format(raw.columns, spec) if len(bad) < len(raw) else ""
    for position, row in raw:
        if position not in bad:
            problem = method.check_row(row, fmt, spec)
            if problem:
                bad[position] = problem
    return fmt, bad


def check_rows(config: TrainConfig, method) -> None:
    """Every row of the training and evaluation datasets against its format, without tokenizing: DataError (the
    line tokenize_dataset would give) unless skip_invalid_rows. The launcher runs it before it starts a worker or
    writes anything; rows only encoding can refuse (a chat template that drops a turn) are found while tokenizing."""
    if config.skip_invalid_rows:
        return
    invalid, formats = [], {}
    for spec in [*config.dataset, *(config.eval_dataset or [])]:
        raw = read_rows(spec)
        formats[spec.name], bad = _checked_rows(raw, method, spec)
        invalid += [SkippedRow(spec.name, p, raw.where(p), raw.number(p), bad[p]) for p in sorted(bad)]
    if invalid:
        raise DataError(invalid_rows_error(invalid, formats))


def tokenize_dataset(specs: list[DatasetSpec], tokenizer, config: TrainConfig, method):
    """The encoded examples of every dataset, concatenated; what happened to each dataset; and every row not
    trained (SkippedRow). Invalid rows stop it here unless config.skip_invalid_rows."""
    import datasets

    parts, stats, invalid, skipped, formats = [], PreprocessReport(), [], [], {}
    for index, spec in enumerate(specs):
        raw = read_rows(spec)
        fmt, bad = _checked_rows(raw, method, spec)
        formats[spec.name] = fmt
        good = [position for position in range(len(raw)) if position not in bad]
        encoded = _encode_rows(_table(raw, good), method, fmt, spec, index, config) if good else None
        kept_rows, too_long = [], []
        for i, (reason, kind, position) in enumerate(zip(*(encoded[c] for c in ("reason", "kind", _POSITION)))
                                                      if encoded is not None else ()):
            if not reason:
                kept_rows.append(i)
            elif kind == TOO_LONG:
                too_long.append(SkippedRow(spec.name, position, raw.where(position), raw.number(position),
                                           RowProblem(kind, reason)))
            else:
                bad[position] = RowProblem(kind, reason)
        refused = [SkippedRow(spec.name, p, raw.where(p), raw.number(p), bad[p]) for p in sorted(bad)]
        invalid += refused
        skipped += sorted(refused + too_long, key=lambda row: row.position)
        kept = encoded.select(kept_rows) if encoded is not None else None
        if kept is not None and method.row_number_column:  # the method names rows in training
            kept = _number_rows(kept, method.row_number_column, raw, index)
        sample = [_row_of(raw, p) for p in (kept[_POSITION][:MASKING_SAMPLE] if kept is not None else [])]
        stats.datasets.append(DatasetStats(
            name=spec.name, format=fmt, rows=len(raw), examples=len(kept_rows),
            truncated=sum(kept["truncated"]) if kept_rows else 0,
            response_cut=sum(kept["response_cut"]) if kept_rows else 0, dropped=len(too_long),
            tokens=sum(kept["length"]) if kept_rows else 0,
            target_tokens=sum(kept["num_target_tokens"]) if kept_rows else 0,
            masking=method.masking(), masking_problems=method.sample_problems(sample, fmt, spec) if sample else "",
            invalid=len(bad), invalid_by_reason=dict(Counter(problem.kind for problem in bad.values())),
        ))
        if kept_rows:
            parts.append(kept)
    if invalid and not config.skip_invalid_rows:
        raise DataError(invalid_rows_error(invalid, formats))
    if not parts:
        raise DataError("dataset: no example has any response token left to train on (check format and "
                        "max_seq_length" + (f"; every row was invalid or too long: see {SKIPPED_FILE}" if skipped
                                            else "") + ")")
    data = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    tokenized = TokenizedDataset.from_columns({name: data[name] for name in method.columns}, data["truncated"],
                                              data["source"], lengths=data["length"])
    return tokenized, stats, skipped


def load_or_build(specs: list[DatasetSpec], tokenizer, config: TrainConfig, cache_root: Path, method_data):
    """Tokenize once and keep the result, with its statistics, on disk; later runs and other ranks load it.

    Returns (TokenizedDataset, stats, from_cache)."""
    return _load_or_build_at(Path(cache_root) / cache_key(specs, tokenizer, config), specs, tokenizer, config,
                             method_data)[:3]


def _read_skipped(target: Path) -> list[dict]:
    path = target / SKIPPED_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _load_or_build_at(target: Path, specs: list[DatasetSpec], tokenizer, config: TrainConfig, method_data):
    """(data, stats, from_cache, skipped row records) of one cache entry, built first when missing."""
    if TokenizedDataset.exists(target) and (target / STATS_FILE).exists():
        return TokenizedDataset.load(target), PreprocessReport.load(target / STATS_FILE), True, _read_skipped(target)
    data, stats, skipped = tokenize_dataset(specs, tokenizer, config, method_data)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    data.save(tmp)
    (tmp / SKIPPED_FILE).write_text("".join(json.dumps(row.record()) + "\n" for row in skipped))
    stats.save(tmp / STATS_FILE)
    if target.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return TokenizedDataset.load(target), stats, False, _read_skipped(target)


def write_skipped_rows(config: TrainConfig, records: list[dict]) -> Path:
    """output_dir/logs/skipped_rows.jsonl: this run's rows not trained (none: the file is removed, so an earlier
    run's list is never taken for this one's)."""
    path = config.output_path() / "logs" / SKIPPED_FILE
    if not records:
        path.unlink(missing_ok=True)
        return path
    write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in records))
    return path


def load_datasets(config: TrainConfig, tokenizer, method_data):
    """The tokenized training set, its statistics, whether it came from the cache, and the eval set (or None):
    what training, `preprocess` and `preview` all read, from one cache. `method_data`: the run's training method's
    data half (methods.TrainingMethod.data)."""
    entries = cache_entries(config, tokenizer)  # keying hashes the whole vocabulary: once per entry
    train, stats, cached, skipped = _load_or_build_at(entries[0], config.dataset, tokenizer, config, method_data)
    records = [{"split": "train", **r} for r in skipped]
    evaluation = None
    if len(entries) > 1:
        evaluation, _, _, eval_skipped = _load_or_build_at(entries[1], config.eval_dataset, tokenizer, config,
                                                           method_data)
        records += [{"split": "eval", **r} for r in eval_skipped]
    remember_inputs(config, entries)
    try:
        stats.skipped_file = str(write_skipped_rows(config, records))
    except OSError as exc:  # a read-only output_dir: the cache entry still holds the list
        stats.skipped_file = f"{entries[0] / SKIPPED_FILE} (not copied to output_dir: {first_line(exc)})"
    stats.skipped = dict(Counter(r["kind"] for r in records if r["kind"] != TOO_LONG))
    return train, stats, cached, evaluation


def report_stats(stats: PreprocessReport, cached: bool) -> None:
    """Every run, cached or not, says what preprocessing kept, cut, dropped and skipped, per dataset."""
    for d in stats.datasets:
        log.info("data: %s%s", d.line(), " (cached)" if cached else "")
    for warning in stats.warnings():
        log.warning("warning: %s", warning)
