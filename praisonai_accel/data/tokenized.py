"""Tokenized examples as flat arrays on disk, read memory-mapped: the preprocessing cache.

An example is a set of named ragged int columns (SFT: input_ids and labels; a preference method: chosen_input_ids,
chosen_labels, rejected_input_ids, rejected_labels), each stored flat with its own offsets, plus the example's length
in a batch (what the training method says it occupies), whether it was truncated, and which dataset it came from.
Training processes only read this, so they never import `datasets` (nor pyarrow): that keeps ~80 MiB out of every
worker and a second off its start. Selections (shards, splits) are index arrays over the same memory-mapped data.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

COLUMNS_FILE = "columns.json"
_PER_EXAMPLE = ("lengths", "truncated", "source")


def _flat(rows) -> np.ndarray:
    return np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if len(rows) else np.zeros(0, np.int32)


def _offsets(rows) -> np.ndarray:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return offsets


class TokenizedDataset:
    def __init__(self, columns: dict[str, np.ndarray], offsets: dict[str, np.ndarray], example_lengths, truncated,
                 source, index=None):
        self.columns, self.column_offsets = dict(columns), dict(offsets)
        self.example_lengths, self.truncated, self.source = example_lengths, truncated, source
        self.index = np.arange(len(source)) if index is None else np.asarray(index, dtype=np.int64)

    @classmethod
    def from_columns(cls, columns: dict[str, list], truncated: list, source: list,
                     lengths: list[int] | None = None) -> "TokenizedDataset":
        """`columns`: name -> one list of ints per example. `lengths` defaults to the first column's."""
        first = next(iter(columns.values()))
        lengths = [len(r) for r in first] if lengths is None else lengths
        return cls({name: _flat(rows) for name, rows in columns.items()},
                   {name: _offsets(rows) for name, rows in columns.items()}, np.asarray(lengths, dtype=np.int64),
                   np.asarray(truncated, dtype=np.bool_), np.asarray(source, dtype=np.int32))

    def __getattr__(self, name: str):
        """A column's flat array by its name (data.input_ids), and SFT's offsets (data.offsets)."""
        columns = self.__dict__.get("columns", {})
        if name in columns:
            return columns[name]
        if name == "offsets" and columns:
            return self.column_offsets[next(iter(columns))]
        raise AttributeError(name)

    def save(self, directory: Path) -> None:
        """Write the whole dataset (not a selection of it)."""
        assert len(self.index) == len(self.source), "save() writes a whole dataset, not a selection"
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in self.columns:
            np.save(directory / f"{name}.npy", self.columns[name])
            np.save(directory / f"{name}.offsets.npy", self.column_offsets[name])
        for name, array in zip(_PER_EXAMPLE, (self.example_lengths, self.truncated, self.source)):
            np.save(directory / f"{name}.npy", array)
        (directory / COLUMNS_FILE).write_text(json.dumps(list(self.columns)))  # last: it marks the entry complete

    @classmethod
    def load(cls, directory: Path) -> "TokenizedDataset":
        directory = Path(directory)
        names = json.loads((directory / COLUMNS_FILE).read_text())
        read = lambda name: np.load(directory / f"{name}.npy", mmap_mode="r")
        return cls({n: read(n) for n in names}, {n: read(f"{n}.offsets") for n in names},
                   *(read(name) for name in _PER_EXAMPLE))

    @staticmethod
    def exists(directory: Path) -> bool:
        directory = Path(directory)
        try:
            names = json.loads((directory / COLUMNS_FILE).read_text())
        except (OSError, ValueError):
            return False
        files = [f"{n}{part}.npy" for n in names for part in ("", ".offsets")] + [f"{n}.npy" for n in _PER_EXAMPLE]
        return isinstance(names, list) and all((directory / f).is_file() for f in files)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, position: int) -> dict:
        row = int(self.index[position])
        example = {}
        for name, flat in self.columns.items():
            offsets = self.column_offsets[name]
            example[name] = np.asarray(flat[int(offsets[row]):int(offsets[row + 1])], dtype=np.int64)
        return example

    @property
    def lengths(self) -> list[int]:
        return np.asarray(self.example_lengths)[self.index].tolist()

    def select(self, positions) -> "TokenizedDataset":
        return TokenizedDataset(self.columns, self.column_offsets, self.example_lengths, self.truncated, self.source,
                                self.index[np.asarray(list(positions), dtype=np.int64)])

    def split(self, test_fraction: float, seed: int) -> tuple["TokenizedDataset", "TokenizedDataset"]:
        """A seeded shuffle cut into (train, test); the test part holds ceil(test_fraction x n) examples."""
        order = np.random.default_rng(seed).permutation(len(self))
        test_size = max(1, int(np.ceil(test_fraction * len(self))))
        return self.select(np.sort(order[test_size:])), self.select(np.sort(order[:test_size]))
