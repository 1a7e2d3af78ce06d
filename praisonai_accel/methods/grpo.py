"""GRPO (online RL from the user's reward functions) as a training method: TRL's GRPOTrainer's meaning, in the seam.

Each rank's loader yields per_device_train_batch_size / num_generations prompts per micro-batch, so a prompt's
whole group is generated, scored and normalised on one rank and the advantages need no gather. Before each
optimizer step the recipe calls `rollout` with the step's micro-batches of prompts; for each, the policy being
trained (LoRA adapters active, eval mode, no gradients, KV cache) samples num_generations completions per prompt
(generation.py), the reward functions score them (rewards.py), advantages are group-normalised (grpo_loss.py), and
with beta > 0 the reference's log-probs are taken. The micro-batch then holds prompt + completion rows whose
labels are the trained completion tokens; `forward` takes the policy's log-probs at those positions only and
returns grpo_loss.policy_loss's sum, whose units (tokens, completions, ...) `units` reads from the batch.

Each prompt's group samples from its own torch.Generator, seeded from (seed, the steps already taken, the prompt's
dataset row): the step is in every checkpoint, and weights and data order are restored exactly, so a resumed run
samples exactly what the uninterrupted one would have; and since a group's draws depend on nothing else in its
batch, 2 ranks x B prompts sample the completions of 1 rank x 2B.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from . import grpo_data, grpo_loss
from .base import TrainingMethod
from .rewards import reward_name
from .rollout import FILLER, LENGTH

ROLLED = "completion_mask"  # a batch that has been through the rollout holds it
COMPLETIONS_FILE = "completions.jsonl"
BUFFER_FILE = "rollout_{rank}.safetensors"  # in a checkpoint taken mid-way through a batch's num_iterations steps


def rollout_metric_names(names) -> tuple[str, ...]:
    """The sums a rollout adds to a micro-batch's metrics (grpo_loss.reward_metric_sums' and the lengths)."""
    keys = [f"rewards/{name}" for name in names] + ["reward"]
    return (*(f"{key}/{kind}" for key in keys for kind in ("count", "sum", "squares")), "reward/zero_std",
            "reward/completions", LENGTH)


class GRPO(TrainingMethod):
    name = "grpo"
    headline_metrics = ("reward", "rewards/*/mean", "completions/mean_length")
    supports_sequence_parallel = False

    def __init__(self, config):
        super().__init__(config)
        self.unit = {"grpo": "completions", "dr_grpo": "completions x max_completion_length"}.get(
            config.loss_type, "completion tokens")
        self.names = [reward_name(entry) for entry in config.reward_funcs or []]
        self.steps_per_batch = config.num_iterations  # the recipe hands rollout each step's prompts that many times
        self._buffer: list[dict] | None = None  # the generated batch being trained on (num_iterations > 1)
        self._buffer_step = -1  # the step that generated it
        self.metric_names = (*grpo_loss.POLICY_METRICS, *rollout_metric_names(self.names))
        self.reward_functions = None  # loaded with the loss module (rewards.load_reward_functions)
        self.tokenizer = None
        self.accelerator = None
        self.stop_ids: list[int] = []
        self.pad_token_id = 0
        self._eval_batches = 0
        self._last_step = self._total_steps = 0
        self._epoch = 0.0
        self._trimmed = False

    # ---------------------------------------------------------------- data
    def data(self, tokenizer):
        return grpo_data.GRPOData(tokenizer, self.config)

    def loader_batch_size(self, per_device_train_batch_size: int) -> int:
        return per_device_train_batch_size // self.config.num_generations  # prompts; it counts completions

    def collator(self, pad_token_id: int):
        self.pad_token_id = pad_token_id
        return functools.partial(self.collate, pad_token_id=pad_token_id)

    @staticmethod
    def collate(examples: list[dict], pad_token_id: int) -> dict:
        batch = grpo_data.collate_prompts(examples, pad_token_id)
        if any(FILLER in e for e in examples):
            batch[FILLER] = True
        return batch

    def filler(self, example: dict) -> dict:
        return {**example, FILLER: True}

    def examples_in(self, batch: dict) -> int:
        return int(batch["prompts"]) if ROLLED in batch else len(batch["input_ids"])

    def units(self, batch: dict):
        if batch.get(FILLER) or ROLLED not in batch:
            return 0
        return batch["units"]

    # ---------------------------------------------------------------- the module
    def loss_module(self, causal_lm, *, accelerator, tokenizer, use_cuda: bool):
        from ..inference import stop_token_ids
        from .grpo_module import GRPOLoss
        from .sft import settle_chunking

        self.accelerator, self.tokenizer = accelerator, tokenizer
        self.stop_ids = stop_token_ids(causal_lm, tokenizer)
        if self.reward_functions is None:
            from .rewards import load_reward_functions

            self.reward_functions = load_reward_functions(self.config)
        return settle_chunking(GRPOLoss(causal_lm, self.config, self.config.chunked_loss), accelerator, tokenizer)

    def forward(self, module, batch: dict):
        if ROLLED not in batch:  # evaluation: its prompts are rolled out here (in place, so units() sees them)
            batch.update(self.rollout(self.accelerator, module, [batch], None)[0])
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels", ROLLED, "advantages",
                                         "old_logps", "ref_logps") if k in batch}
        loss, metrics = module(**inputs)
        metrics = {**metrics, **batch["rollout_sums"]}
        if batch.get(FILLER):
            return loss * 0, {name: value * 0 for name, value in metrics.items()}
        return loss, metrics

    def reduce_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """TRL's logged values from sums over micro-batches and ranks: the rewards' means and stds over completions
        (each function's over the completions it scored), kl and clip_ratio over completion tokens."""
        out = {**grpo_loss.reward_metrics(sums, self.names), **grpo_loss.token_means(sums)}
        out["completions/mean_length"] = sums.get(LENGTH, 0.0) / max(sums.get("reward/completions", 0.0), 1.0)
        return out

    # ---------------------------------------------------------------- rollouts
    def rollout(self, accelerator, module, group: list[dict], global_step: int | None, total_steps: int = 0,
                epoch: float = 0.0) -> list[dict]:
        """The step's micro-batches of prompts -> micro-batches of scored completions. `global_step`: the steps
        already taken (None: evaluation's prompts); with total_steps and epoch, the reward functions' trainer_state."""
        from . import rollout as rollouts
        from .rewards import TrainerState

        if global_step is not None:
            self._last_step, self._total_steps, self._epoch = global_step, total_steps, epoch
            self._eval_batches = 0
            if global_step % self.steps_per_batch:  # TRL's num_iterations: the batch generated at the cycle's start
                generated = global_step - global_step % self.steps_per_batch
                if self._buffer is None or self._buffer_step != generated:
                    raise RuntimeError(f"num_iterations: step {global_step} trains on the rollout of step {generated}, "
                                       "which this process does not hold")
                return self._buffer
            self._buffer = None  # the last batch's steps are done: its memory is free for the next rollout
        state = TrainerState(self._last_step, self._total_steps, self._epoch)
        config = self.config
        was_training = module.training
        module.eval()
        try:
            scored = []
            for batch in group:
                if global_step is None:
                    key = ("eval", self._last_step, self._eval_batches)
                    self._eval_batches += 1
                else:
                    key = (global_step,)
                scored.append(rollouts.generate_and_score(self, accelerator, module, batch, (config.seed, *key), state))
            rollouts.set_advantages(self, accelerator, scored)
            for batch in scored:
                rollouts.add_reference(self, accelerator, module, batch)
                if global_step is not None and self.steps_per_batch > 1:
                    rollouts.add_old_logps(accelerator, module, batch)
        finally:
            module.train(was_training)
        # logged when generated, under the first step trained on it, if any of its steps is a logging step
        logs = global_step is not None and (global_step + self.steps_per_batch) // config.logging_steps > \
            global_step // config.logging_steps
        if logs and accelerator.is_main_process and config.log_completions:
            self._log_completions(global_step + 1, scored[0], accelerator)
        if global_step is not None and self.steps_per_batch > 1:
            self._buffer, self._buffer_step = scored, global_step
        return scored

    # ---------------------------------------------------------------- checkpoints
    def save_state(self, directory, accelerator, global_step: int) -> None:
        """Mid-way through a generated batch's num_iterations steps, each rank's rollout: the policy that generated
        it is gone, so a resumed run reads it back (safetensors; never a pickle)."""
        if global_step % self.steps_per_batch and self._buffer is not None:
            from .rollout import save_buffer

            save_buffer(Path(directory) / BUFFER_FILE.format(rank=accelerator.process_index), self._buffer,
                        self._buffer_step, accelerator.num_processes)

    def load_state(self, directory, accelerator, global_step: int) -> None:
        if not global_step % self.steps_per_batch:
            return
        from ..config import ConfigError
        from .rollout import load_buffer

        path = Path(directory) / BUFFER_FILE.format(rank=accelerator.process_index)
        if not path.is_file():
            raise ConfigError(f"resume_from_checkpoint: {Path(directory).name} was taken mid-way through a generated "
                              f"batch's num_iterations: {self.steps_per_batch} steps and holds no rollout for rank "
                              f"{accelerator.process_index} ({path.name}); resume with the processes and "
                              "num_iterations it was saved with")
        self._buffer, self._buffer_step, processes = load_buffer(path, accelerator.device)
        if processes != accelerator.num_processes:  # each process holds its own prompts' completions
            raise ConfigError(f"resume_from_checkpoint: {Path(directory).name} was taken by {processes} process(es) "
                              f"mid-way through a generated batch's num_iterations: {self.steps_per_batch} steps; "
                              f"resume it with {processes} process(es), not {accelerator.num_processes}")
        if self._buffer_step != global_step - global_step % self.steps_per_batch:
            raise ConfigError(f"resume_from_checkpoint: {path} holds the rollout of step {self._buffer_step}, which "
                              f"step {global_step} does not train on with num_iterations: {self.steps_per_batch}; "
                              "resume with the num_iterations it was saved with")

    def _log_completions(self, step: int, batch: dict, accelerator=None) -> None:
        """A few prompts with their completions and rewards in output_dir/logs/completions.jsonl (rank 0's first
        micro-batch of the step) and as a table in the trackers that show one; a resumed run first drops what an
        interrupted run wrote after its checkpoint."""
        path = self.config.output_path() / "logs" / COMPLETIONS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self._trimmed:
            self._trimmed = True
            if path.exists():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and _step_of(line) is not None and _step_of(line) < step]
                path.write_text("".join(line + "\n" for line in kept))
        records = batch["log_records"][:self.config.num_completions_to_print]
        with open(path, "a") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}, ensure_ascii=False, default=str) + "\n")
        if accelerator is not None and records:
            completions_to_trackers(accelerator, self.config.trackers, step, records)


def completions_to_trackers(accelerator, trackers: list[str], step: int, records: list[dict]) -> None:
    """TensorBoard gets a markdown table as text, wandb a Table; mlflow and trackio log numbers only."""
    if "tensorboard" in trackers:
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| prompt | completion | reward |", "|---|---|---|"]
        lines += [f"| {cell(r['prompt'])} | {cell(r['completion'])} | {r['reward']} |" for r in records]
        accelerator.get_tracker("tensorboard", unwrap=True).add_text("completions", "\n".join(lines), global_step=step)
    if "wandb" in trackers:
        import wandb

        table = wandb.Table(columns=["step", "prompt", "completion", "reward"],
                            data=[[step, str(r["prompt"]), r["completion"], r["reward"]] for r in records])
        accelerator.get_tracker("wandb", unwrap=True).log({"completions": table}, step=step)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
