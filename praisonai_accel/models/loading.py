"""Load the base model (one full copy per rank) and turn it into what we train: LoRA, QLoRA or full.

unsloth is used when it is installed and a GPU is present; otherwise transformers + peft.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig
from ..errors import first_line
from ..data import ensure_chat_template, load_tokenizer
from ..data.vision_processor import ModelInputs
from ..runtime.distributed import DistEnv, fsdp_requested, mark_unsloth_ddp, resolve_device_map
from . import vision as vision_model
from .host_embedding import keep_on_host, shares_output_head, tied_message
from .vision import unquantized_modules

SEQUENCE_CLASSIFIER = "sequence-classification"  # a method's model_head (methods/base.py): a reward model

log = logging.getLogger(__name__)


def context_warning(max_seq_length: int, model_config, example_lengths=None) -> str | None:
    """A warning when rows may be longer than the positions the model was trained on (its max_position_embeddings)
    and no RoPE scaling stretches them: past that length, quality degrades without an error. None otherwise, and
    when no example (`example_lengths`: a pair's counts both rows) is that long."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    positions = next((getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")
                      if isinstance(getattr(config, key, None), int)), None)
    longest = max(example_lengths, default=0) if example_lengths is not None else max_seq_length
    if positions is None or min(max_seq_length, longest) <= positions:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope.get("rope_type")] if "rope_type" in rope else [v.get("rope_type") for v in rope.values()
                                                                  if isinstance(v, dict)]
    if any(kind not in (None, "default") for kind in kinds):
        return None  # the model's own scaling: its max_position_embeddings is already the stretched length
    return (f"warning: max_seq_length {max_seq_length} is over the model's max_position_embeddings {positions}: "
            f"rows longer than {positions} tokens take positions it was never trained on (its quality falls there, "
            "without an error); lower max_seq_length, or use a model with a longer context")


@dataclass
class Backend:
    name: str  # "unsloth" | "transformers"
    module: Any = None
    reason: str = ""


def import_unsloth() -> tuple[Any, str]:
    """unsloth, or None and why not. Its import can fail in many ways off a GPU, so catch them all."""
    try:
        import unsloth  # noqa: F401  (must come before transformers to patch it)

        return sys.modules["unsloth"], ""
    except Exception as exc:  # NotImplementedError, RuntimeError, ImportError...: all mean "not usable"
        return None, f"{type(exc).__name__}: {first_line(exc, '')}"


def choose_backend(config: TrainConfig, env: DistEnv, use_cuda: bool, inputs: ModelInputs) -> Backend:
    """Decide, and import unsloth if chosen, before transformers is imported anywhere."""
    if config.use_unsloth is False:
        return Backend("transformers", reason="use_unsloth: false")
    if config.model_head == SEQUENCE_CLASSIFIER:  # unsloth's loaders build causal LMs
        if config.use_unsloth is True:
            raise ConfigError(f"use_unsloth: true: method: {config.method} trains a sequence classifier, which unsloth "
                              "does not load; set use_unsloth: auto or false")
        return Backend("transformers", reason="a sequence classifier (a reward model)")
    if config.offload_embedding:  # kept on the host by host_embedding.py; unsloth's own placement would undo it
        return Backend("transformers", reason="offload_embedding")
    if inputs.vision:
        if config.use_unsloth is True:
            raise ConfigError("use_unsloth: true: vision-language models are trained with transformers + peft here; "
                              "set use_unsloth: auto or false")
        return Backend("transformers", reason="a vision-language model")
    if not use_cuda:
        if config.use_unsloth is True:
            raise ConfigError("use_unsloth: true needs a CUDA GPU, and none is visible; set use_unsloth: auto or false")
        return Backend("transformers", reason="no CUDA GPU")
    # unsloth's loader is text-only: not for a model that may take images
    if inputs.images is None and config.use_unsloth is not True:
        return Backend("transformers", reason=f"whether {config.model_name} takes images cannot be told (its "
                                              "config.json is neither here nor fetched from the Hub)")
    mark_unsloth_ddp(env)
    module, why = import_unsloth()
    if module is None:
        if config.use_unsloth is True:
            raise ConfigError(f"use_unsloth: true, but unsloth cannot be imported ({why}); pip install 'praisonai-accel[unsloth]'")
        return Backend("transformers", reason=f"unsloth unavailable ({why})")
    return Backend("unsloth", module=module)


