"""Supervised fine-tuning: next-token cross-entropy on the trained tokens, a mean over every target token of the
optimizer step. The LM head is applied at target positions only, in chunks (lm_loss.py), unless peft trains the
head or the model's head is not a plain linear layer over its decoder output."""

from __future__ import annotations

from ..data import PadCollator, target_count
from ..data.chat_masking import IGNORE_INDEX
from ..data.vision_processor import processor_of
from .base import TrainingMethod, log
from .sft_rows import SFTData
from .vision_rows import VisionCollator, VisionSFTData


class SFT(TrainingMethod):
    """Supervised fine-tuning (TRL's SFTTrainer): the language-model loss on the trained tokens of each row."""

    name = "sft"
    unit = "target tokens"
    headline_metrics = ()  # the loss says it all
    supports_sequence_parallel = True
    takes_images = True

    @classmethod
    def cache_identity(cls, config) -> dict:
        return {}  # SFT's entries keep the keys they had before other methods existed

    processor = None  # a vision-language model's processor: its rows carry images (vision_rows.py)

    def data(self, tokenizer):
        """Rows -> input_ids and labels (sft_rows.py); rows with images for a vision-language model's tokenizer (it
        carries the processor: vision_rows.py)."""
        self.processor = processor_of(tokenizer)
        if self.processor is not None:
            return VisionSFTData(tokenizer, self.config)
        return SFTData(tokenizer, self.config)

    def collator(self, pad_token_id: int):
        if self.processor is not None:
            return VisionCollator(pad_token_id, self.processor)
        return PadCollator(pad_token_id)

    def filler(self, example: dict) -> dict:
        import numpy as np

        return {**example, "labels": np.full(len(example["labels"]), IGNORE_INDEX, dtype=np.int64)}

    def units(self, batch: dict):
        return target_count(batch)

    def loss_module(self, causal_lm, *, accelerator, tokenizer, use_cuda: bool):
        from .lm_loss import CausalLMLoss, ShardedCausalLMLoss, load_liger

        config = self.config
        # sequence_parallel_size > 1: a slice of each row, its labels shifted on the whole row
        loss = ShardedCausalLMLoss if config.sequence_parallel_size > 1 else CausalLMLoss
        module = loss(causal_lm, chunked=config.chunked_loss, liger=load_liger(config.use_liger, use_cuda))
        return settle_chunking(module, accelerator, tokenizer)

    def forward(self, module, batch: dict):
        images = {k: v for k, v in batch.items() if k not in TEXT_KEYS}  # pixel_values, image_grid_thw, ...
        return module(batch["input_ids"], batch["labels"], batch["attention_mask"], batch.get("position_ids"),
                      **images), {}


TEXT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def settle_chunking(module, accelerator, tokenizer):
    """The LM head at target positions only, in chunks, where that gives the model's own logits; else full logits
    (peft trains the head, or the head is not a plain linear layer over the decoder output)."""
    from .lm_loss import verify_head, wraps_head

    if module.chunked and wraps_head(module):
        module.chunked = False
        log.info("loss: lm_head is trained through peft (LoRA or modules_to_save), which the chunked loss would "
                 "bypass; using the model's full logits")
    probe = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    # on the device the model's weights are on: under FSDP rank 0 holds them in host memory until prepare
    device = next(module.parameters()).device
    if module.chunked and not head_verified(accelerator, lambda: verify_head(module, probe, device)):
        module.chunked = False
        log.warning("warning: this model's head is not a plain linear layer over the decoder output; "
                    "the loss uses its full logits")
    log.info("loss: %s", "liger fused linear cross-entropy" if getattr(module, "liger", None) is not None and module.chunked
             else "LM head at target positions only, chunked" if module.chunked else "full logits")
    return module


def head_verified(accelerator, verify) -> bool:
    """Under FSDP only rank 0 holds real weights before prepare (the others wait on the meta device for its
    broadcast), so rank 0 checks the head and tells the others."""
    if accelerator.distributed_type.name != "FSDP":
        return verify()
    import torch
    import torch.distributed as dist

    verdict = torch.tensor([float(verify()) if accelerator.is_main_process else 0.0])
    dist.broadcast(verdict, src=0)
    return bool(verdict[0] > 0)
