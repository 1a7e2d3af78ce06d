"""The tokenizer files llama.cpp's converter reads, for models saved by transformers 5 (used by publish/gguf.py only).

transformers 5 saves tokenizer.json and a tokenizer_config.json without `added_tokens_decoder`, and no longer the
SentencePiece `tokenizer.model` of Llama-2-style vocabularies (Llama 2, Mistral v0.1, Phi-3, ...). The converter
then either refuses the model (Phi-3 needs tokenizer.model; Qwen-architecture models fall back to a BPE whose
pre-tokenizer it must recognise by hash) or writes every token with the same score (Llama), so llama.cpp splits
words differently from the tokenizer the model was trained with, and the chat template's tokens (<|end|>) become
padding. The model folder is therefore staged for the converter: its files linked, tokenizer_config.json with the
added tokens written back, and tokenizer.model taken from the adapter or base model, or, failing that, rebuilt from
tokenizer.json when that is a byte-fallback BPE of SentencePiece's kind; a rebuilt model is used only when it
splits a sample text exactly as tokenizer.json does.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("praisonai_accel")

# Text the rebuilt SentencePiece model must split exactly as tokenizer.json does: spaces, digits, code, accents,
# emoji (byte fallback), CJK, and runs of whitespace.
SAMPLE = ("Hello world!  Two  spaces, a tab\tand\nnew lines\n\n 3.14159 1234567 x=[1,2,3]; def f(a): return a*2 "
          "naïve café Über straße 東京 에서 🦙🦙 ✅ -- == ... ''' \"quoted\" I've been told he's here. reverse the words: "
          "ada bob cy dee eve fay gus hal ivy jo")


LLAMA_CPP_NO_RSTRIP = ("<unk>", "<s>", "</s>", "<|endoftext|>")  # llama.cpp's phi-3 rule leaves these as they are


def stage_for_converter(model_dir: Path, stage: Path, tokenizer_sources: list[Path], tokenizer) -> Path:
    """A folder the converter reads: model_dir's files linked, with the tokenizer files it needs added."""
    model_dir, stage = Path(model_dir), Path(stage)
    stage.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "tokenizer_config.json":
            os.symlink(path.resolve(), stage / path.name)
    config_path = model_dir / "tokenizer_config.json"
    if config_path.is_file():
        config = _with_added_tokens(model_dir, json.loads(config_path.read_text()))
        (stage / "tokenizer_config.json").write_text(json.dumps(_with_bos_and_eos(config, tokenizer), ensure_ascii=False,
                                                                indent=2))
    if not (stage / "tokenizer.model").exists():
        for directory in tokenizer_sources:
            if directory is not None and (Path(directory) / "tokenizer.model").is_file():
                os.symlink((Path(directory) / "tokenizer.model").resolve(), stage / "tokenizer.model")
                break
        else:
            rebuilt = sentencepiece_model(model_dir / "tokenizer.json")
            if rebuilt is not None:
                (stage / "tokenizer.model").write_bytes(rebuilt)
                log.info("gguf: rebuilt the SentencePiece tokenizer.model from tokenizer.json (it splits a sample text "
                         "exactly as tokenizer.json does)")
    return stage


def _with_added_tokens(model_dir: Path, config: dict) -> dict:
    """tokenizer_config.json as transformers 4 wrote it: with added_tokens_decoder (id -> content, special)."""
    if "added_tokens_decoder" in config or not (model_dir / "tokenizer.json").is_file():
        return config
    added = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens") or []
    config = dict(config)
    config["added_tokens_decoder"] = {
        str(token["id"]): {key: token[key] for key in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
                           if key in token}
        for token in added
    }
    if "tokenizer_class" not in config:  # read unconditionally by the converter's Phi-3 class
        config["tokenizer_class"] = "LlamaTokenizer"
    return config


def _with_bos_and_eos(config: dict, tokenizer) -> dict:
    """add_bos_token / add_eos_token as the tokenizer behaves: llama.cpp adds bos to a SentencePiece vocabulary
    unless the GGUF says otherwise, and transformers 5 no longer writes these keys."""
    ids = tokenizer("a").input_ids
    config = dict(config)
    config.setdefault("add_bos_token", bool(ids) and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id)
    config.setdefault("add_eos_token", bool(ids) and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id)
    return config


