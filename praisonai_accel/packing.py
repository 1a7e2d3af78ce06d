"""Moved to praisonai_accel.data.packing; kept for the modules not yet updated."""

from .data.packing import PackedDataset, best_fit_decreasing  # noqa: F401
