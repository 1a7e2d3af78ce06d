"""Datasets → chat messages → token ids with only the model's own output trained.

Every supported format is first turned into a conversation (messages, plus a per-row tool list) or
plain text. Conversations are labelled by `chat_masking`; long ones are shortened from the prompt
side so the response survives (`truncation: keep_response`). Tokenisation runs once and is cached
with per-dataset statistics, so every run, cached or not, says what was truncated and dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .chat_masking import (
    IGNORE_INDEX, MaskingPlan, MaskingReport, check_masking, content_text, encode_conversation, plan_masking,
)
from .config import LOCAL_DATA_LOADERS, DatasetSpec, TrainConfig
from .errors import first_line
from .tokenized import TokenizedDataset

PREPROCESS_VERSION = "3"  # bump when tokenisation changes, to invalidate caches
MASKING_SAMPLE = 32  # examples per dataset checked against the masking guarantee
DROP_WARNING_FRACTION = 0.05

ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bot": "assistant", "model": "assistant", "function_call": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
}
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "thinking", "reasoning")
# Used only when the tokenizer ships no chat template (base models); saved with the tokenizer.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
    "{% else %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)

log = logging.getLogger("praisonai_accel")


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


# ---------------------------------------------------------------- row → conversation

@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None


def _tools_of(example: dict) -> list[dict] | None:
    tools = example.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    return list(tools) if tools else None


def _sharegpt_turn(turn: dict) -> dict:
    raw_role = str(turn.get("from", turn.get("role"))).lower()
    content = turn.get("value", turn.get("content", ""))
    message = {"role": ROLE_NAMES.get(raw_role, "user"), "content": content if isinstance(content, (str, list)) else str(content)}
    if raw_role == "function_call":  # LLaMA-Factory's sharegpt: the call as JSON in the value
        try:
            call = json.loads(message["content"])
            message = {"role": "assistant", "content": "",
                       "tool_calls": [{"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}]}
        except (ValueError, KeyError, TypeError):
            pass
    return message


def to_conversation(example: dict, fmt: str, spec: DatasetSpec) -> Conversation | str:
    """One row as a conversation, or as plain text for format: text."""
    if fmt == "text":
        return str(example[spec.text_field])
    if fmt == "alpaca":
        prompt = str(example["instruction"])
        if example.get("input"):
            prompt += "\n\n" + str(example["input"])
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(example["output"])}]
    elif fmt == "sharegpt":
        messages = [_sharegpt_turn(turn) for turn in example["conversations"]]
    else:
        messages = [{k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None} for m in example["messages"]]
        for message in messages:
            message["role"] = ROLE_NAMES.get(str(message["role"]).lower(), str(message["role"]))
    if spec.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    return Conversation(messages, _tools_of(example))


# ---------------------------------------------------------------- conversation → tokens

@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False
    dropped: bool = False
    response_cut: bool = False


def encode_text(text: str, tokenizer, max_seq_length: int) -> Encoded:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return Encoded(ids[:max_seq_length], list(ids[:max_seq_length]), truncated=len(ids) > max_seq_length)


def encode_chat(conversation: Conversation, tokenizer, plan: MaskingPlan, max_seq_length: int,
                train_on_inputs: bool = False, truncation: str = "keep_response",
                excess_length_strategy: str = "truncate") -> Encoded:
    """Tokens and labels of a conversation that fits in max_seq_length.

    keep_response: a conversation that is too long loses its oldest turns first, then the start of the
    last user turn, never the response (the turns after the last user message). When even the response
    alone does not fit, it keeps the end of the prompt and the start of the response (excess_length_strategy
    truncate) or is dropped (drop). right: cut at max_seq_length.
    """
    messages = plan.prepare(conversation.messages)

    def encode(msgs: list[dict]) -> tuple[list[int], list[int]]:
        return encode_conversation(tokenizer, plan, msgs, conversation.tools, train_on_inputs)

    ids, labels = encode(messages)
    if len(ids) <= max_seq_length:
        return Encoded(ids, labels)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if truncation == "right" or not users:
        return Encoded(ids[:max_seq_length], labels[:max_seq_length], truncated=True)
    last_user = users[-1]
    head = [m for m in messages[:last_user] if m["role"] == "system"]
    history = [m for m in messages[:last_user] if m["role"] != "system"]
    response = messages[last_user + 1:]
    while history:  # the oldest exchange first: a user turn and what answered it
        cut = next((i for i, m in enumerate(history) if i > 0 and m["role"] == "user"), len(history))
        history = history[cut:]
        ids, labels = encode(head + history + messages[last_user:])
        if len(ids) <= max_seq_length:
            return Encoded(ids, labels, truncated=True)
    fitted = _cut_user_turn(encode, head, messages[last_user], response, tokenizer, max_seq_length)
    if fitted:
        return Encoded(*fitted, truncated=True)
    if excess_length_strategy == "drop":
        return Encoded([], [], truncated=True, dropped=True)
    ids, labels = encode(head + messages[last_user:])
    return Encoded(*_cut_response(ids, labels, tokenizer, max_seq_length), truncated=True, response_cut=True)


def _cut_response(ids: list[int], labels: list[int], tokenizer, max_seq_length: int) -> tuple[list[int], list[int]]:
    """A conversation whose response alone is too long: the end of its prompt, at most half of max_seq_length
    (after bos, kept where the tokenizer writes one), then as much of the response as fits. The response's end,
    its end-of-turn token with it, is cut off, so the model is never taught to stop where the cut falls."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), 0)
    bos = 1 if first and ids[0] == getattr(tokenizer, "bos_token_id", None) else 0
    start = max(bos, first - max(max_seq_length // 2 - bos, 0))
    ids, labels = ids[:bos] + ids[start:], labels[:bos] + labels[start:]
    return ids[:max_seq_length], labels[:max_seq_length]


def _cut_user_turn(encode, head, user: dict, response, tokenizer, max_seq_length: int):
    """The longest tail of the user turn's text for which the conversation fits (binary search)."""
    content_ids = tokenizer(content_text(user["content"]), add_special_tokens=False)["input_ids"]

    def attempt(keep: int):
        text = tokenizer.decode(content_ids[len(content_ids) - keep:]) if keep else ""
        content = text if isinstance(user["content"], str) else [{"type": "text", "text": text}]
        ids, labels = encode(head + [{**user, "content": content}] + response)
        return (ids, labels) if len(ids) <= max_seq_length else None

    best = attempt(0)
    if best is None:
        return None
    low, high = 0, len(content_ids)
    while low < high:
        middle = (low + high + 1) // 2
        fitted = attempt(middle)
        if fitted is not None:
            best, low = fitted, middle
        else:
            high = middle - 1
    return best


def count_targets(labels) -> int:
    """Tokens the loss is computed on: every labelled token except the first, which nothing predicts."""
    return sum(1 for x in labels[1:] if x != IGNORE_INDEX)


def quiet_datasets(progress: bool = False) -> None:
    """Errors only from `datasets`, and its progress bars only when asked (a terminal): it reads these variables
    when it is imported."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "0" if progress else "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")


def batch_targets(batch) -> int:
    """count_targets over a padded batch (padding is IGNORE_INDEX, so it never counts)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


# ---------------------------------------------------------------- the training set

def resolve_chat_template(value: str) -> str:
    """chat_template as written in config.yaml: Jinja text, or the path of a file holding it (a .jinja file).
    A value that is neither is refused rather than rendered as literal text around every conversation."""
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(f"chat_template: '{value}' is neither a Jinja template nor an existing file")
    text = path.read_text(encoding="utf-8")
    if "{%" not in text and "{{" not in text:
        raise DataError(f"chat_template: {path} holds no Jinja template ({{% ... %}} or {{{{ ... }}}})")
    return text


def _adds_bos(tokenizer) -> bool:
    """Would this tokenizer put bos in front of a text (Llama, Mistral and Gemma base models do)?"""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]


def ensure_chat_template(tokenizer, override: str | None = None) -> None:
    if override:
        tokenizer.chat_template = resolve_chat_template(override)
    elif not getattr(tokenizer, "chat_template", None):
        # Texts are tokenized without special tokens (the template writes them), so bos is written here when the
        # tokenizer would have added it: base Llama, Mistral and Gemma models are trained with it.
        tokenizer.chat_template = ("{{ bos_token }}" if _adds_bos(tokenizer) else "") + FALLBACK_CHAT_TEMPLATE
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
        "tokenizer": [vocab_digest, tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token,
                      tokenizer.bos_token],
        "max_seq_length": config.max_seq_length,
        "train_on_inputs": config.train_on_inputs,
        "truncation": config.truncation,
        "excess_length_strategy": config.excess_length_strategy,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass
class DatasetStats:
    """What preprocessing did to one dataset; saved with the cache so every run can report it."""

    name: str
    rows: int = 0
    examples: int = 0  # kept
    truncated: int = 0
    response_cut: int = 0  # of the truncated: even the response did not fit, its end was cut
    dropped: int = 0
    tokens: int = 0
    target_tokens: int = 0
    masking: str = ""
    masking_problems: str = ""

    def line(self) -> str:
        return (f"{self.name}: {self.examples} of {self.rows} examples, {self.truncated} truncated "
                f"({self.response_cut} with the response cut), {self.dropped} dropped; labels: {self.masking}")


@dataclass
class DataStats:
    datasets: list[DatasetStats] = field(default_factory=list)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([asdict(d) for d in self.datasets], indent=2))

    @classmethod
    def load(cls, path: Path) -> "DataStats":
        return cls([DatasetStats(**d) for d in json.loads(path.read_text())]) if path.exists() else cls()

    def warnings(self) -> list[str]:
        lines = []
        for d in self.datasets:
            if d.rows and d.dropped / d.rows > DROP_WARNING_FRACTION:
                lines.append(f"dataset {d.name}: {d.dropped} of {d.rows} examples ({d.dropped / d.rows:.0%}) dropped: "
                             "even their response does not fit in max_seq_length; raise max_seq_length or set "
                             "excess_length_strategy: truncate to keep them")
            if d.masking_problems:
                lines.append(f"dataset {d.name}: chat template {d.masking}: {d.masking_problems}")
        return lines


