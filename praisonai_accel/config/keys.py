"""config.yaml's keys, each described on its field: one class per group, composed into TrainConfig (config.py).

The descriptions are data: `praisonai-accel config schema` writes them into a JSON Schema, and docs/reference.md is
generated from it (commands/_schema.py). A group's docstring's first line is its title there.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class DatasetSpec(BaseModel):
    """One entry of `dataset` or `eval_dataset` (a bare name stands for an entry with only `name`)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    name: str = Field(description="A Hub dataset id, or a local .json/.jsonl/.csv/.parquet/.txt file, or a folder "
                                  "laid out as a Hub dataset repository.")
    split: str = Field(default="train", description="The split to read (praisonai-train's name: split_type).")
    subset: str | None = Field(default=None, description="The dataset's configuration (subset), as `datasets` names "
                                                         "it; for a local folder, a config of its dataset card.")
    data_files: str | list[str] | None = Field(
        default=None, description="Files of the dataset to read, passed to `datasets.load_dataset`.")
    format: Literal["auto", "alpaca", "sharegpt", "messages", "text"] = Field(
        default="auto", description="How rows are read; auto: from the columns (instruction+output: alpaca, "
                                    "conversations: sharegpt, messages, then text_field: text).")
    text_field: str = Field(default="text", description="The column of format text (every token of it is trained).")
    num_samples: int | None = Field(default=None, gt=0, description="Read only the first N rows.")
    system_prompt: str | None = Field(
        default=None, description="A system message put before every conversation that has none.")


class ModelKeys(BaseModel):
    """Model: the checkpoint and how it is loaded."""

    model_name: str = Field(description="The model to fine-tune: a Hub id or a local directory.")
    tokenizer_name: str | None = Field(default=None, description="A tokenizer other than model_name's.")
    revision: str | None = Field(
        default=None, description="A branch, tag or commit of model_name (and tokenizer_name) on the Hub; resolved "
                                  "once to a commit that every rank loads and train_summary.json records. Default: main.")
    max_seq_length: int = Field(default=2048, gt=0, description="The longest example (or packed row), in tokens.")
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="The dtype the weights load in; auto: bf16/fp16 on a GPU for LoRA, fp32 for full "
                                    "fine-tuning and on CPU.")
    device_map: Union[str, dict[str, Union[int, str]], None] = Field(
        default=None, description="Where the weights go (transformers' device_map); default: one full copy per rank. "
                                  "auto, balanced and sequential are refused under DDP, before launch.")
    use_unsloth: Union[bool, Literal["auto"]] = Field(
        default="auto", description="Load and patch the model with unsloth; auto: for a text model on a CUDA GPU "
                                    "when it imports, true: require it, false: never.")
    use_gradient_checkpointing: Union[bool, Literal["unsloth", "reentrant"]] = Field(
        default=False, description="true: non-reentrant checkpointing (safe under DDP); reentrant: torch's reentrant "
                                   "checkpointing; unsloth: unsloth's (with use_unsloth).")
    trust_remote_code: bool = Field(
        default=False, description="Run the model repository's own Python code (transformers' trust_remote_code); "
                                   "pin a revision with it.")


class DataKeys(BaseModel):
    """Data: what is read, how it is tokenized and batched."""

    dataset: list[DatasetSpec] = Field(
        min_length=1, description="The training data: one dataset or a list of them, concatenated (each a mapping "
                                  "of the keys below, or a bare name).")
    train_on_inputs: bool = Field(
        default=False, description="false: only the model's own output (assistant turns) is trained; true: every token.")
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template to use instead of the tokenizer's, or the path of a file "
                                  "holding one.")
    dataset_num_proc: int | None = Field(
        default=None, gt=0, description="Processes that tokenize each dataset (datasets' map num_proc); default: one, "
                                        "in the launcher.")
    dataset_prepared_path: str | None = Field(
        default=None, description="Where tokenized datasets are cached; one directory can serve many runs. Default: "
                                  "output_dir/.cache/preprocessed.")
    group_by_length: bool = Field(
        default=False, description="Batch examples of similar length (sorted within windows of "
                                   "group_by_length_window): far less padding, the same order for any process layout.")
    group_by_length_window: int = Field(default=256, gt=0,
                                        description="Examples sorted together by group_by_length.")
    truncation: Literal["keep_response", "right"] = Field(
        default="keep_response", description="keep_response: a long conversation loses its oldest turns, then the start "
                                             "of the last user turn, never the response; right: cut at max_seq_length.")
    excess_length_strategy: Literal["truncate", "drop"] = Field(
        default="truncate", description="When even the response does not fit: truncate keeps the start of the "
                                        "response (its end is not trained), drop leaves the example out.")
    packing: bool = Field(default=False, description="Fill rows of max_seq_length with whole examples; attention never "
                                                     "crosses examples.")
    skip_invalid_rows: bool = Field(
        default=False, description="Train on the valid rows instead of stopping; every other row is listed in "
                                   "output_dir/logs/skipped_rows.jsonl.")


