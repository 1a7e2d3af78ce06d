"""Datasets -> chat messages -> token ids with only the model's own output trained, cached for every run.

sources (rows with their numbers) -> formats (rows -> conversations, and the row check) -> templates (the chat
template and its masking: chat_masking, masking_check) -> encoding (and truncation) -> preprocess (the driver, through
the training method's data half, which the caller passes: methods/sft_rows for SFT) -> cache (keys, statistics, the by-inputs index) -> tokenized (the arrays
training reads) -> batching and packing. cache.wait_for_cache is how a rank waits for the rank building the cache (handoff.py: the one wait).
Every name other modules import is exported here.
"""

from .batching import LengthGroupedSampler, PadCollator
from .cache import (
    DROP_WARNING_FRACTION, INPUTS_INDEX, PREPROCESS_VERSION, SKIPPED_FILE, STATS_FILE, DatasetStats, PreprocessReport,
    cache_dir, cache_entries, cache_key, cached_for_inputs, inputs_key, remember_inputs, wait_for_cache,
)
from .chat_masking import (
    IGNORE_INDEX, METHOD_MARKERS, METHOD_SPANS, METHOD_TWIN, MaskingPlan, content_text, encode_conversation, end_of_turn_token, normalize_message, plan_masking,
    render, special_strings, template_name,
)
from .encoding import Encoded, batch_targets, count_targets, encode_chat, encode_text, target_count
from .formats import (
    MESSAGE_KEYS, ROLE_NAMES, TOO_LONG, Conversation, DataError, RowProblem, check_row, detect_format, to_conversation,
)
from .masking_check import MaskingReport, check_masking
from .packing import PackedDataset, best_fit_decreasing
from .preprocess import (
    MASKING_SAMPLE, check_rows, invalid_rows_error, load_datasets, load_or_build, report_stats,
    tokenize_dataset, write_skipped_rows,
)
from .sources import RawRows, load_raw, read_rows
from .templates import (
    FALLBACK_CHAT_TEMPLATE, describe_plan, dropped_by_template, ensure_chat_template, load_tokenizer,
    resolve_chat_template,
)
from .tokenized import TokenizedDataset