def _encoder(tokenizer, plan: MaskingPlan, config: TrainConfig, spec: DatasetSpec, fmt: str):
    def encode(example: dict) -> Encoded:
        try:
            item = to_conversation(example, fmt, spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"dataset {spec.name}: a row does not fit format '{fmt}' (missing {exc})") from None
        if isinstance(item, str):
            return encode_text(item, tokenizer, config.max_seq_length)
        try:
            return encode_chat(item, tokenizer, plan, config.max_seq_length, config.train_on_inputs, config.truncation,
                               config.excess_length_strategy)
        except DataError:
            raise
        except Exception as exc:  # jinja2 TemplateError and friends: the template rejects this conversation
            raise DataError(f"dataset {spec.name}: the chat template ({plan.name}) cannot render a row: "
                            f"{type(exc).__name__}: {first_line(exc, '')}") from None
    return encode


def describe_plan(plan: MaskingPlan) -> str:
    """How labels are made, for the log: `qwen3 (trl training template, recognised by rendering)`."""
    how = f", recognised by {plan.recognised_by}" if plan.recognised_by == "rendering" else ""
    return f"{plan.name} ({plan.method}{how})"


def _check_sample(raw, fmt: str, spec: DatasetSpec, tokenizer, plan: MaskingPlan, config: TrainConfig) -> str:
    """The masking guarantee, checked on the first examples of a dataset; '' when it holds."""
    if fmt == "text" or config.train_on_inputs:
        return ""
    report = MaskingReport()
    for example in raw.select(range(min(MASKING_SAMPLE, len(raw)))):
        conversation = to_conversation(example, fmt, spec)
        messages = plan.prepare(conversation.messages)
        encoded = encode_chat(conversation, tokenizer, plan, config.max_seq_length, False, config.truncation,
                              config.excess_length_strategy)
        if not encoded.truncated:
            check_masking(tokenizer, plan, messages, conversation.tools, encoded.labels, encoded.input_ids, report)
    return report.summary()