class FinetuneKeys(BaseModel):
    """Fine-tune type and LoRA."""

    finetune_type: Literal["lora", "qlora", "full"] = Field(
        default="lora", description="lora: adapters on frozen weights; qlora: adapters on 4-bit (NF4) weights; full: "
                                    "every weight trains.")
    load_in_4bit: bool | None = Field(
        default=None, description="praisonai-train's switch for 4-bit weights: true makes finetune_type qlora (and is "
                                  "refused with full).")
    lora_r: int = Field(default=16, gt=0, description="LoRA's rank.")
    lora_alpha: int = Field(default=16, gt=0, description="LoRA's scaling numerator: updates are scaled by "
                                                          "lora_alpha / lora_r.")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on LoRA's input.")
    lora_target_modules: Union[list[str], Literal["all-linear"]] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="The modules that get adapters, by name, or all-linear (peft's target_modules).")
    lora_bias: Literal["none", "all", "lora_only"] = Field(
        default="none", description="Which biases train with the adapters (peft's bias): none, all of them, or those "
                                    "of the adapted modules only.")
    use_rslora: bool = Field(
        default=False, description="Rank-stabilized LoRA (peft's use_rslora): updates scaled by lora_alpha / "
                                   "sqrt(lora_r) instead of lora_alpha / lora_r, for high ranks.")
    offload_embedding: bool = Field(
        default=False, description="unsloth's offload_embedding: under lora or qlora the frozen input embedding table "
                                   "stays in host memory; each step looks up its tokens' rows on the CPU and moves "
                                   "only those to the GPU (a 128k x 4096 table is 1 GB of GPU memory in bf16, 2 GB "
                                   "under qlora). Not with finetune_type: full, an embedding tied to the LM head, "
                                   "--fsdp, a device_map or use_unsloth: true.")


class OptimizerKeys(BaseModel):
    """Optimisation: batch, optimizer, schedule."""

    per_device_train_batch_size: int = Field(default=2, gt=0, description="Examples per process per micro-batch.")
    gradient_accumulation_steps: int = Field(default=1, gt=0,
                                             description="Micro-batches summed into each optimizer step.")
    learning_rate: float = Field(default=2e-4, gt=0, description="The peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0,
                                description="AdamW's weight decay; never applied to biases and norms.")
    max_grad_norm: float = Field(default=1.0, ge=0,
                                 description="Gradients are clipped to this norm; 0: no clipping (grad_norm is logged "
                                             "either way).")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW's decay of the gradient's running mean.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1,
                              description="AdamW's decay of the squared gradient's running mean (also 8-bit AdamW's; "
                                          "sgd ignores it).")
    adam_epsilon: float = Field(default=1e-8, gt=0, description="AdamW's epsilon.")
    num_train_epochs: int = Field(default=1, gt=0, description="Passes over the training data (unless max_steps is set).")
    max_steps: int = Field(default=-1, description="Optimizer steps to train; -1: num_train_epochs decides.")
    warmup_steps: int = Field(default=0, ge=0, description="Steps of linear warmup; wins over warmup_ratio.")
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1,
                                description="Warmup as a fraction of the run's steps, when warmup_steps is 0.")
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
    ] = Field(default="linear", description="The learning-rate schedule after warmup (transformers' get_scheduler).")
    optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "sgd"] = Field(
        default="adamw_torch", description="The optimizer; the 8-bit ones need bitsandbytes (the qlora extra).")
    seed: int = Field(default=3407, description="Seeds data order, LoRA's initialisation and dropout.")