def strips_after_special_tokens(model_dir: Path) -> bool:
    """Special tokens that swallow the whitespace after them (Phi-3's <|user|>\n). llama.cpp gives its tokens that
    behaviour only when the model's general.name says phi-3 (llama-vocab.cpp), so the name must say it."""
    try:
        added = json.loads((Path(model_dir) / "tokenizer.json").read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return False
    specials = [token for token in added if token.get("special") and token.get("content") not in LLAMA_CPP_NO_RSTRIP]
    return bool(specials) and all(token.get("rstrip") for token in specials)  # llama.cpp's rule, on the same tokens


def prefixes_after_special_tokens(model_dir: Path, tokenizer) -> bool | None:
    """For a SentencePiece-kind vocabulary: does the tokenizer put ▁ before text that follows a special token?
    (transformers 5 prefixes only the start of the text; older tokenizers every segment.) None for other kinds."""
    try:
        data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    special = next((t["content"] for t in data.get("added_tokens") or [] if t.get("special") and not t.get("rstrip")), None)
    if not _sentencepiece_kind(data) or special is None:
        return None
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(special + "a", add_special_tokens=False).input_ids)
    return len(pieces) > 1 and pieces[1].startswith("\u2581")


def _sentencepiece_kind(data: dict) -> bool:
    """A byte-fallback BPE that marks spaces with ▁ as SentencePiece does (Llama 2, Mistral v0.1, Phi-3)."""
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return False
    text = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")])
    return "\u2581" in text or "\\u2581" in text


def sentencepiece_model(tokenizer_json: Path) -> bytes | None:
    """A SentencePiece BPE model equivalent to tokenizer.json, or None when it is not of that kind or does not
    reproduce its splits. Each piece scores by the first merge that makes it, so merges apply in the same order."""
    try:
        data = json.loads(Path(tokenizer_json).read_text())
    except (OSError, ValueError):
        return None
    if not _sentencepiece_kind(data):
        return None
    try:
        from sentencepiece import SentencePieceProcessor
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as exc:  # sentencepiece_model_pb2 needs protobuf too
        log.info("gguf: %s is not installed; tokenizer.model cannot be rebuilt (pip install 'praisonai-accel[gguf]')",
                 "protobuf" if "google" in str(exc) or "protobuf" in str(exc) else exc.name or "sentencepiece")
        return None
    model = data["model"]
    vocab: dict[str, int] = model["vocab"]
    rank: dict[str, int] = {}
    for position, merge in enumerate(model.get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, position)
    specials = {token["content"]: token["id"] for token in data.get("added_tokens") or [] if token["id"] in vocab.values()}
    unk = model.get("unk_token")
    proto = pb.ModelProto()
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(vocab)
    spec.byte_fallback = True
    spec.unk_id = vocab.get(unk, 0)
    spec.bos_id = vocab.get("<s>", -1)
    spec.eos_id = vocab.get("</s>", -1)
    spec.pad_id = -1
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = True
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        piece = proto.pieces.add()
        piece.piece = token
        if token == unk:
            piece.type = pb.ModelProto.SentencePiece.UNKNOWN
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", token):
            piece.type = pb.ModelProto.SentencePiece.BYTE
        elif token in specials:
            piece.type = pb.ModelProto.SentencePiece.CONTROL
        else:
            piece.score = -float(rank.get(token, len(rank) + index))
    blob = proto.SerializeToString()
    processor = SentencePieceProcessor()
    processor.LoadFromSerializedProto(blob)
    from tokenizers import Tokenizer

    expected = Tokenizer.from_str(json.dumps(data)).encode(SAMPLE, add_special_tokens=False).ids
    if processor.encode(SAMPLE) != expected:
        log.info("gguf: tokenizer.model could not be rebuilt to split text as tokenizer.json does; the converter "
                 "reads tokenizer.json itself")
        return None
    return blob


def byte_level_pre_tokenizer(tokenizer_json: Path) -> str | None:
    """"gpt-2" for a BPE that pre-tokenizes exactly as GPT-2 does (ByteLevel with its regex, no prefix space, no
    normalizer), as the demo's tokenizer trained on the spot does. llama.cpp's converter knows pre-tokenizers only by
    the hash of a fixed text's tokens, which depends on the vocabulary, so it refuses such a tokenizer; told the name,
    it writes a GGUF whose tokenizer gguf_verify then checks against this one."""
    try:
        data = json.loads(Path(tokenizer_json).read_text())
    except (OSError, ValueError):
        return None
    pre = data.get("pre_tokenizer") or {}
    if ((data.get("model") or {}).get("type") == "BPE" and data.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space") and pre.get("use_regex", True)):
        return "gpt-2"
    return None