def resolve_torch_dtype(config: TrainConfig, use_cuda: bool, bf16_supported: bool):
    import torch

    if config.torch_dtype != "auto":
        return getattr(torch, config.torch_dtype)
    if not use_cuda or config.finetune_type == "full":
        return torch.float32  # full fine-tuning keeps fp32 master weights; mixed precision does the compute
    return torch.bfloat16 if bf16_supported else torch.float16


def lora_settings(config: TrainConfig) -> dict:
    """The LoRA hyperparameters, as both peft's LoraConfig and unsloth's get_peft_model take them."""
    targets = config.lora_target_modules
    return {
        "r": config.lora_r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": targets if targets == "all-linear" else list(targets),
        "bias": config.lora_bias,
        "use_rslora": config.use_rslora,
    }


def resolve_commit(config: TrainConfig) -> str | None:
    """The Hub commit that model_name at `revision` (default: main) names now; None for a local folder or when the
    Hub cannot say. Loading at this commit, not at the branch, keeps the weights and the record the same."""
    if Path(config.model_name).expanduser().exists():
        return None
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(config.model_name, "config.json", revision=config.revision)
    except Exception:  # no such repo, offline without a cache: from_pretrained says why, in one line
        return None
    match = re.search(r"[\\/]snapshots[\\/]([0-9a-f]{40})[\\/]", path)
    return match.group(1) if match else None


def _load_with_unsloth(config: TrainConfig, env: DistEnv, device_map: Any, unsloth: Any, dtype):
    """One unsloth path from loading to the PEFT model. FastLanguageModel.from_pretrained sets UNSLOTH_USE_NEW_MODEL=0
    and loads Llama, Mistral, Gemma, Gemma 2, Qwen2 and Qwen3 with FastLlamaModel (its fast path, whose reentrant
    checkpointing DDP cannot use with unused-parameter detection); FastModel (FastBaseModel) sets it to 1. Their
    get_peft_model picks its path from that flag. Under DDP both steps go through FastModel; on one process through
    FastLanguageModel. The flag is never changed between them, so a model is never given the other path's PEFT."""
    fast = unsloth.FastModel if env.is_distributed else unsloth.FastLanguageModel
    model, tokenizer = fast.from_pretrained(
        model_name=config.model_name,
        max_seq_length=config.max_seq_length,
        dtype=dtype,
        load_in_4bit=config.finetune_type == "qlora",
        full_finetuning=config.finetune_type == "full",
        device_map=device_map if device_map is not None else "sequential",
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
    )
    if config.uses_lora:
        model = fast.get_peft_model(model, **lora_settings(config), random_state=config.seed,
                                    use_gradient_checkpointing=config.use_gradient_checkpointing)
    return model, tokenizer


def quantization_settings(compute_dtype, skip_modules: list[str] | None = None) -> dict:
    """BitsAndBytesConfig's arguments: NF4 with double quantization; `skip_modules` stay unquantized (a VLM's
    vision tower, projector and LM head, as LLaMA-Factory keeps them: the projector trains whole)."""
    settings = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": compute_dtype}
    return {**settings, "llm_int8_skip_modules": skip_modules} if skip_modules else settings


