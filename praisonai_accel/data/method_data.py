"""The data half of a training method: what the preprocessing driver (preprocess.py) calls on it, declared once.
A method's `data(tokenizer)` returns a subclass (methods/sft_rows.SFTData, preference.PreferenceData, ...)."""

from __future__ import annotations

from ..config import DatasetSpec


class MethodData:
    name = "method"  # shown in the preprocessing summary where the method has no masking plan
    columns: tuple[str, ...] = ()  # the ragged int columns of an encoded example; *labels are -100 where not trained
    row_number_column: str | None = None  # a column the driver fills with each row's source and number

    def detect_format(self, columns: list[str], spec: DatasetSpec) -> str:
        raise NotImplementedError

    def check_row(self, row: dict, fmt: str, spec: DatasetSpec):
        """Why the row does not fit its format (a formats.RowProblem), or None."""
        raise NotImplementedError

    def encode(self, row: dict, fmt: str, tokenizer, config, spec: DatasetSpec):
        """The example's `columns` (with its truncated / response_cut flags), or a RowProblem saying why not."""
        raise NotImplementedError

    def length(self, example: dict) -> int:
        """An encoded example's length in a batch."""
        raise NotImplementedError

    def masking(self) -> str:
        """What the preprocessing summary says of how rows are masked."""
        return self.name

    def sample_problems(self, rows: list[dict], fmt: str, spec: DatasetSpec) -> str:
        """What a sample of encoded rows shows wrong ('' when nothing)."""
        return ""
