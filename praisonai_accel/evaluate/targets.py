"""What TARGET names: a run's output_dir (its final model or adapter), a checkpoint directory, a model directory or a
Hub id; resolved, and its base checked to be at hand, before any model loads. Whether its prompts are rendered with
the chat template: as the run trained, by default."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError, first_line
from ..run_dir.checkpoints import step_of

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class EvalTarget:
    name: str  # what the user typed
    model: str  # the directory (or Hub id) loaded: an adapter, or a full model
    adapter: bool
    base: str | None  # an adapter's base model
    output_dir: str | None  # the run it came from, where results go by default
    step: int | None  # the run's step this model is from
    trust_remote_code: bool = False

    def base_target(self) -> "EvalTarget":
        """A full fine-tune's base (--base): the model it started from, loaded as a target of its own."""
        return replace(self, name=self.base, model=self.base)

    def description(self) -> dict:
        return {"target": self.name, "model": self.base if self.adapter else self.model,
                "adapter": self.model if self.adapter else None, "base_model": self.base, "checkpoint_step": self.step,
                "config_sha256": config_hash(self.model)}


def config_hash(model: str) -> str | None:
    """sha256 of the adapter_config.json (or config.json) scored: which configuration the numbers belong to."""
    for name in ("adapter_config.json", "config.json"):
        path = Path(model) / name
        if path.is_file():
            return hashlib.sha256(path.read_bytes()).hexdigest()
    return None


