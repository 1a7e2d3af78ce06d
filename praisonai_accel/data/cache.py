"""The preprocessing cache: entries keyed by everything that shapes them (sources, tokenizer, settings,
PREPROCESS_VERSION), the statistics kept with each entry, and the by-inputs index that lets the launcher see a filled
cache without loading a tokenizer."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import write_text_atomic
from ..config import DatasetSpec, TrainConfig
from ..runtime.handoff import HandoffFailed, wait_for
from .formats import DataError
from .sources import _local_path
from .templates import resolve_chat_template
from .tokenized import TokenizedDataset
from .vision_processor import processor_of

PREPROCESS_VERSION = "5"  # bump when tokenisation or the row checks change, to invalidate caches
DROP_WARNING_FRACTION = 0.05
STATS_FILE = "praisonai_stats.json"
SKIPPED_FILE = "skipped_rows.jsonl"  # every row not trained, with its number and reason


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
        "skip_invalid_rows": config.skip_invalid_rows,
        **method_identity(config),
        **image_identity(tokenizer),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def method_identity(config: TrainConfig) -> dict:
    """What of the training method changes the encoded examples (the method says: methods/base.cache_identity)."""
    return type(config).training_method.cache_identity(config)


def image_identity(tokenizer) -> dict:
    """A vision-language model's processor settings: how many tokens an image becomes is the image processor's and
    the processor's own (Idefics3's image_seq_len, Gemma 3's image_seq_length, LLaVA's patch_size); the tokenizer
    and chat template are keyed already. Nothing for text. The image files are not keyed: each reference keeps the
    size preprocessing read, and the collator refuses an image that is no longer that size."""
    processor = processor_of(tokenizer)
    if processor is None:
        return {}
    settings = {k: v for k, v in processor.to_dict().items() if k not in ("tokenizer", "chat_template")}
    return {"processor": settings}


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
    invalid: int = 0  # rows that do not fit the format (skipped: skip_invalid_rows)
    invalid_by_reason: dict[str, int] = field(default_factory=dict)
    format: str = ""  # the rows' format (alpaca, messages, text, ...): eval renders a run's prompts as it trained them

    def line(self) -> str:
        skipped = f", {self.invalid} invalid skipped" if self.invalid else ""
        return (f"{self.name}: {self.examples} of {self.rows} examples, {self.truncated} truncated "
                f"({self.response_cut} with the response cut), {self.dropped} dropped{skipped}; labels: {self.masking}")


@dataclass
class PreprocessReport:
    """What preprocessing did to every dataset of a run (a DatasetStats each). `skipped` (invalid rows skipped, by
    reason, train and eval together) and `skipped_file` are set by load_datasets for the run at hand."""

    datasets: list[DatasetStats] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_file: str = ""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([asdict(d) for d in self.datasets], indent=2))

    @classmethod
    def load(cls, path: Path) -> "PreprocessReport":
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
        if self.skipped:
            counts = ", ".join(f"{count} {kind}" for kind, count in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
            lines.append(f"skipped {sum(self.skipped.values())} invalid rows (skip_invalid_rows: true): {counts}; each "
                         f"with its number and reason in {self.skipped_file or 'output_dir/logs/skipped_rows.jsonl'}")
        return lines


def cache_dir(config: TrainConfig) -> Path:
    """Where tokenized datasets are kept: entries are keyed by everything that shapes them, so one directory can
    serve many runs and output directories."""
    if config.dataset_prepared_path:
        return Path(config.dataset_prepared_path)
    return config.output_path() / ".cache" / "preprocessed"


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
            "skip_invalid_rows": config.skip_invalid_rows,
            **method_identity(config),
            # the image processor's pixel budget (cache_key reads it from the processor itself)
            **{key: getattr(config, key) for key in ("image_max_pixels", "image_min_pixels") if getattr(config, key)},
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
        write_text_atomic(index, json.dumps({"entries": [entry.name for entry in entries]}))
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
    """Wait (handoff.wait_for: the file system, no time limit) until the rank building the cache has finished it;
    if the builder fails it writes `failed`, and this rank stops too; if it dies, the launcher stops this rank."""
    entries = cache_entries(config, tokenizer)

    def ready():
        return True if all(TokenizedDataset.exists(e) and (e / STATS_FILE).exists() for e in entries) else None

    def failure():
        return (f"preprocessing failed on the rank building the cache ({failed.read_text().strip()})"
                if failed.exists() else None)

    try:
        wait_for(ready, failure, poll_seconds)
    except HandoffFailed as exc:
        raise DataError(str(exc)) from None
