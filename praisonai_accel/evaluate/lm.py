"""lm-eval's HFLM over a model we loaded (the adapter on its base, the run's tokenizer and chat template), scoring
this rank's share of the requests; a vision-language model scores text tasks with its language model. lm-eval splits
requests only when it sees several CUDA devices and never for a model handed to it already loaded, so the rank, world
size and accelerator are given to it here (private attributes: lm-eval's minor version is pinned in the [eval]
extra)."""

from __future__ import annotations


def run_lm(model, tokenizer, batch_size: int, accelerator=None, max_length: int | None = None):
    from lm_eval.models.huggingface import HFLM

    from ..data.vision_processor import is_vision_config
    from ..models.inference import stop_token_ids, vision_messages

    # a vision-language template reads typed content parts: given lm-eval's plain strings, LLaVA's and Idefics3's
    # render the turn without its text. lm-eval's own hf-multimodal model makes the same parts.
    parts = is_vision_config(getattr(model, "config", None))

    class RunLM(HFLM):
        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            # stop at the model's real end of turn (as `chat` does), not the tokenizer's eos alone
            generation_kwargs.setdefault("eos_token_id", stop_token_ids(self.model, self.tokenizer))
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            if parts:
                chat_history = vision_messages(chat_history, 0)
            return super().apply_chat_template(chat_history, add_generation_prompt)

    lm = RunLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    if accelerator is not None and accelerator.num_processes > 1:
        lm.accelerator = accelerator
        lm._rank = accelerator.process_index
        lm._world_size = accelerator.num_processes
        lm._device = accelerator.device
    return lm