def _summary(output_dir: Path, name: str = "train_summary.json") -> dict:
    try:
        data = json.loads((Path(output_dir) / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve_target(target: str, trust_remote_code: bool = False) -> EvalTarget:
    path = Path(target)
    if not path.exists():
        if _HUB_ID.match(target) and not target.startswith("."):
            _check_loadable(target, "TARGET", trust_remote_code)
            return EvalTarget(target, target, False, None, None, None, trust_remote_code)
        raise ConfigError(f"TARGET {target}: no such run, checkpoint or model directory (nor a Hub id)")
    if not path.is_dir():
        raise ConfigError(f"TARGET {target}: is a file; expected a run's output_dir, a checkpoint or a model directory")
    output_dir, step = None, None
    if step_of(path) >= 0:
        output_dir, step = path.parent, step_of(path)
        if (path / "adapter" / "adapter_config.json").is_file():
            path = path / "adapter"
        elif not (path / "config.json").is_file():
            raise ConfigError(f"TARGET {target}: this checkpoint holds no loadable model (a full fine-tune's checkpoint "
                              "resumes training; score the run's final model instead)")
    elif (path / "train_summary.json").is_file() or (path / "progress.json").is_file():
        output_dir, step = path, _summary(path).get("global_step")
    from ..models.inference import ModelDirError, base_model_of, resolve_model_dir, reward_model_refusal

    try:
        model_dir = resolve_model_dir(path)
    except (ModelDirError, KeyError, ValueError) as exc:
        raise ConfigError(f"TARGET {target}: not a run, checkpoint or model ({first_line(exc)})") from None
    refusal = reward_model_refusal(model_dir, f"eval TARGET {target}")  # (as a metric: --reward-model)
    if refusal:
        raise ConfigError(refusal)
    if output_dir is None and model_dir.parent.joinpath("train_summary.json").is_file():
        output_dir = model_dir.parent
        step = _summary(output_dir).get("global_step")
    elif output_dir is None and model_dir.name == "adapter" and step_of(model_dir.parent) >= 0:
        output_dir, step = model_dir.parent.parent, step_of(model_dir.parent)
    facts = _marker(model_dir)
    if facts.get("trust_remote_code") and not trust_remote_code:
        raise ConfigError(f"TARGET {target}: was trained with trust_remote_code: true; pass --trust-remote-code to run "
                          "the model's own code")
    adapter = (model_dir / "adapter_config.json").is_file()
    base = base_model_of(model_dir) if adapter else facts.get("base_model")  # a full fine-tune's: what it started from
    if adapter:
        if (base.startswith((".", "/", "~")) or not _HUB_ID.match(base)) and not Path(base).is_dir():
            raise ConfigError(f"TARGET {target}: its adapter's base model {base} is not at hand (no such directory)")
        _check_loadable(base, f"TARGET {target}: its adapter's base model", trust_remote_code, facts.get("revision"))
    else:
        _check_loadable(str(model_dir), f"TARGET {target}", trust_remote_code)
    return EvalTarget(target, str(model_dir), adapter, base, str(output_dir) if output_dir else None, step,
                      trust_remote_code)


def check_base(target: EvalTarget) -> None:
    """--base: the model the target was trained from is recorded and at hand (an adapter's is checked already)."""
    if target.adapter:
        return
    if not target.base:
        raise ConfigError(f"--base: {target.name} records no base model (a model that is no run of ours, or a full "
                          "fine-tune saved before it was recorded); score the base model as its own TARGET")
    if not _HUB_ID.match(target.base) and not Path(target.base).is_dir():
        raise ConfigError(f"--base: {target.name} was trained from {target.base}, which is not at hand (no such "
                          "directory)")
    _check_loadable(target.base, f"--base: {target.name}'s base model", target.trust_remote_code)


def _marker(model_dir: Path) -> dict:
    from ..run_dir.output_dirs import read_marker

    return read_marker(model_dir) or {}


def _check_loadable(model: str, what: str, trust_remote_code: bool, revision: str | None = None) -> None:
    """The model's config is readable (a local folder, the Hub cache or the Hub): the cheap check before weights."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {model} cannot be loaded: {first_line(exc)}") from None


# rows that are conversations by construction, rendered with the chat template to train; `text` rows are not, and
# the other formats (a GRPO prompt, a preference pair) may hold either, row by row
CHAT_FORMATS = ("alpaca", "sharegpt", "messages", "sharegpt_paired")
_TEMPLATE_FILES = (("chat_template.jinja", None), ("chat_template.json", "chat_template"),
                   ("tokenizer_config.json", "chat_template"), ("processor_config.json", "chat_template"))


def trained_formats(output_dir: str | Path) -> dict | None:
    """{dataset: format} as the run recorded it (train_summary.json, or progress.json while it runs); None when it
    recorded none."""
    for name in ("train_summary.json", "progress.json"):
        formats = _summary(Path(output_dir), name).get("data_formats")
        if isinstance(formats, dict) and formats:
            return formats
    return None


def _run_default(target: EvalTarget) -> tuple[bool, str]:
    """(apply the chat template, why) for a target from a run: as the run rendered its training rows."""
    from ..models.inference import inputs_of

    try:
        images = inputs_of(Path(target.model), target.trust_remote_code).vision
    except (OSError, ValueError, KeyError):
        images = False
    return template_default(trained_formats(target.output_dir), images)


def template_default(formats: dict | None, vision: bool) -> tuple[bool, str]:
    """(apply the chat template, why): as a run with these {dataset: format} rendered its training rows. `eval` of
    a run and eval_tasks during it decide with this one rule, so that their scores agree."""
    chat = sorted({str(f) for f in (formats or {}).values()} & set(CHAT_FORMATS))
    if chat:
        return True, f"the run trained on {', '.join(chat)} rows through it"
    if vision:
        return True, "a vision run trains on conversations through it"
    if formats and set(map(str, formats.values())) == {"text"}:
        return False, "the run trained on text rows"
    if formats:
        return False, f"the run's {', '.join(sorted(set(map(str, formats.values()))))} rows may be text or messages"
    return False, "the run does not record the format of its rows"


def has_chat_template(target: EvalTarget) -> bool | None:
    """Whether the tokenizer (or processor) scored with has a chat template; None when its files are not here."""
    from ..data.vision_processor import checkpoint_file

    sources = [target.model] + ([target.base] if target.adapter and target.base else [])
    unknown = False
    for source in sources:
        for filename, key in _TEMPLATE_FILES:
            path = checkpoint_file(source, filename)
            if path is None:
                unknown = True
            elif path:
                try:
                    if key is None or json.loads(path.read_text()).get(key):
                        return True
                except (OSError, ValueError, AttributeError):
                    unknown = True
    return None if unknown else False


def chat_template_choice(target: EvalTarget, requested: bool | None) -> tuple[bool, str | None]:
    """(whether lm-eval renders prompts with the chat template, the line that says so). `requested`: the
    --apply-chat-template / --no-apply-chat-template flag, None for the default: as the run trained; a model that
    is no run keeps lm-eval's default (no template)."""
    if requested is None and target.output_dir is None:
        return False, None
    if requested is None:
        apply, why = _run_default(target)
        flag = "--no-apply-chat-template to score without" if apply else "--apply-chat-template to apply it"
        why = f"{why}; {flag}"
    else:
        apply, why = requested, "--apply-chat-template" if requested else "--no-apply-chat-template"
    if apply and has_chat_template(target) is False:
        raise ConfigError(f"{'--apply-chat-template' if requested else 'chat template'}: {target.name} has none (its "
                          "tokenizer defines no chat template); score it with --no-apply-chat-template")
    return apply, f"chat template: {'applied' if apply else 'not applied'} ({why})"
