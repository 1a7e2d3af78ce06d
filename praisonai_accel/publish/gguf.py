"""GGUF export: a trained adapter (or full model) as GGUF files that llama.cpp, Ollama and LM Studio run.

The adapter is merged into its base in float32 (a QLoRA adapter onto the dequantized 4-bit base it was trained
against), llama.cpp's own `convert_hf_to_gguf.py` writes f16 / bf16 / q8_0, and llama.cpp's quantizer (through
llama-cpp-python's `llama_model_quantize`, in a child process) makes every other method from the 16-bit file.
The converter carries the tokenizer, the chat template and the special tokens into the GGUF's metadata; when the
template ends a turn with a token other than eos, it is also written as the end-of-turn token, so an engine stops
where the model was trained to stop. Every check (method names, converter, engine, architecture, output folder)
runs before anything heavy; each file is written under a temporary name, its own tokenizer checked against the
model's (gguf_verify.py, llama.cpp in a child: gguf_engine.py), and renamed when complete, so a failed export leaves
no file, and no folder it made. The rest of the package reaches this module through `commands/export.py` and
the one hook in train.py (`after_training`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..config import TrainConfig
from ..data.chat_masking import end_of_turn_token
from ..data.vision_processor import ModelInputs
from ..models.inference import ModelDirError, base_model_of, inputs_of, resolve_model_dir, reward_model_refusal
from ..models.loading import _quantization_config  # the 4-bit settings training used
from ..run_dir.output_dirs import MARKER, NotOurs, check_replaceable, read_marker
from . import gguf_engine
from .gguf_llamacpp import GGUFError, check_engine, converter_architectures, find_converter, vision_refusal
from .gguf_convert import convert, set_metadata
from .gguf_verify import check_tokenizer, sample_conversations, texts_to_check
from .gguf_vocab import prefixes_after_special_tokens, stage_for_converter, strips_after_special_tokens
from .hub import hub_token, redact
from .ollama import _base_model_dir, publish_gguf

log = logging.getLogger("praisonai_accel")

QUANTIZATION_METHODS = TrainConfig.GGUF_METHODS
CONVERTER_WRITES = ("f16", "bf16", "q8_0")  # the converter writes these itself (gguf-py), from the float32 merge


def quantization_methods(value) -> list[str]:
    """quantization_method as one name or a list, checked and lower-cased, duplicates dropped."""
    names = [value] if isinstance(value, str) else list(value or [])
    if not names:
        raise GGUFError(f"quantization_method: give at least one of {', '.join(QUANTIZATION_METHODS)}")
    methods = []
    for name in names:
        method = str(name).strip().lower()
        if method not in QUANTIZATION_METHODS:
            raise GGUFError(f"quantization_method: '{name}' is not a GGUF quantization; use one of "
                            f"{', '.join(QUANTIZATION_METHODS)}")
        methods.append(method)
    return list(dict.fromkeys(methods))


# ---------------------------------------------------------------- the plan: every cheap check, before anything heavy

@dataclass
class ExportPlan:
    source: Path  # an adapter directory or a full model directory
    out_dir: Path
    methods: list[str]
    converter: Path
    architecture: str
    adapter: bool
    dequantize_base: bool
    trust_remote_code: bool
    stem: str

    def target(self, method: str) -> Path:
        return self.out_dir / f"{self.stem}-{method.upper()}.gguf"


def _config_of(source: Path, adapter: bool, revision: str | None, trust_remote_code: bool) -> dict:
    if not adapter:
        return json.loads((source / "config.json").read_text())
    from transformers import AutoConfig

    base = base_model_of(source)
    try:
        return AutoConfig.from_pretrained(base, revision=revision, trust_remote_code=trust_remote_code).to_dict()
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{source}: cannot read the config of its base model '{base}': "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None


def plan_export(source: Path, methods, out_dir: Path | None = None, dequantize_base: bool | None = None,
                trust_remote_code: bool = False) -> ExportPlan:
    """Resolve the model, check methods, converter, engine, architecture and output folder; load nothing heavy."""
    methods = quantization_methods(methods)
    try:
        source = resolve_model_dir(Path(source))
    except ModelDirError as exc:
        raise GGUFError(str(exc)) from None
    refusal = reward_model_refusal(source, "gguf export")  # llama.cpp would get the base LM, not the score head
    if refusal:
        raise GGUFError(refusal)
    adapter = (source / "adapter_config.json").is_file()
    facts = read_marker(source) or {}
    if facts.get("trust_remote_code") and not trust_remote_code:
        raise GGUFError(f"{source}: was trained with trust_remote_code: true; pass --trust-remote-code to run the model's "
                        "own code")
    model_config = _config_of(source, adapter, facts.get("revision"), trust_remote_code)
    if model_config.get("vision_config") is not None:
        inputs = inputs_of(source, trust_remote_code)
        if inputs.vision:
            raise GGUFError(vision_refusal("gguf export", inputs.model_type))
    architecture = (model_config.get("architectures") or ["unknown"])[0]
    if dequantize_base is None:
        dequantize_base = adapter and trained_with_qlora(source)
    dequantize_base = bool(dequantize_base and adapter)
    out_dir = Path(out_dir) if out_dir is not None else source.with_name(source.name + "-gguf")
    converter = check_toolchain(methods, architecture, dequantize_base, out_dir)
    return ExportPlan(source, out_dir, methods, converter, architecture, adapter, dequantize_base, trust_remote_code,
                      source.name)


def check_toolchain(methods: list[str], architecture: str | None, dequantize_base: bool, out_dir: Path) -> Path:
    """The converter (returned), the engine where a method needs it, the architecture, bitsandbytes for a QLoRA
    merge, and an output folder that is ours to write into."""
    converter = find_converter()
    check_engine()  # it quantizes, and checks every file's tokenizer
    if architecture is not None and architecture not in converter_architectures(converter):
        raise GGUFError(f"{architecture}: llama.cpp's converter ({converter.parent}) does not know this architecture; "
                        "it cannot be exported to GGUF")
    if dequantize_base and importlib.util.find_spec("bitsandbytes") is None:
        raise GGUFError("a QLoRA adapter is merged onto its dequantized 4-bit base, which needs bitsandbytes; pip install "
                        "'praisonai-accel[qlora]' (or merge onto the original weights: --original-base)")
    try:
        check_replaceable(out_dir, "gguf output folder")
    except NotOurs as exc:
        raise GGUFError(str(exc)) from None
    return converter


def trained_with_qlora(adapter_dir: Path) -> bool:
    """Our model card (README.md of the final adapter) tags the method it was trained with."""
    card = Path(adapter_dir) / "README.md"
    try:
        front = card.read_text().split("---")[1]
    except (OSError, IndexError):
        return False
    return bool(re.search(r"^- qlora$", front, re.MULTILINE))


# ---------------------------------------------------------------- the heavy part

def merge_in_full_precision(plan: ExportPlan, target: Path) -> Path:
    """The adapter folded into its base in float32, saved with the tokenizer; a QLoRA adapter goes onto the
    dequantized NF4 weights it was trained against, not onto the original ones."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    revision = (read_marker(plan.source) or {}).get("revision")
    kwargs = {"dtype": torch.float32, "revision": revision, "trust_remote_code": plan.trust_remote_code}
    base_name = base_model_of(plan.source)
    if plan.dequantize_base:
        kwargs["quantization_config"] = _quantization_config(torch.float32)
        base = AutoModelForCausalLM.from_pretrained(base_name, **kwargs).dequantize(dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_name, **kwargs)
    with warnings.catch_warnings():  # the libraries' deprecation notes are not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        merged = PeftModel.from_pretrained(base, str(plan.source)).merge_and_unload()
    merged.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(plan.source), trust_remote_code=plan.trust_remote_code).save_pretrained(target)
    return target