class ProcessKeys(BaseModel):
    """Precision, processes and timeouts."""

    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = Field(
        default="auto", description="auto: bf16 where the GPU has it natively (compute capability 8.0+), else fp16 "
                                    "with loss scaling; none on CPU.")
    ddp_find_unused_parameters: bool | None = Field(
        default=None, description="Passed to DistributedDataParallel; default true under DDP (false with reentrant "
                                  "checkpointing, which cannot work with it).")
    ddp_timeout: int = Field(default=1800, gt=0,
                             description="Seconds a collective waits for every rank (torch's default).")
    preflight_timeout: float = Field(default=60, gt=0,
                                     description="Seconds for the all-reduce every rank does before the model loads.")
    hang_timeout: float = Field(
        default=1800, ge=0, description="Seconds without a finished step, evaluation or save before a rank reports "
                                        "where it is stuck and the job stops; 0: off.")
    preemption_grace_seconds: int = Field(
        default=120, ge=0, description="Seconds torchrun lets workers save after SIGTERM before SIGKILL (its own "
                                       "default is 30).")


class LossAndLengthKeys(BaseModel):
    """Loss kernels and long context."""

    chunked_loss: bool = Field(
        default=True, description="The LM head and cross-entropy at target tokens only, in chunks; false: the model's "
                                  "full logits.")
    use_liger: Union[bool, Literal["auto"]] = Field(
        default="auto", description="liger-kernel's fused linear cross-entropy; auto: when installed and on a GPU, "
                                    "true: require it.")
    sequence_parallel_size: int = Field(
        default=1, ge=1, description="Ranks that share every row (DeepSpeed-Ulysses attention), each holding a slice "
                                     "of its tokens.")
    tiled_mlp: bool = Field(default=False, description="Run each layer's MLP over tiles of the row, recomputed in "
                                                       "backward.")
    tiled_mlp_shards: int | None = Field(default=None, gt=0,
                                         description="Tiles per row for tiled_mlp; default: about hidden_size tokens "
                                                     "per tile.")


class OutputKeys(BaseModel):
    """Outputs and logging."""

    output_dir: str = Field(default="outputs", description="Where checkpoints, logs and the final model go.")
    final_model_dir: str | None = Field(
        default=None, description="The final model's directory, under output_dir unless absolute; default lora_model "
                                  "for LoRA / QLoRA, model for a full fine-tune; never output_dir, one of its parents "
                                  "or a checkpoint-N name.")
    logging_steps: int = Field(default=1, gt=0, description="Optimizer steps between logged metrics.")
    report_to: Union[Literal["none", "tensorboard", "wandb", "mlflow", "trackio"],
                     list[Literal["tensorboard", "wandb", "mlflow", "trackio"]]] = Field(
        default="none", description="Trackers that get the metrics: tensorboard, wandb, mlflow, trackio, or a list.")
    run_name: str | None = Field(default=None,
                                 description="The run's name in the trackers; default: output_dir's name.")
    plot_loss: bool = Field(default=True, description="Draw output_dir/loss.png at the end of training (LLaMA-Factory's "
                                                      "key).")


class CheckpointKeys(BaseModel):
    """Checkpoints and resume."""

    save_strategy: Literal["no", "steps", "epoch"] | None = Field(
        default=None, description="When checkpoints are saved; default: steps if save_steps is set, else no.")
    save_steps: int | None = Field(default=None, gt=0, description="Optimizer steps between checkpoints.")
    save_total_limit: int | None = Field(default=None, gt=0,
                                         description="Checkpoints kept; older ones are deleted (never the best one).")
    resume_from_checkpoint: Union[bool, str] = Field(
        default=True, description="true: continue from the latest complete checkpoint of output_dir; a path: from "
                                  "that checkpoint; false: always start fresh.")
    force_resume: bool = Field(default=False, description="Resume from a resume_from_checkpoint path that belongs to "
                                                          "another run, on purpose.")
    overwrite_output_dir: bool = Field(
        default=False, description="Start another run in an output_dir that holds one, deleting its checkpoints.")


