"""SFT's data half of the TrainingMethod seam (methods_seam.md): which format a dataset is in, why a row does not fit
it, a row encoded as input_ids and labels (only the model's own output trained), and an example's length in a batch.
The preprocessing driver calls only these, so another method (preference pairs, say) plugs in its own."""

from __future__ import annotations

import functools

from ..config import DatasetSpec, TrainConfig
from ..errors import first_line
from ..data.chat_masking import MaskingPlan, plan_masking
from ..data.encoding import count_targets, encode_chat, encode_text
from ..data.formats import TOO_LONG, RowProblem, check_row, detect_format, to_conversation
from ..data.images import image_values
from ..data.masking_check import MaskingReport, check_masking
from ..data.method_data import MethodData
from ..data.templates import describe_plan, dropped_by_template, template_label


class SFTData(MethodData):
    name = "sft"
    columns = ("input_ids", "labels")  # ragged int columns of an encoded example; labels are -100 where not trained

    def __init__(self, tokenizer, config: TrainConfig, plan: MaskingPlan | None = None):
        self.tokenizer, self.config = tokenizer, config
        if plan is not None:
            self.plan = plan

    @functools.cached_property
    def plan(self) -> MaskingPlan:
        """Worked out when a row is first encoded (rendering the known templates takes about a second): a worker
        that reads its rows from the preprocessing cache never needs it."""
        return plan_masking(self.tokenizer)

    def detect_format(self, columns: list[str], spec: DatasetSpec) -> str:
        return detect_format(columns, spec)

    def check_row(self, row: dict, fmt: str, spec: DatasetSpec) -> RowProblem | None:
        if isinstance(row, dict) and image_values(row):  # vision_rows.VisionSFTData trains them
            return RowProblem("images for a text model", f"it has images, and {self.config.model_name} takes none (no "
                                                         "vision tower, or no image processor saved with it)")
        return check_row(row, fmt, spec)

    def encode(self, row: dict, fmt: str, tokenizer=None, config: TrainConfig | None = None,
               spec: DatasetSpec | None = None) -> dict | RowProblem:
        """The example's columns (and its truncated / response_cut flags), or why it cannot be trained: its length,
        a chat template that would drop part of it, or a template that cannot render it."""
        tokenizer, config, plan = tokenizer or self.tokenizer, config or self.config, self.plan
        item = to_conversation(row, fmt, spec)
        if isinstance(item, str):
            encoded = encode_text(item, tokenizer, config.max_seq_length)
        else:
            try:
                problem = dropped_by_template(tokenizer, plan, plan.prepare(item.messages), item.tools)
                if problem is not None:
                    return problem
                encoded = encode_chat(item, tokenizer, plan, config.max_seq_length, config.train_on_inputs,
                                      config.truncation, config.excess_length_strategy)
            except Exception as exc:  # jinja2 TemplateError and friends: the template rejects this conversation
                return RowProblem("chat template cannot render it",
                                  f"the chat template {template_label(plan)} cannot render it: {type(exc).__name__}: "
                                  f"{first_line(exc, '')}")
        if count_targets(encoded.labels) == 0:
            if encoded.dropped or encoded.truncated:
                return RowProblem(TOO_LONG, f"{TOO_LONG} ({config.max_seq_length} tokens; excess_length_strategy: "
                                            f"{config.excess_length_strategy})")
            return RowProblem("nothing to train", "no token of it is trained once rendered")
        return {"input_ids": encoded.input_ids, "labels": encoded.labels, "truncated": encoded.truncated,
                "response_cut": encoded.response_cut}

    def length(self, example: dict) -> int:
        return len(example["input_ids"])

    def masking(self) -> str:
        return describe_plan(self.plan)

    def sample_problems(self, rows: list[dict], fmt: str, spec: DatasetSpec) -> str:
        """The masking guarantee, checked on a sample of rows that encoded; '' when it holds."""
        config, tokenizer, plan = self.config, self.tokenizer, self.plan
        if fmt == "text" or config.train_on_inputs:
            return ""
        report = MaskingReport()
        for row in rows:
            conversation = to_conversation(row, fmt, spec)
            messages = plan.prepare(conversation.messages)
            encoded = encode_chat(conversation, tokenizer, plan, config.max_seq_length, False, config.truncation,
                                  config.excess_length_strategy)
            if not encoded.truncated:
                check_masking(tokenizer, plan, messages, conversation.tools, encoded.labels, encoded.input_ids, report)
        return report.summary()
