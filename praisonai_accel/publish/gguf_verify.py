"""A GGUF export checked, never trusted (used by publish/gguf.py and `export gguf`): the file's own tokenizer
(llama.cpp's, in a child process) must encode a set of texts exactly as the Hugging Face tokenizer the model was
trained with does.

A converter that falls back to another vocabulary path (sentencepiece or protobuf missing, a tokenizer.model that
could not be rebuilt) writes a GGUF that runs and answers, but splits words differently from training ("reverse" in
3 pieces instead of 1); only comparing the ids finds it. The texts are the chat template rendered on sample rows of
the run's data where there are some, a conversation of our own with every kind of text (non-ASCII, digits, runs of
whitespace, several turns), and the special tokens between words. `export gguf` of a run finds the run's config
(run_conversations) and reads the same rows as the export after training.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config import load_config
from ..data.formats import check_row, detect_format, to_conversation
from ..data.sources import read_rows
from ..run_dir.checkpoints import step_of
from . import gguf_engine
from .gguf_llamacpp import GGUFError

log = logging.getLogger("praisonai_accel")

OWN_CONVERSATION = [
    {"role": "system", "content": "Be brief.  Naïve café, Über straße, 東京 에서 🦙 ✅, 3.14159 x=[1,2,3];"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello there,\n\n  I've been told he's here."},
    {"role": "user", "content": "reverse the words:\n\nada\tbob  cy\n"},
]
SAMPLE_ROWS = 4


def sample_conversations(config, count: int = SAMPLE_ROWS) -> list[list[dict]]:
    """The first rows of the run's first dataset as conversations; none where it cannot be read here (a Hub dataset
    offline, a preference format): the other texts are still checked."""
    try:
        spec = config.dataset[0]
        rows = read_rows(spec)
        fmt = detect_format(rows.columns, spec)
        conversations = []
        for _, row in rows:
            if len(conversations) == count:
                break
            if isinstance(row, dict) and check_row(row, fmt, spec) is None:
                conversation = to_conversation(row, fmt, spec)
                if not isinstance(conversation, str):
                    conversations.append(conversation.messages)
        return conversations
    except Exception as exc:  # the check goes on with our own texts, and the user has nothing to do about it
        log.debug("gguf: no sample rows of the run's data for the tokenizer check (%s)", exc)
        return []


def run_conversations(path: Path, model_dir: Path, count: int = SAMPLE_ROWS) -> list[list[dict]]:
    """sample_conversations of the run `model_dir` was trained in, for `export gguf PATH`; none for a bare model."""
    config = run_config(Path(path), Path(model_dir))
    return sample_conversations(config, count) if config is not None else []


def run_config(path: Path, model_dir: Path):
    """The config of the run that wrote `model_dir`, or None. Its progress.json (in PATH, the output_dir, or beside
    the model: a final model, or a checkpoint's adapter) names the config file the run was started with. None where
    the run predates that record, or the config has since moved, changed or no longer names this model."""
    places = [path, model_dir.parent]
    if step_of(model_dir.parent) >= 0:
        places.append(model_dir.parent.parent)
    for output_dir in dict.fromkeys(p.resolve() for p in places):
        try:
            progress = json.loads((output_dir / "progress.json").read_text())
            config_file, final = Path(progress["config_file"]), progress["final_model_dir"]
            config = load_config(config_file)
        except Exception:  # no record, an older run's, or a config that moved or no longer loads
            continue
        if str(config.final_model_path()) == str(final):
            return _data_beside(config, config_file.parent)
    return None


def _data_beside(config, config_dir: Path):
    """A relative dataset path is relative to where training ran; where that is not here, the config's folder."""
    spec = config.dataset[0] if config.dataset else None
    if spec is not None and not Path(spec.name).expanduser().exists() and (config_dir / spec.name).exists():
        config.dataset[0] = spec.model_copy(update={"name": str(config_dir / spec.name)})
    return config


def texts_to_check(tokenizer, conversations: list[list[dict]] = ()) -> list[str]:
    texts = []
    if getattr(tokenizer, "chat_template", None):
        for messages in [*conversations, OWN_CONVERSATION]:
            for prompt_only in (False, True):
                turns = messages[:-1] if prompt_only and messages[-1]["role"] == "assistant" else messages
                try:
                    texts.append(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt_only))
                except Exception:  # a template that refuses a system turn, or needs tools: the others are checked
                    continue
    else:
        texts += [m["content"] for messages in [*conversations, OWN_CONVERSATION] for m in messages]
    specials = [t for t in tokenizer.all_special_tokens if t]
    if specials:
        texts.append("".join(f"{token}ada bob " for token in specials))
    return list(dict.fromkeys(texts))


def check_tokenizer(files: list[Path], tokenizer, texts: list[str]) -> None:
    """GGUFError naming the first text a file encodes differently from the tokenizer, with both ids."""
    encoded = gguf_engine.tokenize(files, texts)
    for file in files:
        for text, got in zip(texts, encoded[str(file)]):
            want = tokenizer(text).input_ids
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                raise GGUFError(
                    f"{Path(file).name}: llama.cpp's tokenizer in the GGUF does not encode {_short(text)!r} as the "
                    f"model's tokenizer does ({len(got)} tokens, not {len(want)}; from token {at}: "
                    f"{got[at:at + 6]} instead of {want[at:at + 6]}), so the file would not be the model that was "
                    f"trained; nothing was written{_hint()}")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _hint() -> str:
    """What usually makes the converter fall back to another vocabulary: a missing sentencepiece or protobuf."""
    missing = [name for name, module in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
               if _find(module) is None]
    return f" (missing: {', '.join(missing)}; pip install 'praisonai-accel[gguf]')" if missing else ""


def _find(module: str):
    import importlib.util

    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
