"""Preference training as a training method: DPO (sigmoid, ipo, hinge, robust), SimPO, ORPO and KTO.

`PreferenceMethod` is what the recipe talks to (see the methods seam: formats, row checks, encoding, collation, units,
the loss module); `PreferenceLoss` is the module accelerate prepares. One forward of it does everything a step needs,
so DDP and FSDP2 see exactly one forward per backward:

- the reference log-probs, under no_grad and in eval mode: for LoRA / QLoRA the same model with its adapter disabled
  (peft's disable_adapter; no second copy), for full fine-tuning a frozen copy held as the submodule `reference`
  (so FSDP2 shards it like the policy); skipped when the batch carries precomputed ones (reference_logps.py), and for
  SimPO and ORPO, which need none;
- the policy log-probs of chosen and rejected, concatenated into one batch, through the chunked LM head;
- the loss summed over units (pairs; examples for KTO) and TRL's metrics as sums.
"""

from __future__ import annotations

import functools

from ..data import TOO_LONG, RowProblem
from ..data.chat_masking import IGNORE_INDEX, plan_masking
from ..data.method_data import MethodData
from . import preference_data as pdata
from .base import TrainingMethod
from .method_keys import KTO_METRICS, LOSS_TYPES, PAIR_METRICS, DPOKeys, KTOKeys, ORPOKeys, prompt_limit
from .sft import settle_chunking

FILLER = "filler"


def needs_reference(config) -> bool:
    return config.method == "kto" or (config.method == "dpo" and config.loss_type != "simpo")


def __getattr__(name: str):
    if name == "PreferenceLoss":  # torch: imported when asked for, not when the config reads the keys
        from .preference_module import PreferenceLoss

        return PreferenceLoss
    raise AttributeError(name)


