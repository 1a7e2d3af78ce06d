"""Where rows come from, each with its number: local json/jsonl/csv/txt files are read here, so every row keeps its
file and 1-based line; parquet files, dataset folders and Hub datasets are read through `datasets`, numbered by row
index. A row that cannot be read at all (invalid JSON, bytes that are not UTF-8) comes back as a bad row with its
reason, never as an exception about the whole file; only a file that cannot be read past the bad spot (a JSON array
broken in the middle) stops with one line naming where.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..config import LOCAL_DATA_LOADERS, DatasetSpec
from ..errors import first_line
from .formats import DataError, RowProblem
from .images import keep_encoded

_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of bytes that are not UTF-8
READ_HERE = {".json", ".jsonl", ".csv", ".txt"}


@dataclass
class RawRows:
    """One dataset's rows, in order. Local files: `rows` (dicts, or None where unreadable) and `lines`; anything
    read through `datasets`: `table` (a datasets.Dataset), numbered by index."""

    name: str
    rows: list[Any] | None = None
    lines: list[int] | None = None
    unreadable: dict[int, RowProblem] = field(default_factory=dict)
    table: Any = None

    def __len__(self) -> int:
        return len(self.table) if self.table is not None else len(self.rows)

    @property
    def columns(self) -> list[str]:
        if self.table is not None:
            return list(self.table.column_names)
        names: dict[str, None] = {}
        for row in self.rows:
            if isinstance(row, dict):
                names.update(dict.fromkeys(row))
        return list(names)

    def where(self, position: int) -> str:
        """The row's number as the user finds it: `line 7` in a file, `row index 3` in a table."""
        return f"line {self.lines[position]}" if self.lines is not None else f"row index {position}"

    def number(self, position: int) -> dict:
        return {"line": self.lines[position]} if self.lines is not None else {"index": position}

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """(position, row dict or None when unreadable)."""
        if self.table is not None:
            yield from enumerate(self.table)
        else:
            yield from enumerate(self.rows)


def _local_path(spec: DatasetSpec) -> Path | None:
    path = Path(spec.name).expanduser()
    return path if path.exists() else None


def read_rows(spec: DatasetSpec) -> RawRows:
    """Every row of a dataset (the first num_samples of them), numbered; a dataset without any is a DataError (checked
    before launch, where it would otherwise be told as no example left to train on)."""
    raw = _read_rows(spec)
    if len(raw) == 0:
        where = spec.name if spec.split in (None, "train") else f"{spec.name} (split {spec.split})"
        raise DataError(f"dataset {where}: holds no rows")
    return raw


def _read_rows(spec: DatasetSpec) -> RawRows:
    path = _local_path(spec)
    if path is not None and path.is_file() and path.suffix.lower() in READ_HERE:
        try:
            raw = path.read_bytes().decode("utf-8", errors="surrogateescape")
        except OSError as exc:
            raise DataError(f"dataset {spec.name}: could not be read: {first_line(exc)}") from None
        raw = raw.removeprefix("\ufeff")
        suffix = path.suffix.lower()
        reader = {".csv": _csv_rows, ".txt": _text_rows}.get(suffix)
        if reader is None:
            reader = _json_array_rows if raw.lstrip().startswith("[") else _json_lines_rows
        rows, lines, unreadable = reader(raw, spec)
        if spec.num_samples is not None:
            rows, lines = rows[:spec.num_samples], lines[:spec.num_samples]
            unreadable = {k: v for k, v in unreadable.items() if k < spec.num_samples}
        return RawRows(spec.name, rows, lines, unreadable)
    return RawRows(spec.name, table=load_raw(spec))


def load_raw(spec: DatasetSpec):
    """A parquet file, a dataset folder or a Hub dataset, through `datasets` (its first num_samples rows)."""
    import datasets

    path = _local_path(spec)
    try:
        if path is not None and path.is_file():
            loader = LOCAL_DATA_LOADERS.get(path.suffix.lower())
            if loader is None:
                raise DataError(f"dataset {spec.name}: unsupported file type '{path.suffix}' (use {', '.join(LOCAL_DATA_LOADERS)})")
            data = datasets.load_dataset(loader, data_files=str(path), split="train")
        elif path is not None:  # a dataset repository on disk: its card's configs (subsets) and splits, as on the Hub
            data = datasets.load_dataset(str(path), spec.subset, data_files=spec.data_files, split=spec.split)
        else:
            data = datasets.load_dataset(spec.name, spec.subset, data_files=spec.data_files, split=spec.split)
    except DataError:
        raise
    except FileNotFoundError as exc:
        raise DataError(f"dataset {spec.name}: not found ({exc})") from None
    except Exception as exc:  # datasets raises many unrelated types for unreadable input
        raise DataError(f"dataset {spec.name}: could not be loaded: {type(exc).__name__}: {first_line(exc, '')}") from None
    if spec.num_samples is not None:
        data = data.select(range(min(spec.num_samples, len(data))))

    return keep_encoded(data)  # Image features as the files' bytes: decoded for training only, in the collator


