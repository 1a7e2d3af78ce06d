"""Load a trained adapter (or a full model) for inference, and generate replies; a vision-language model loads with
its processor, and the images of a prompt go through it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ..data import end_of_turn_token
from ..data.images import open_image
from ..data.vision_processor import PROCESSOR_FILES, ModelInputs, checkpoint_inputs
from ..run_dir.output_dirs import read_marker


class ModelDirError(Exception):
    """A path that holds no usable model, phrased for the user."""


def resolve_model_dir(path: Path) -> Path:
    """An adapter/model directory, or a training output_dir whose final model is inside it."""
    path = Path(path)
    if not path.exists():
        raise ModelDirError(f"{path}: no such directory")
    if (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return path
    summary = path / "train_summary.json"
    if summary.is_file():
        final = Path(json.loads(summary.read_text())["final_model_dir"])
        if final.is_dir():
            return final
    for default, marker in (("lora_model", "adapter_config.json"), ("model", "config.json"), ("lora_model", "config.json")):
        if (path / default / marker).is_file():  # a full fine-tune's default name; lora_model before it had one
            return path / default
    raise ModelDirError(f"{path}: holds no adapter_config.json or config.json (point at the adapter directory)")


def base_model_of(adapter_dir: Path) -> str:
    return json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]


def model_config_of(model_dir: Path, trust_remote_code: bool = False):
    """The model's config: the directory's own, or an adapter's base model's (at the revision it trained on)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if (model_dir / "adapter_config.json").is_file():
        revision = (read_marker(model_dir) or {}).get("revision")
        return AutoConfig.from_pretrained(base_model_of(model_dir), revision=revision,
                                          trust_remote_code=trust_remote_code)
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


def is_processor(tokenizer) -> bool:
    """What load_for_inference returns for a vision-language model: its processor, which holds the tokenizer."""
    return getattr(tokenizer, "image_processor", None) is not None and hasattr(tokenizer, "tokenizer")


def _holds_processor(directory: Path) -> bool:
    return any((directory / name).is_file() for name in PROCESSOR_FILES)


def inputs_of(model_dir: Path, trust_remote_code: bool = False) -> ModelInputs:
    """What the model in this directory takes, by data/vision_processor.checkpoint_inputs: a vision-language config
    saved with an image processor here or, for an adapter, with its base model (a folder, the Hub cache or the Hub).
    A multimodal model saved with its tokenizer alone is a text model, as training treats it."""
    model_dir = Path(model_dir)
    model_type = model_config_of(model_dir, trust_remote_code).model_type
    if (model_dir / "adapter_config.json").is_file():
        base, revision = base_model_of(model_dir), (read_marker(model_dir) or {}).get("revision")
        images = checkpoint_inputs(base, revision, [(str(model_dir), None), (base, revision)]).images
    else:
        images = checkpoint_inputs(str(model_dir)).images
    return ModelInputs(bool(images), model_type)


def _vision_processor(model_dir: Path, adapter: bool, revision: str | None, trust_remote_code: bool):
    """The processor of a vision-language model: the directory's own, or an adapter's base model's; None when
    neither has one (a multimodal model trained on text and saved with its tokenizer alone)."""
    from transformers import AutoProcessor

    sources = [(model_dir, None)] + ([(base_model_of(model_dir), revision)] if adapter else [])
    for source, source_revision in sources:
        if Path(source).is_dir() and not _holds_processor(Path(source)):
            continue
        processor = AutoProcessor.from_pretrained(str(source), revision=source_revision,
                                                  trust_remote_code=trust_remote_code)
        if is_processor(processor):
            return processor
    return None


def _is_reward_model(model_dir: Path) -> bool:
    """A sequence classifier (method: reward): a SEQ_CLS adapter, or a model whose architecture classifies."""
    adapter, config = model_dir / "adapter_config.json", model_dir / "config.json"
    try:
        if adapter.is_file():
            return json.loads(adapter.read_text()).get("task_type") == "SEQ_CLS"
        architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


def reward_model_refusal(model_dir: Path, what: str) -> str | None:
    """One line for `what` (a command that needs a model that writes text) given a reward model, which scores text
    (method: reward: a one-label sequence classifier); None for any other model."""
    if not _is_reward_model(Path(model_dir)):
        return None
    return (f"{what}: {model_dir} is a reward model (a one-label sequence classifier): it scores text and writes none; "
            f"score with it: praisonai-accel score {model_dir} --prompt ... --completion ...")