class EvalKeys(BaseModel):
    """Evaluation and early stopping."""

    eval_dataset: list[DatasetSpec] | None = Field(default=None,
                                                   description="Evaluation data, written as dataset is.")
    val_split_ratio: float = Field(default=0.0, ge=0.0, lt=1.0,
                                   description="Hold out this fraction of the training data for evaluation instead.")
    eval_strategy: Literal["no", "steps", "epoch"] | None = Field(
        default=None, description="When to evaluate; default: steps if eval_steps is set, else epoch, when there is "
                                  "eval data.")
    eval_steps: int | None = Field(default=None, gt=0, description="Optimizer steps between evaluations.")
    eval_tasks: list[str] | None = Field(
        default=None, description="lm-eval tasks scored at each evaluation and at the end, on all ranks together "
                                  "(the [eval] extra), logged as eval_<task>/<metric>; metric_for_best_model may "
                                  "name one.")
    eval_include_path: str | None = Field(default=None, description="A directory of lm-eval YAML tasks for eval_tasks.")
    eval_limit: float | None = Field(default=None, gt=0, description="At most this many documents per eval_tasks task "
                                                                     "(a fraction below 1).")
    eval_apply_chat_template: bool | None = Field(
        default=None, description="Render eval_tasks prompts with the chat template; default: as the run renders its "
                                  "rows (`eval`'s default too).")
    per_device_eval_batch_size: int | None = Field(
        default=None, gt=0, description="Examples per process per eval batch; default: per_device_train_batch_size.")
    load_best_model_at_end: bool = Field(
        default=False, description="Save the best checkpoint's weights as the final model; needs the same save and "
                                   "eval strategy (save_steps a multiple of eval_steps).")
    metric_for_best_model: str = Field(
        default="eval_loss", description="The metric that picks the best checkpoint: eval_loss, or an eval metric of "
                                         "the method (eval_rewards/accuracies, eval_reward).")
    greater_is_better: bool | None = Field(
        default=None, description="Whether a larger metric_for_best_model is better; default (as in transformers): "
                                  "true unless its name ends in loss.")
    early_stopping_patience: int | None = Field(
        default=None, gt=0, description="Stop after this many evaluations without improvement.")
    early_stopping_threshold: float = Field(
        default=0.0, ge=0.0, description="How much metric_for_best_model must improve to count as an improvement.")


class PublishKeys(BaseModel):
    """Publishing: rank 0 only, after training; the token comes from HF_TOKEN, never from this file."""

    push_to_hub: bool = Field(default=False, description="Upload the final model (and checkpoints, by hub_strategy) "
                                                         "to hub_model_id.")
    hub_model_id: str | None = Field(default=None, description="The Hub repository to push to (your-name/my-model).")
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = Field(
        default="end", description="What is pushed besides the final model: end: nothing; every_save: each "
                                   "checkpoint's adapter as it is saved; checkpoint: the latest checkpoint as "
                                   "last-checkpoint/; all_checkpoints: every checkpoint in its own folder.")
    hub_private: bool = Field(default=True, description="Create the repository private (an existing public one is "
                                                        "refused).")
    ollama_model: str | None = Field(default=None, description="Create this Ollama model (name:tag) after training.")
    ollama_base: str | None = Field(default=None, description="An Ollama model to use as FROM; default: upload the base "
                                                              "model's files.")
    ollama_push: bool = Field(default=False, description="Push ollama_model to the Ollama registry.")


class GGUFKeys(BaseModel):
    """GGUF export: after training, under praisonai-train's names (rank 0, after the final save)."""

    GGUF_METHODS: ClassVar[tuple] = ("q4_k_m", "q5_k_m", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q3_k_m", "q6_k",
                                     "q2_k", "f16", "bf16")
    quantization_method: Union[str, list[str]] = Field(
        default="q4_k_m", description="One GGUF quantization or several, a .gguf file for each: q4_k_m q5_k_m q8_0 "
                                      "q4_0 q4_1 q5_0 q5_1 q3_k_m q6_k q2_k f16 bf16.")
    save_gguf: bool = Field(default=False, description="Write output_dir/gguf/<final_model_dir>-<METHOD>.gguf.")
    huggingface_save_gguf: bool = Field(default=False, description="Also upload the .gguf files to hub_model_id.")
    ollama_save: bool = Field(default=False, description="Create ollama_model FROM the first method's .gguf instead of "
                                                         "from safetensors.")
