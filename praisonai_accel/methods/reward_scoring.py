"""Using a trained reward model: loading it (a full sequence classifier, or a SEQ_CLS adapter on its base), its
rewards for token rows or texts (the model's own forward, as training reads them), for `score`, the reward demo and
GRPO's `model:PATH` rewards (under FSDP2 sharded across the ranks like the policy and its reference, its scoring in
lockstep)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from ..data.chat_masking import plan_masking
from ..errors import ConfigError
from ..logs import FILE_ONLY
from ..models.unwrap import transformers_model
from ..runtime.distributed import fsdp_requested
from . import preference_data as pdata
from .reward import _read_json, reward_model_problem


def sequence_rewards(model, input_ids, attention_mask) -> torch.Tensor:
    """One reward per row: the model's own forward (its head at the last non-pad token)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return logits.squeeze(-1).float()


def load_scorer(path, device="cpu", dtype=None):
    """(sequence classifier in eval mode, tokenizer) from a trained reward model: a full model, or a SEQ_CLS adapter
    whose modules_to_save carry the head (loaded on its base)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the base's load report (no score head, an unused lm_head) is expected
    hf_logging.disable_progress_bar()
    try:
        return _load_scorer(Path(path).expanduser(), device, dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_scorer(path: Path, device, dtype):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    kwargs = {"num_labels": 1} | ({"dtype": dtype} if dtype is not None else {})
    if (path / "adapter_config.json").is_file():
        from peft import PeftModel

        base = _read_json(path / "adapter_config.json")["base_model_name_or_path"]
        base_model = AutoModelForSequenceClassification.from_pretrained(base, **kwargs)
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(base_model, str(path))
    else:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def encode_for_reward(tokenizer, prompt, completion, chat: bool | None = None) -> list[int]:
    """The ids a reward model trained here reads for prompt + completion: the training encoding (preference_data).
    Text is wrapped as a user and an assistant message when `chat` (default: the tokenizer has a chat template)."""
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat and isinstance(completion, str):  # messages are always encoded through the template
        completion = [{"role": "assistant", "content": completion}]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    row = {"prompt": prompt, "chosen": completion, "rejected": completion}
    prompt_part, completions, conversational = pdata.prompt_and_completions(row, "paired")
    plan = None
    if conversational:  # the template's masking plan, worked out once per tokenizer
        held = _PLANS.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            held = _PLANS[id(tokenizer)] = (tokenizer, plan_masking(tokenizer))
        plan = held[1]
    return pdata.encode_completion(tokenizer, plan, prompt_part, completions[0], conversational)[0]


_PLANS: dict[int, tuple] = {}


@torch.no_grad()
def score_ids(model, rows: list[list[int]], pad_token_id: int, batch_size: int = 8,
              lockstep: bool = False) -> list[float]:
    """Rewards of token rows, batched (right padding, as in training). `lockstep` (a model sharded by FSDP2, whose
    every forward is a collective): every rank runs as many forwards as the rank with the most batches; a rank with
    fewer rows scores a one-token dummy batch and drops its rewards."""
    device = next(model.parameters()).device
    batches = -(-len(rows) // batch_size)
    if lockstep:
        batches = _most_across_ranks(batches, device)
    out: list[float] = []
    for start in range(0, batches * batch_size, batch_size):
        chunk = rows[start:start + batch_size]
        rewards = sequence_rewards(model, *padded_rows(chunk or [[pad_token_id]], pad_token_id, device))
        if chunk:
            out += rewards.tolist()
    return out


def padded_rows(chunk: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) right-padded as training collates them (preference_data), on `device`."""
    ids, mask = pdata._pad(chunk, pad_token_id)
    return ids.to(device), mask.to(device)


def _most_across_ranks(count: int, device) -> int:
    import torch.distributed as dist

    held = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return int(held[0])


def fsdp_ranks() -> int:
    """The ranks a reward model is sharded across: every rank of the run under FSDP2, else 1 (a plain copy)."""
    import torch.distributed as dist

    if fsdp_requested() and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def shard_frozen(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank, as accelerate wraps the policy and its reference (TRANSFORMER_BASED_WRAP): each of the
    model's _no_split_modules (its decoder layers) a unit, the rest (embeddings, norm, score head) the root's. Every
    unit, the root too, gives its gathered weights back after each forward: nothing here is trained."""
    from torch.distributed.fsdp import fully_shard

    layers = set(getattr(transformers_model(model), "_no_split_modules", None) or ())
    for module in list(model.modules())[1:]:
        if type(module).__name__ in layers:
            fully_shard(module, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)


def held_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters this rank holds, parameters of the model): its shards of DTensors, all of plain tensors."""
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return held, sum(p.numel() for p in model.parameters())


def score_texts(model, tokenizer, pairs: list[tuple], batch_size: int = 8, chat: bool | None = None,
                lockstep: bool = False) -> list[float]:
    """Rewards of (prompt, completion) pairs, each text or a list of messages."""
    rows = [encode_for_reward(tokenizer, p, c, chat) for p, c in pairs]
    return score_ids(model, rows, tokenizer.pad_token_id, batch_size, lockstep)


class ModelReward:
    """A trained reward model as a GRPO reward function (reward_funcs: "model:PATH"): loaded once, at its first call,
    and called on each batch of completions under no_grad. On one process or under DDP a plain copy on this rank's
    device; under FSDP2 sharded across the ranks (shard_frozen), so that each holds 1/N of it, and then every rank
    runs the same number of forwards per call (score_ids' lockstep). Text prompts are scored as method: reward
    trains on text (prompt, completion, eos), conversational ones through the chat template."""

    def __init__(self, path: Path, batch_size: int = 16):
        self.path, self.batch_size = Path(path), batch_size
        self.__name__ = self.path.name
        self._model = self._tokenizer = None
        self.collective = False  # sharded: its forward is a collective, never to be called on one rank alone

    @classmethod
    def checked(cls, path: str, base_dir: Path | None, where: str) -> "ModelReward":
        """ConfigError (one line) for a path that is not a reward model; a relative path is the config file's."""
        resolved = Path(path).expanduser()
        if not resolved.is_absolute() and base_dir is not None:
            resolved = Path(base_dir) / resolved
        problem = reward_model_problem(resolved)
        if problem:
            raise ConfigError(f"{where}: model:{path}: {problem}")
        return cls(resolved)

    def load(self, device=None):
        if self._model is None:
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            dtype = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
            ranks = fsdp_ranks()
            # sharded: read into host memory; fully_shard moves it to the device a unit at a time, keeping this
            # rank's shards
            model, self._tokenizer = load_scorer(self.path, "cpu" if ranks > 1 else device, dtype)
            model.requires_grad_(False)
            if ranks > 1:
                shard_frozen(model)
                self.collective = True
                held, total = held_parameters(model)
                FILE_ONLY.info("reward model %s: sharded by FSDP2 across %d ranks; this rank holds %d of its %d "
                               "parameters", self.__name__, ranks, held, total)
            self._model = model
        return self._model, self._tokenizer

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        model, tokenizer = self.load()
        rewards = score_texts(model, tokenizer, list(zip(prompts, completions)), self.batch_size, chat=False,
                              lockstep=self.collective)
        if self.collective:
            model.reshard()  # older torches keep the root's weights gathered after its forward, whatever it was told
        return rewards