class PreferenceMethod(TrainingMethod):
    """The training method the recipe drives for `method: dpo | orpo | kto` (methods/base.py)."""

    headline_metrics = ("rewards/accuracies", "rewards/margins")  # KTO logs no accuracy: its margin

    def __init__(self, config):
        super().__init__(config)
        self.name = config.method
        self.paired = config.method != "kto"
        self.unit = "pairs" if self.paired else "examples"
        # the sums forward returns (evaluation gathers these): KTO's means over desirable / undesirable examples need
        # their counts; reduce_metrics turns them into what is logged
        self.metric_names = (PAIR_METRICS if self.paired
                             else KTO_METRICS + ("count/desirable", "count/undesirable"))
        self._plans: dict[int, object] = {}
        self.pad_token_id = 0  # set by collator()

    @classmethod
    def cache_identity(cls, config) -> dict:
        return {"method": config.method, "max_prompt_length": config.max_prompt_length}

    @classmethod
    def preview_parts(cls, row: dict) -> list[tuple[str, list[int], list[int]]]:
        """A pair's prompt, then chosen and rejected after it; a KTO example's prompt, then its completion, titled
        by its label."""
        if "chosen_input_ids" in row:
            sides = [("chosen", "chosen"), ("rejected", "rejected")]
        else:
            sides = [("completion", "completion (desirable)" if int(row["label"][0]) else "completion (undesirable)")]
        first = sides[0][0]
        ids, labels = list(row[f"{first}_input_ids"]), list(row[f"{first}_labels"])
        start = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
        parts = [("prompt", ids[:start], labels[:start])]
        for key, title in sides:
            ids, labels = list(row[f"{key}_input_ids"]), list(row[f"{key}_labels"])
            parts.append((title, ids[start:], labels[start:]))
        return parts

    # ---------------------------------------------------------------- data
    def data(self, tokenizer):
        return PreferenceData(self, tokenizer)

    def detect_format(self, columns, spec) -> str:
        return pdata.detect_format(columns, spec, self.paired)

    def check_row(self, row: dict, fmt: str) -> str | None:
        return pdata.check_row(row, fmt)

    def _plan(self, tokenizer):
        if id(tokenizer) not in self._plans:
            self._plans[id(tokenizer)] = plan_masking(tokenizer)
        return self._plans[id(tokenizer)]

    def encode(self, row: dict, fmt: str, tokenizer, config, system_prompt: str | None = None):
        return pdata.encode_row(row, fmt, tokenizer, self._plan(tokenizer), prompt_limit(config),
                                config.max_seq_length, system_prompt)

    def length(self, example: dict) -> int:
        if self.paired:
            return len(example["chosen_input_ids"]) + len(example["rejected_input_ids"])
        return 2 * len(example["completion_input_ids"])  # with its row of the KL estimate

    @staticmethod
    def cut_counts(examples) -> dict[str, int]:
        """How many examples had their prompt cut to max_prompt_length, and their completions cut."""
        return {"prompt_cut": sum(int(e["prompt_cut"][0]) for e in examples),
                "completion_cut": sum(int(e["completion_cut"][0]) for e in examples)}

    # ---------------------------------------------------------------- batches
    def collate(self, examples: list[dict], pad_token_id: int) -> dict:
        batch = (pdata.collate_pairs if self.paired else pdata.collate_unpaired)(examples, pad_token_id)
        if any(FILLER in e for e in examples):
            batch[FILLER] = True  # evaluation's stand-in for a rank short of rows: it counts for nothing
        return batch

    def collator(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
        return functools.partial(self.collate, pad_token_id=pad_token_id)

    def filler(self, example: dict) -> dict:
        return {**example, FILLER: True}

    def examples_in(self, batch: dict) -> int:
        return batch["input_ids"].size(0) // 2 if self.paired else int(batch["desirable"].numel())

    def units(self, batch: dict) -> int:
        return 0 if batch.get(FILLER) else self.examples_in(batch)

    # ---------------------------------------------------------------- loss
    def loss_module(self, causal_lm, *, accelerator, tokenizer, use_cuda: bool):
        from .preference_module import PreferenceLoss

        return settle_chunking(PreferenceLoss(causal_lm, self.config, self.config.chunked_loss), accelerator, tokenizer)

    def forward(self, module, batch: dict):
        inputs = {k: v for k, v in batch.items() if k != FILLER}
        loss, metrics = module(**inputs)
        if batch.get(FILLER):
            return loss * 0, {name: value * 0 for name, value in metrics.items()}
        return loss, metrics

    def reduce_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """Metric sums (over ranks and micro-batches) as the means TRL logs. Pair metrics are means over pairs; KTO's
        chosen/rejected ones are means over the desirable / undesirable examples, as KTOTrainer logs them."""
        if self.paired:
            return {k: sums[k] / max(units, 1) for k in self.metric_names}
        chosen, rejected = sums["count/desirable"], sums["count/undesirable"]
        out = {"kl": sums["kl"] / max(units, 1)}
        if chosen:
            out["rewards/chosen"], out["logps/chosen"] = sums["rewards/chosen"] / chosen, sums["logps/chosen"] / chosen
        if rejected:
            out["rewards/rejected"] = sums["rewards/rejected"] / rejected
            out["logps/rejected"] = sums["logps/rejected"] / rejected
        if chosen and rejected:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def before_training(self, accelerator, module, dataset, collate, output_dir):
        """precompute_ref_log_probs: the reference log-probs of the training set, computed once (each rank its share,
        through the prepared module) and kept in output_dir/reference_logps/train.safetensors; a resume reads them."""
        if not (needs_reference(self.config) and self.config.precompute_ref_log_probs):  # ORPO has no such key
            return dataset
        from .reference_logps import precompute_on_ranks

        return precompute_on_ranks(self, accelerator, module, dataset, output_dir)


class PreferenceData(MethodData):
    """The data half the preprocessing driver runs (data/preprocess.py; SFT's is methods/sft_rows.SFTData)."""

    def __init__(self, method: PreferenceMethod, tokenizer):
        self.method, self.tokenizer, self.config, self.name = method, tokenizer, method.config, method.name
        self.columns = (("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
                        if method.paired else ("completion_input_ids", "completion_labels", "label"))
        self.columns += ("prompt_cut", "completion_cut")

    def detect_format(self, columns, spec) -> str:
        return self.method.detect_format(columns, spec)

    def check_row(self, row: dict, fmt: str, spec):
        why = self.method.check_row(row, fmt)
        return RowProblem(_kind(why), why) if why else None

    def encode(self, row: dict, fmt: str, tokenizer, config, spec):
        try:
            out = self.method.encode(row, fmt, tokenizer, config, getattr(spec, "system_prompt", None))
        except Exception as exc:  # a chat template that cannot render this conversation
            return RowProblem("chat template cannot render it", f"the chat template cannot render it: "
                                                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if isinstance(out, str):
            return RowProblem(TOO_LONG, out.replace("length: ", "", 1)) if out.startswith("length") else RowProblem("invalid", out)
        out["truncated"] = bool(out["prompt_cut"][0] or out["completion_cut"][0])
        out["response_cut"] = bool(out["completion_cut"][0])
        return out

    def length(self, example: dict) -> int:
        return self.method.length(example)


def _kind(why: str) -> str:
    """Rows counted by reason: the reason's gist."""
    for words, kind in (("missing", "missing or null field"), ("null", "missing or null field"),
                        ("empty", "empty field"), ("are the same", "chosen equals rejected"),
                        ("'label'", "label not true or false"), ("mix", "mixed text and messages")):
        if words in why:
            return kind
    return "invalid preference row"


class DPO(PreferenceMethod):
    """DPO and its loss types (TRL's DPOTrainer), SimPO as loss_type simpo (TRL's CPOTrainer)."""

    name = "dpo"
    keys = DPOKeys
    loss_types = LOSS_TYPES["dpo"]
    metrics = PAIR_METRICS

    @classmethod
    def unread_keys(cls, config) -> set[str]:
        unread = set() if config.loss_type in ("robust", "simpo") else {"label_smoothing"}
        return unread if config.loss_type == "simpo" else unread | {"simpo_gamma"}


class ORPO(PreferenceMethod):
    """ORPO (TRL's ORPOTrainer): reference-free, an odds-ratio term added to SFT's loss on chosen."""

    name = "orpo"
    keys = ORPOKeys
    metrics = PAIR_METRICS


class KTO(PreferenceMethod):
    """KTO (TRL's KTOTrainer): unpaired examples, each desirable or not."""

    name = "kto"
    keys = KTOKeys
    metrics = KTO_METRICS
