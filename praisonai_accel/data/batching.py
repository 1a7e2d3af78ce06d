"""Batches: right padding that never counts toward the loss, and a length-grouped shuffle that keeps padding small."""

from __future__ import annotations

from .chat_masking import IGNORE_INDEX


class LengthGroupedSampler:
    """A shuffled order in which every window of `window` samples is sorted longest first.

    Neighbouring samples then have similar lengths, so batches carry little padding. The order
    depends only on the seed, the epoch and the lengths, never on batch size or process count,
    so every layout (and a resumed run with another layout) walks the same sample sequence.
    """

    def __init__(self, lengths: list[int], window: int, seed: int):
        self.lengths, self.window, self.seed, self.epoch = list(lengths), window, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        import torch

        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        for start in range(0, len(order), self.window):
            yield from sorted(order[start:start + self.window], key=lambda i: -self.lengths[i])


class PadCollator:
    """Right-pads a batch to its longest row; padding never counts toward the loss.

    Packed rows carry position_ids that restart at every example; their padding is given positions
    of its own, so it forms one more (ignored) sequence and never joins an example.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(features), width), dtype=torch.long)
        packed = "position_ids" in features[0]
        positions = torch.zeros((len(features), width), dtype=torch.long) if packed else None
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[row, :n] = torch.as_tensor(feature["input_ids"])
            labels[row, :n] = torch.as_tensor(feature["labels"])
            attention[row, :n] = 1
            if packed:
                positions[row, :n] = torch.as_tensor(feature["position_ids"])
                positions[row, n:] = torch.arange(width - n)
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
        if packed:
            batch["position_ids"] = positions
        return batch