def tokenize_dataset(specs: list[DatasetSpec], tokenizer, config: TrainConfig):
    """The tokenized examples of every dataset, concatenated, and what happened to each dataset."""
    import datasets

    plan = plan_masking(tokenizer)
    parts, stats = [], DataStats()
    for index, spec in enumerate(specs):
        raw = load_raw(spec)
        fmt = detect_format(raw.column_names, spec)
        encode = _encoder(tokenizer, plan, config, spec, fmt)

        def row(example, _encode=encode, _index=index):
            encoded = _encode(example)
            return {"input_ids": encoded.input_ids, "labels": encoded.labels, "truncated": encoded.truncated,
                    "response_cut": encoded.response_cut,
                    "num_target_tokens": count_targets(encoded.labels), "length": len(encoded.input_ids),
                    "source": _index}

        try:
            encoded = raw.map(row, remove_columns=raw.column_names, num_proc=config.dataset_num_proc,
                              load_from_cache_file=False)
        except DataError:
            raise
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, DataError) else None
            if cause is not None:
                raise cause from None
            raise DataError(f"dataset {spec.name}: {type(exc).__name__}: {first_line(exc, '')}") from None
        kept = encoded.filter(lambda ex: ex["num_target_tokens"] > 0, load_from_cache_file=False)
        stats.datasets.append(DatasetStats(
            name=spec.name, rows=len(raw), examples=len(kept), truncated=sum(kept["truncated"]),
            response_cut=sum(kept["response_cut"]),
            dropped=len(encoded) - len(kept), tokens=sum(kept["length"]), target_tokens=sum(kept["num_target_tokens"]),
            masking=describe_plan(plan),
            masking_problems="" if fmt == "text" else _check_sample(raw, fmt, spec, tokenizer, plan, config),
        ))
        parts.append(kept)
    data = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(data) == 0:
        raise DataError("dataset: no example has any response token left to train on (check format and max_seq_length)")
    return TokenizedDataset.from_columns(data["input_ids"], data["labels"], data["truncated"], data["source"]), stats