def tokenizer_sources(plan: ExportPlan) -> list[Path]:
    """Where an original tokenizer.model may be: the trained folder, then its base model (local or in the Hub cache)."""
    if not plan.adapter:
        return [plan.source]

    return [plan.source, _base_model_dir(base_model_of(plan.source))]


def general_name(plan: ExportPlan, model_dir: Path) -> str:
    """general.name: the base model's name and the trained folder's, e.g. Phi-3-mini-4k-instruct-lora_model."""
    name = f"{Path(base_model_of(plan.source)).name}-{plan.stem}" if plan.adapter else plan.stem
    if strips_after_special_tokens(model_dir) and not re.search(r"phi-?3", name, re.IGNORECASE):
        name = f"phi3-{name}"  # llama.cpp strips after the special tokens only for a model named so
    return name


def end_of_turn_fix(tokenizer) -> int | None:
    """The id of the token the chat template ends a reply with, when it is not the tokenizer's eos."""
    token = end_of_turn_token(tokenizer)
    if token is None or token == tokenizer.eos_token:
        return None
    return tokenizer.convert_tokens_to_ids(token)


def tokenizer_metadata(tokenizer, model_dir: Path) -> dict[str, tuple[str, object]]:
    """What the converter does not write from a transformers 5 folder: the end-of-turn token when it is not eos, and
    for a SentencePiece-kind vocabulary whether a space is prefixed after each special token, as the tokenizer does
    (llama.cpp prefixes the text at the start and after every special token, or nowhere)."""
    values: dict[str, tuple[str, object]] = {}
    eot = end_of_turn_fix(tokenizer)
    if eot is not None:
        values["tokenizer.ggml.eot_token_id"] = ("UINT32", eot)
    prefix = prefixes_after_special_tokens(model_dir, tokenizer)
    if prefix is not None:
        values["tokenizer.ggml.add_space_prefix"] = ("BOOL", prefix)
    return values


