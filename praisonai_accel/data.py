"""Datasets → chat messages → token ids with the prompt masked out of the loss.

Every supported format is first turned into a list of {role, content} messages (or plain text),
rendered with the tokenizer's chat template, and labelled by character span: tokens that fall
inside an assistant reply are trained, everything else gets -100.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from .config import DatasetSpec, TrainConfig
from .errors import first_line

IGNORE_INDEX = -100
PREPROCESS_VERSION = "1"  # bump when tokenisation changes, to invalidate caches

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bot": "assistant", "model": "assistant",
    "system": "system",
}
# Used only when the tokenizer ships no chat template (base models); saved with the tokenizer.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
    "{% else %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)

log = logging.getLogger(__name__)


class DataError(Exception):
    """Bad or unusable training data, phrased for the user."""


# ---------------------------------------------------------------- loading

def _local_path(spec: DatasetSpec) -> Path | None:
    path = Path(spec.name).expanduser()
    return path if path.exists() else None


def load_raw(spec: DatasetSpec):
    import datasets

    path = _local_path(spec)
    try:
        if path is not None and path.is_file():
            loader = LOCAL_LOADERS.get(path.suffix.lower())
            if loader is None:
                raise DataError(f"dataset {spec.name}: unsupported file type '{path.suffix}' (use {', '.join(LOCAL_LOADERS)})")
            data = datasets.load_dataset(loader, data_files=str(path), split="train")
        elif path is not None:
            data = datasets.load_dataset(str(path), data_files=spec.data_files, split=spec.split)
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
    return data


def detect_format(columns: Iterable[str], spec: DatasetSpec) -> str:
    if spec.format != "auto":
        return spec.format
    columns = set(columns)
    if {"instruction", "output"} <= columns:
        return "alpaca"
    if "conversations" in columns:
        return "sharegpt"
    if "messages" in columns:
        return "messages"
    if spec.text_field in columns:
        return "text"
    raise DataError(
        f"dataset {spec.name}: cannot tell its format from columns {sorted(columns)}; set format: alpaca | sharegpt | messages | text"
    )


# ---------------------------------------------------------------- example → messages

def to_messages(example: dict, fmt: str, spec: DatasetSpec) -> list[dict] | str:
    """One row as chat messages, or as plain text for format: text."""
    if fmt == "text":
        return str(example[spec.text_field])
    if fmt == "alpaca":
        prompt = str(example["instruction"])
        if example.get("input"):
            prompt += "\n\n" + str(example["input"])
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(example["output"])}]
    elif fmt == "sharegpt":
        messages = [
            {"role": ROLE_NAMES.get(str(turn.get("from", turn.get("role"))).lower(), "user"),
             "content": str(turn.get("value", turn.get("content", "")))}
            for turn in example["conversations"]
        ]
    else:
        messages = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in example["messages"]]
    if spec.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    return messages


def assistant_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant reply (end-of-turn included)."""
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs else ""
    text = render(messages)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, through = render(messages[:index], True), render(messages[: index + 1])
        if through.startswith(prompt) and text.startswith(through):
            # The turn separator after the end-of-turn token (often "\n") belongs to no one.
            spans.append((len(prompt), len(through.rstrip())))
            cursor = len(through)
            continue
        # Templates that rewrite earlier turns: fall back to finding the reply text itself.
        start = text.find(message["content"], cursor)
        if start < 0:
            continue
        end = start + len(message["content"])
        eos = tokenizer.eos_token or ""
        if eos and text.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
        cursor = end
    return text, spans


def tokenize_example(item: list[dict] | str, tokenizer, max_seq_length: int, train_on_inputs: bool) -> dict:
    if isinstance(item, str):
        ids = tokenizer(item, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        ids = ids[:max_seq_length]
        return {"input_ids": ids, "labels": list(ids)}
    text, spans = assistant_spans(item, tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:max_seq_length]
    offsets = encoded["offset_mapping"][: len(ids)]
    if train_on_inputs:
        labels = list(ids)
    else:
        labels = [
            token if any(s <= start < e for s, e in spans) else IGNORE_INDEX
            for token, (start, _end) in zip(ids, offsets)
        ]
    return {"input_ids": ids, "labels": labels}


# ---------------------------------------------------------------- the training set

def ensure_chat_template(tokenizer, override: str | None = None) -> None:
    if override:
        tokenizer.chat_template = override
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def _source_identity(spec: DatasetSpec) -> Any:
    path = _local_path(spec)
    if path is None:
        return spec.model_dump()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [spec.model_dump(), [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]]


def cache_key(specs: list[DatasetSpec], tokenizer, config: TrainConfig) -> str:
    vocab_digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    identity = {
        "version": PREPROCESS_VERSION,
        "sources": [_source_identity(s) for s in specs],
        "tokenizer": [vocab_digest, tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token],
        "max_seq_length": config.max_seq_length,
        "train_on_inputs": config.train_on_inputs,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def tokenize_dataset(specs: list[DatasetSpec], tokenizer, config: TrainConfig):
    import datasets

    parts = []
    for spec in specs:
        raw = load_raw(spec)
        fmt = detect_format(raw.column_names, spec)

        def encode(example, _fmt=fmt, _spec=spec):
            try:
                item = to_messages(example, _fmt, _spec)
            except (KeyError, TypeError) as exc:
                raise DataError(f"dataset {_spec.name}: a row does not fit format '{_fmt}' (missing {exc})") from None
            return tokenize_example(item, tokenizer, config.max_seq_length, config.train_on_inputs)

        try:
            encoded = raw.map(encode, remove_columns=raw.column_names, num_proc=config.dataset_num_proc,
                              desc=f"tokenizing {Path(spec.name).name}", load_from_cache_file=False)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"dataset {spec.name}: {type(exc).__name__}: {first_line(exc, '')}") from None
        parts.append(encoded)
    data = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    trained = data.map(lambda ex: {"num_target_tokens": sum(1 for x in ex["labels"][1:] if x != IGNORE_INDEX),
                                   "length": len(ex["input_ids"])}, load_from_cache_file=False)
    kept = trained.filter(lambda ex: ex["num_target_tokens"] > 0, load_from_cache_file=False)
    if len(kept) == 0:
        raise DataError("dataset: no example has any response token left to train on (check format and max_seq_length)")
    return kept, len(trained) - len(kept)


def load_or_build(specs: list[DatasetSpec], tokenizer, config: TrainConfig, cache_root: Path):
    """Tokenize once and keep the result on disk; later runs and other ranks load it."""
    import datasets

    target = Path(cache_root) / cache_key(specs, tokenizer, config)
    if (target / "dataset_info.json").exists():
        return datasets.load_from_disk(str(target)), True
    data, dropped = tokenize_dataset(specs, tokenizer, config)
    if dropped:
        log.warning("dropped %d example(s) with no response tokens within max_seq_length", dropped)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    data.save_to_disk(str(tmp))
    if target.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return datasets.load_from_disk(str(target)), False


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
    """Right-pads a batch to its longest example; padding never counts toward the loss."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(features), width), dtype=torch.long)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[row, :n] = torch.as_tensor(feature["input_ids"])
            labels[row, :n] = torch.as_tensor(feature["labels"])
            attention[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