STATS_FILE = "praisonai_stats.json"


def load_or_build(specs: list[DatasetSpec], tokenizer, config: TrainConfig, cache_root: Path):
    """Tokenize once and keep the result, with its statistics, on disk; later runs and other ranks load it.

    Returns (TokenizedDataset, stats, from_cache)."""
    return _load_or_build_at(Path(cache_root) / cache_key(specs, tokenizer, config), specs, tokenizer, config)


def _load_or_build_at(target: Path, specs: list[DatasetSpec], tokenizer, config: TrainConfig):
    if TokenizedDataset.exists(target) and (target / STATS_FILE).exists():
        return TokenizedDataset.load(target), DataStats.load(target / STATS_FILE), True
    data, stats = tokenize_dataset(specs, tokenizer, config)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    data.save(tmp)
    stats.save(tmp / STATS_FILE)
    if target.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return TokenizedDataset.load(target), stats, False


def cache_dir(config: TrainConfig) -> Path:
    """Where tokenized datasets are kept: entries are keyed by everything that shapes them, so one directory can
    serve many runs and output directories."""
    if config.dataset_prepared_path:
        return Path(config.dataset_prepared_path)
    return config.output_path() / ".cache" / "preprocessed"


def load_datasets(config: TrainConfig, tokenizer):
    """The tokenized training set, its statistics, whether it came from the cache, and the eval set (or None):
    what training, `preprocess` and `preview` all read, from one cache."""
    entries = cache_entries(config, tokenizer)  # keying hashes the whole vocabulary: once per entry
    train, stats, cached = _load_or_build_at(entries[0], config.dataset, tokenizer, config)
    evaluation = _load_or_build_at(entries[1], config.eval_dataset, tokenizer, config)[0] if len(entries) > 1 else None
    remember_inputs(config, entries)
    return train, stats, cached, evaluation


# The cache is keyed by the loaded tokenizer, and loading one imports torch and transformers: seconds of CPU that
# `praisonai-accel train` would spend while its workers start. For a tokenizer in a local folder, the files it is
# read from (and the library versions reading them) say the same, so an index from them to the cache entries lets
# the launcher see a filled cache without a tokenizer. The workers still load their tokenizer and key the cache
# with it: an index that is wrong can only cost them a tokenization, never hand them another run's data.
INPUTS_INDEX = "by-inputs"