def export_gguf(plan: ExportPlan, conversations: list[list[dict]] = ()) -> list[Path]:
    """Write one GGUF per method into plan.out_dir; returns their paths. Files appear complete and checked
    (gguf_verify: their tokenizer encodes `conversations`, rendered, and our own texts as the model's does) or not at
    all, and a failed export removes the folders it made."""
    made_dirs = [d for d in (plan.out_dir, *plan.out_dir.parents) if not d.exists()]
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _export(plan, conversations)
    except BaseException:
        for directory in made_dirs:  # innermost first; never one that holds anything now
            try:
                directory.rmdir()
            except OSError:
                break
        raise


def _export(plan: ExportPlan, conversations: list[list[dict]]) -> list[Path]:
    work = Path(tempfile.mkdtemp(prefix=".gguf-work-", dir=plan.out_dir))
    written: list[Path] = []
    try:
        from transformers import AutoTokenizer

        model_dir = merge_in_full_precision(plan, work / "merged") if plan.adapter else plan.source
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=plan.trust_remote_code)
        metadata = tokenizer_metadata(tokenizer, model_dir)
        name = general_name(plan, model_dir)
        model_dir = stage_for_converter(model_dir, work / "stage", tokenizer_sources(plan), tokenizer)
        sixteen = "bf16" if "bf16" in plan.methods else "f16"  # what k-quants start from
        made: dict[str, Path] = {}
        order = [m for m in CONVERTER_WRITES if m in plan.methods]
        if any(m not in CONVERTER_WRITES for m in plan.methods) and sixteen not in order:
            order.insert(0, sixteen)
        for outtype in order:
            log.info("gguf: converting %s to %s with llama.cpp's converter", plan.source, outtype.upper())
            made[outtype] = convert(plan.converter, model_dir, work / f"{outtype}.gguf", outtype, name)
            if metadata:
                set_metadata(plan.converter, made[outtype], metadata)
        for method in plan.methods:
            if method not in made:
                log.info("gguf: quantizing to %s with llama.cpp's quantizer", method.upper())
                made[method] = work / f"{method}.gguf"
                gguf_engine.quantize(made[sixteen], made[method], method)
        named = {method: made[method].with_name(plan.target(method).name) for method in plan.methods}
        for method in plan.methods:  # the names the user will see, in the error line too
            os.replace(made[method], named[method])
        check_tokenizer(list(named.values()), tokenizer, texts_to_check(tokenizer, conversations))
        for method in plan.methods:
            os.replace(named[method], plan.target(method))
            written.append(plan.target(method))
        marker = plan.out_dir / MARKER
        if not marker.exists():
            marker.write_text(json.dumps({"written_by": "praisonai-accel", "kind": "gguf"}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return written


# ---------------------------------------------------------------- after training (rank 0, from train.py's hook)

def wanted(config: TrainConfig) -> bool:
    return bool(config.save_gguf or config.huggingface_save_gguf or config.ollama_save)


def check_before_training(config: TrainConfig, inputs: ModelInputs) -> None:
    """What after_training will need, checked before launch: GGUFError with one line, nothing trained yet. A
    vision-language model (`inputs`, as the launcher decided them) is refused any GGUF or Ollama publishing
    (ollama_model too: the safetensors route)."""
    if not (wanted(config) or config.ollama_model):
        return
    if inputs.vision:
        keys = ("save_gguf", "huggingface_save_gguf", "ollama_save", "ollama_model")
        key = next(k for k in keys if getattr(config, k))
        raise GGUFError(vision_refusal(key, inputs.model_type))
    if not wanted(config):
        return
    try:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(config.model_name, revision=config.revision,
                                                  trust_remote_code=config.trust_remote_code)
    except Exception:  # training reports an unreadable model itself
        model_config = None
    architecture = (getattr(model_config, "architectures", None) or [None])[0]
    check_toolchain(config.quantization_method, architecture, config.finetune_type == "qlora", config.output_path() / "gguf")
    if config.huggingface_save_gguf:
        if not hub_token():
            raise GGUFError("huggingface_save_gguf: no Hugging Face token; set HF_TOKEN or run `hf auth login` "
                            "(nothing was trained)")
    if config.ollama_save and importlib.util.find_spec("ollama") is None:
        raise GGUFError("ollama_save: the ollama client is not installed; pip install 'praisonai-accel[ollama]'")


def after_training(config: TrainConfig, final_dir: Path) -> list[str]:
    """save_gguf / huggingface_save_gguf / ollama_save: the files, their upload, the Ollama model FROM the first.
    Returns one line per failure; the trained model is never touched."""
    if not wanted(config):
        return []
    try:
        plan = plan_export(final_dir, config.quantization_method, config.output_path() / "gguf",
                           dequantize_base=config.finetune_type == "qlora", trust_remote_code=config.trust_remote_code)
        files = export_gguf(plan, sample_conversations(config))
    except (GGUFError, OSError) as exc:
        return [f"gguf: {exc}"]
    for file in files:
        print(f"praisonai-accel: wrote {file} ({file.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    problems = []
    if config.huggingface_save_gguf:
        problems += upload(config, files)
    if config.ollama_save:
        try:
            modelfile = publish_gguf(files[0], final_dir, config.ollama_model, push=config.ollama_push,
                                     trust_remote_code=config.trust_remote_code)
            print(f"praisonai-accel: created Ollama model {config.ollama_model} from {files[0].name} (Modelfile: "
                  f"{modelfile})", file=sys.stderr)
        except Exception as exc:  # server down, refused: report, keep the files
            problems.append(f"ollama: could not create {config.ollama_model}: {type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    return problems


def upload(config: TrainConfig, files: list[Path]) -> list[str]:
    """The .gguf files into hub_model_id (created private when hub_private), beside whatever else the run pushed."""
    from huggingface_hub import HfApi

    token = hub_token()
    try:
        api = HfApi(token=token)
        api.create_repo(config.hub_model_id, private=config.hub_private, exist_ok=True)
        for file in files:
            api.upload_file(path_or_fileobj=str(file), path_in_repo=file.name, repo_id=config.hub_model_id,
                            commit_message=f"GGUF {file.name} (praisonai-accel)")
    except Exception as exc:
        return [f"huggingface_save_gguf: upload to {config.hub_model_id} failed: "
                f"{redact(type(exc).__name__ + ': ' + (str(exc).strip().splitlines() or [''])[0], token)}"]
    print(f"praisonai-accel: uploaded {', '.join(f.name for f in files)} to {config.hub_model_id}", file=sys.stderr)
    return []