def load_for_inference(path: Path, device: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) ready for generate(); base + adapter when `path` is an adapter. For a vision-language model
    the second is its processor (AutoProcessor: image processor, tokenizer, chat template), the directory's own or,
    for an adapter saved without one, its base model's.

    trust_remote_code comes from the caller (the run's config, or --trust-remote-code), never from a file in the
    model directory; the revision the run trained on does come from ours (it picks a commit, it runs nothing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(path)
    facts = read_marker(model_dir) or {}
    if facts.get("trust_remote_code") and not trust_remote_code:
        raise ModelDirError(f"{model_dir}: was trained with trust_remote_code: true; pass --trust-remote-code to run "
                            "the model's own code")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    adapter = (model_dir / "adapter_config.json").is_file()
    processor = None
    if inputs_of(model_dir, trust_remote_code).vision:
        processor = _vision_processor(model_dir, adapter, facts.get("revision"), trust_remote_code)
    if processor is not None:
        from transformers import AutoModelForImageTextToText

        model_class, tokenizer = AutoModelForImageTextToText, processor
    else:  # a text model, or a multimodal one trained on text and saved with its tokenizer alone
        model_class = AutoModelForCausalLM
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    head = {}
    if processor is None and _is_reward_model(model_dir):  # method: reward (methods/reward.py): merge keeps the head
        from transformers import AutoModelForSequenceClassification

        model_class, head = AutoModelForSequenceClassification, {"num_labels": 1}
    if adapter:
        from peft import PeftModel

        base = model_class.from_pretrained(base_model_of(model_dir), dtype="auto", revision=facts.get("revision"),
                                           trust_remote_code=trust_remote_code, **head)
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(base, str(model_dir))
    else:
        model = model_class.from_pretrained(str(model_dir), dtype="auto", trust_remote_code=trust_remote_code)
    model.to(device).eval()
    text = tokenizer.tokenizer if processor is not None else tokenizer
    if text.pad_token is None:
        text.pad_token = text.eos_token
    return model, tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """Where generation stops: the model's own generation_config eos ids, the tokenizer's eos, and the template's
    end-of-turn token. Qwen2.5 and Llama 3.x end a turn with <|im_end|> / <|eot_id|>, which for some checkpoints is
    not the tokenizer's eos; stopping on eos alone runs on into invented turns. `tokenizer` may be a processor."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    if is_processor(tokenizer):
        turn_end = _vision_turn_end(tokenizer)
        tokenizer = tokenizer.tokenizer
    else:
        turn_end = end_of_turn_token(tokenizer)
    ids.append(tokenizer.eos_token_id)
    if turn_end is not None:
        ids.append(tokenizer.convert_tokens_to_ids(turn_end))
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))


def _vision_turn_end(processor) -> str | None:
    """end_of_turn_token for a processor's template, which reads typed content parts (<end_of_utterance>, ...)."""
    return end_of_turn_token(processor.tokenizer, getattr(processor, "chat_template", None), parts=True)


def vision_messages(messages: list[dict], images: int) -> list[dict]:
    """Messages as a processor's chat template reads them: typed content parts, with `images` image parts before the
    text of the first user turn (as TRL's vision format places them)."""
    out, placed = [], False
    for message in messages:
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if message["role"] == "user" and not placed:
            parts = [{"type": "image"} for _ in range(images)] + parts
            placed = True
        out.append({"role": message["role"], "content": parts})
    return out


def generate(model, tokenizer, messages: list[dict], max_new_tokens: int = 128, temperature: float = 0.0,
             images: list | None = None) -> str:
    """The reply to `messages`; `images` (PIL images) go with the first user turn, through the processor that
    load_for_inference returned for a vision-language model."""
    return generate_batch(model, tokenizer, [messages], max_new_tokens, temperature,
                          [images] if images else None)[0]


def generate_batch(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 128,
                   temperature: float = 0.0, images: list[list] | None = None) -> list[str]:
    """The replies to several conversations at once, left-padded; `images`: each conversation's images (PIL),
    with its first user turn, through a vision-language model's processor."""
    import torch

    vision = is_processor(tokenizer)
    text_tokenizer = tokenizer.tokenizer if vision else tokenizer
    padding_side, text_tokenizer.padding_side = text_tokenizer.padding_side, "left"
    try:
        if vision:
            counts = [len(i) for i in images] if images else [0] * len(conversations)
            prompts = [tokenizer.apply_chat_template(vision_messages(m, n), tokenize=False, add_generation_prompt=True)
                       for m, n in zip(conversations, counts)]
            inputs = tokenizer(text=prompts, images=[list(i) for i in images] if images else None,
                               return_tensors="pt", padding=len(prompts) > 1, add_special_tokens=False)
            # a processor's pixel values come as float32; they go in the model's dtype (to() casts floats alone)
            inputs = inputs.to(model.device, dtype=model.dtype)
        else:
            prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                       for m in conversations]
            inputs = tokenizer(prompts, return_tensors="pt", padding=len(prompts) > 1,
                               add_special_tokens=False).to(model.device)
    finally:
        text_tokenizer.padding_side = padding_side
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=text_tokenizer.pad_token_id,
                                eos_token_id=stop_token_ids(model, tokenizer), **sampling)
    return [text_tokenizer.decode(row, skip_special_tokens=True).strip()
            for row in output[:, inputs["input_ids"].shape[1]:]]


def read_image(path: Path):
    """The image file as an RGB PIL image, or a ValueError naming the file and why it cannot be read."""
    image = open_image(Path(path), f"{path}:", decode=True)
    if isinstance(image, str):  # a RowProblem: missing, unreadable, a decompression bomb
        raise ValueError(str(image))
    return image