def vision_quantization_skips(config: TrainConfig) -> list[str]:
    """The modules of a VLM that QLoRA leaves unquantized, by their names in the model (built on the meta device from
    its config, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_config = AutoConfig.from_pretrained(config.model_name, revision=config.revision,
                                              trust_remote_code=config.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(model_config, trust_remote_code=config.trust_remote_code)
    return unquantized_modules(model)


def _quantization_config(compute_dtype, skip_modules: list[str] | None = None):
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:
        raise ConfigError(
            f"finetune_type: qlora needs bitsandbytes, which cannot be imported ({type(exc).__name__}); "
            "pip install 'praisonai-accel[qlora]'"
        ) from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**quantization_settings(compute_dtype, skip_modules))


def _load_with_transformers(config: TrainConfig, device_map: Any, dtype, vision: bool):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    kwargs: dict[str, Any] = {"dtype": dtype, "revision": config.revision, "trust_remote_code": config.trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if config.finetune_type == "qlora":
        skips = vision_quantization_skips(config) if vision else None
        kwargs["quantization_config"] = _quantization_config(dtype, skips)
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    reward = config.model_head == SEQUENCE_CLASSIFIER  # a one-label sequence classifier (methods/reward.py)
    if reward:
        auto_class, kwargs["num_labels"] = AutoModelForSequenceClassification, 1
    model = auto_class.from_pretrained(config.model_name, **kwargs)
    if config.offload_embedding and config.uses_lora:  # before peft's upcast (QLoRA), so that happens on the host
        if shares_output_head(model):  # tied where neither config said so: a move of the head would undo it
            raise ConfigError(tied_message(config.model_name))
        keep_on_host(model)
        table = model.get_input_embeddings().weight
        log.info("embedding: %s x %s (%.0f MiB) kept in host memory (offload_embedding)", f"{table.shape[0]:,}",
                 f"{table.shape[1]:,}", table.numel() * table.element_size() / 2**20)
    if vision:
        vision_model.freeze(model, config)
    checkpointing = bool(config.use_gradient_checkpointing)
    ckpt_kwargs = {"use_reentrant": config.use_gradient_checkpointing == "reentrant"}
    if config.finetune_type == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs=ckpt_kwargs
        )
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
        if config.uses_lora:
            model.enable_input_require_grads()
    if config.uses_lora:
        from peft import LoraConfig, get_peft_model

        scope = vision_model.lora_scope(model, config) if vision else {}
        # SEQ_CLS: peft trains the score head in full (modules_to_save) and saves it with the adapter
        model = get_peft_model(model, LoraConfig(**lora_settings(config), **scope,
                                                 task_type="SEQ_CLS" if reward else "CAUSAL_LM"))
    model.config.use_cache = False
    return model


def load_model_and_tokenizer(config: TrainConfig, env: DistEnv, backend: Backend, use_cuda: bool, bf16_supported: bool,
                             inputs: ModelInputs):
    """The trainable model on this rank's device, and its tokenizer (a vision-language model's carries its processor:
    `inputs`, as the worker decided them)."""
    import torch

    device_map = resolve_device_map(config.device_map, env, use_cuda, sharded=fsdp_requested(),
                                    device_count=torch.cuda.device_count() if use_cuda else 0)
    dtype = resolve_torch_dtype(config, use_cuda, bf16_supported)
    try:
        if backend.name == "unsloth":
            model, tokenizer = _load_with_unsloth(config, env, device_map, backend.module, dtype)
            ensure_chat_template(tokenizer, config.chat_template)
            return model, tokenizer
        tokenizer = load_tokenizer(config, inputs)
        model = _load_with_transformers(config, device_map, dtype, inputs.vision)
        if config.model_head == SEQUENCE_CLASSIFIER:  # the classifier reads each row's reward at its last non-pad token
            model.config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer
    except (OSError, ValueError) as exc:  # missing files, bad repo ids, unreadable configs
        first = first_line(exc)
        raise ConfigError(f"model_name: cannot load '{config.model_name}': {first}") from None


def uses_reentrant_checkpointing(config: TrainConfig, backend: Backend) -> bool:
    """torch's reentrant checkpointing: asked for, or unsloth's own (its checkpointer is a reentrant autograd Function).
    Under DDP it marks a parameter ready twice when unused parameters are searched for (find_unused_parameters)."""
    return config.use_gradient_checkpointing == "reentrant" or (backend.name == "unsloth"
                                                                and bool(config.use_gradient_checkpointing))


def parameters_without_gradient(loss_module, batch, forward) -> list[str]:
    """The trainable parameters one forward and backward of `batch` leaves without a gradient; the RNG is left as
    it was and the gradients are dropped. `forward(module, batch)`: the training method's (methods/base.py)."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        forward(loss_module, batch)[0].backward()
    missing = [name for name, p in loss_module.named_parameters() if p.requires_grad and p.grad is None]
    loss_module.zero_grad(set_to_none=True)
    return missing


def trainable_parameter_count(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total