def inputs_key(config: TrainConfig) -> str | None:
    """A key for everything preprocessing reads, taken from files rather than a loaded tokenizer; None when the
    tokenizer is not a local folder (a Hub id is only known by loading it)."""
    from importlib.metadata import PackageNotFoundError, version

    folder = Path(config.tokenizer_name or config.model_name).expanduser()
    if not folder.is_dir():
        return None
    try:
        template = resolve_chat_template(config.chat_template) if config.chat_template else None
        files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()]
        versions = []
        for package in ("transformers", "tokenizers", "trl"):
            try:
                versions.append(version(package))
            except PackageNotFoundError:
                versions.append(None)
        identity = {
            "version": PREPROCESS_VERSION,
            "tokenizer": [str(folder.resolve()), files, template, config.trust_remote_code, versions],
            "train": [_source_identity(s) for s in config.dataset],
            "eval": [_source_identity(s) for s in config.eval_dataset or []],
            "max_seq_length": config.max_seq_length,
            "train_on_inputs": config.train_on_inputs,
            "truncation": config.truncation,
            "excess_length_strategy": config.excess_length_strategy,
        }
    except (OSError, DataError):
        return None  # the tokenizer path says why
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def remember_inputs(config: TrainConfig, entries: list[Path]) -> None:
    """Index the cache entries of this config (from cache_entries) by inputs_key."""
    key = inputs_key(config)
    if key is None:
        return
    index = cache_dir(config) / INPUTS_INDEX / f"{key}.json"
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"{index.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"entries": [entry.name for entry in entries]}))
        os.replace(tmp, index)
    except OSError:
        pass  # a read-only cache only loses the shortcut


def cached_for_inputs(config: TrainConfig) -> bool:
    """Whether the cache holds this config's datasets, known without loading the tokenizer (see INPUTS_INDEX)."""
    key = inputs_key(config)
    if key is None:
        return False
    try:
        entries = json.loads((cache_dir(config) / INPUTS_INDEX / f"{key}.json").read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    expected = 1 + bool(config.eval_dataset)
    if not isinstance(entries, list) or len(entries) != expected or not all(isinstance(e, str) for e in entries):
        return False
    folders = [cache_dir(config) / entry for entry in entries]
    return all(f.parent == cache_dir(config) and TokenizedDataset.exists(f) and (f / STATS_FILE).exists()
               for f in folders)


def cache_entries(config: TrainConfig, tokenizer) -> list[Path]:
    """The cache entries this config trains and evaluates on."""
    return [Path(cache_dir(config)) / cache_key(specs, tokenizer, config)
            for specs in (config.dataset, config.eval_dataset) if specs]


def wait_for_cache(config: TrainConfig, tokenizer, failed: Path, poll_seconds: float = 0.2) -> None:
    """Wait, through the file system and with no time limit, until the rank building the cache has finished it.

    No collective is involved, so a preprocessing longer than ddp_timeout cannot time the other ranks out. If the
    builder fails it writes `failed`, and this rank stops too; if it dies, the launcher stops this rank."""
    entries = cache_entries(config, tokenizer)
    while not all(TokenizedDataset.exists(e) and (e / STATS_FILE).exists() for e in entries):
        if failed.exists():
            raise DataError(f"preprocessing failed on the rank building the cache ({failed.read_text().strip()})")
        time.sleep(poll_seconds)


PREPROCESSING_ENV = "PRAISONAI_ACCEL_PREPROCESSING"  # the status file of a launcher that tokenizes for its workers


def write_preprocessing_status(path: Path, status: str, error: str = "", cached: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"status": status, "error": error, "cached": cached}))
    os.replace(tmp, path)


def wait_for_launcher(status_file: Path, poll_seconds: float = 0.2) -> bool:
    """Wait, through the file system and with no time limit, for `praisonai-accel train`, which tokenizes while
    its workers start; its error, if it failed, becomes this rank's. Returns whether it found the cache filled."""
    while True:
        try:
            status = json.loads(status_file.read_text())
        except (OSError, ValueError):
            status = {"status": "running"}
        if status["status"] == "done":
            return bool(status.get("cached"))
        if status["status"] == "failed":
            raise DataError(status["error"])
        time.sleep(poll_seconds)


def report_stats(stats: DataStats, cached: bool) -> None:
    """Every run, cached or not, says what preprocessing kept, cut and dropped, per dataset."""
    for d in stats.datasets:
        log.info("data: %s%s", d.line(), " (cached)" if cached else "")
    for warning in stats.warnings():
        log.warning("warning: %s", warning)


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