def _not_utf8(text: str, column_base: int = 1) -> RowProblem | None:
    match = _NOT_UTF8.search(text)
    if match is None:
        return None
    byte = ord(match.group()) - 0xDC00
    return RowProblem("not UTF-8", f"bytes that are not UTF-8 (0x{byte:02x} at column {match.start() + column_base})")


def _json_lines_rows(raw: str, spec: DatasetSpec):
    rows, lines, unreadable = [], [], {}
    for number, line in enumerate(raw.split("\n"), 1):
        if not line.strip():
            continue
        position = len(rows)
        rows.append(None)
        lines.append(number)
        problem = _not_utf8(line)
        if problem is None:
            try:
                row = json.loads(line)
            except ValueError as exc:
                problem = RowProblem("invalid JSON", f"invalid JSON ({getattr(exc, 'msg', exc)} at column "
                                                     f"{getattr(exc, 'colno', '?')})")
            else:
                if isinstance(row, dict):
                    rows[position] = row
                else:
                    problem = RowProblem("not an object", f"a JSON {_json_kind(row)}, not an object")
        if problem is not None:
            unreadable[position] = problem
    return rows, lines, unreadable


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _json_array_rows(raw: str, spec: DatasetSpec):
    """A JSON array of row objects, each numbered by the line its object starts on."""
    decoder = json.JSONDecoder()
    newlines = [m.start() for m in re.finditer("\n", raw)]

    def line_of(offset: int) -> int:
        import bisect

        return bisect.bisect_left(newlines, offset) + 1

    def broken(offset: int, why: str):
        column = offset - (raw.rfind("\n", 0, offset) + 1) + 1
        return DataError(f"dataset {spec.name}: invalid JSON at line {line_of(offset)}, column {column}: {why}; "
                         "nothing after it can be read")

    rows, lines, unreadable = [], [], {}
    spaces = re.compile(r"\s*")
    at = spaces.match(raw, raw.index("[") + 1).end()
    if raw.startswith("]", at):
        return rows, lines, unreadable
    while True:
        try:
            row, end = decoder.raw_decode(raw, at)
        except json.JSONDecodeError as exc:
            raise broken(exc.pos, exc.msg) from None
        position = len(rows)
        rows.append(row if isinstance(row, dict) else None)
        lines.append(line_of(at))
        problem = _not_utf8(raw[at:end])
        if problem is None and not isinstance(row, dict):
            problem = RowProblem("not an object", f"a JSON {_json_kind(row)}, not an object")
        if problem is not None:
            rows[position] = None
            unreadable[position] = problem
        at = spaces.match(raw, end).end()
        if raw.startswith("]", at):
            if raw[at + 1:].strip():
                raise broken(at + 1, "more text after the array")
            return rows, lines, unreadable
        if not raw.startswith(",", at):
            raise broken(at, "expecting ',' or ']' after a row")
        at = spaces.match(raw, at + 1).end()


def _csv_rows(raw: str, spec: DatasetSpec):
    """Every value as text, as written (pandas would turn an empty cell into NaN, then the text 'nan')."""
    reader = csv.reader(io.StringIO(raw, newline=""))
    try:
        header = next(reader)
    except StopIteration:
        return [], [], {}
    except csv.Error as exc:
        raise DataError(f"dataset {spec.name}: line 1: not a CSV header ({exc})") from None
    rows, lines, unreadable = [], [], {}
    start = reader.line_num + 1
    while True:
        try:
            values = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise DataError(f"dataset {spec.name}: line {start}: not CSV ({exc}); nothing after it can be read") from None
        if not values or values == [""] * len(values):
            start = reader.line_num + 1
            continue
        position = len(rows)
        lines.append(start)
        problem = next(filter(None, (_not_utf8(v) for v in values)), None)
        if problem is None and len(values) > len(header):
            problem = RowProblem("extra values", f"{len(values)} values where the header names {len(header)} columns")
        if problem is None:
            rows.append({name: (values[i] if i < len(values) else "") for i, name in enumerate(header)})
        else:
            rows.append(None)
            unreadable[position] = problem
        start = reader.line_num + 1
    return rows, lines, unreadable


def _text_rows(raw: str, spec: DatasetSpec):
    """One row per line of text, in the `text` column; blank lines separate texts and are not rows."""
    rows, lines, unreadable = [], [], {}
    for number, line in enumerate(raw.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        problem = _not_utf8(line)
        if problem is not None:
            unreadable[len(rows)] = problem
        rows.append(None if problem else {"text": line})
        lines.append(number)
    return rows, lines, unreadable
