"""One micro-batch of prompts -> completions sampled, scored, given advantages and (beta > 0) reference log-probs.

Generation goes through the unwrapped policy under DDP or on one process (each rank stops when its own rows have
ended), and through the prepared module under FSDP2, whose every forward all-gathers weights: there the ranks agree
after each token whether all of them are done (one all-reduce of a flag), so they run the same number of forwards.
Reference log-probs go through the prepared module under FSDP2 (one forward per micro-batch on every rank alike),
through the module inside it otherwise.
"""

from __future__ import annotations

import hashlib

import torch

from . import grpo_loss, tool_rollout
from .generation import positions_of, sample_completions
from .grpo_data import prompt_messages
from .method_keys import prompt_limit
from .grpo import FILLER, LENGTH
from .rewards import score



def _generation_forward(accelerator, module):
    if accelerator.distributed_type.name == "FSDP":
        def forward(ids, mask, positions, past):
            return module(input_ids=ids, attention_mask=mask, position_ids=positions, past=past, mode="decode")

        def all_done(finished: bool) -> bool:
            flag = torch.tensor([0.0 if finished else 1.0], device=accelerator.device)
            return bool(accelerator.reduce(flag, "sum")[0] == 0)

        return forward, all_done
    return accelerator.unwrap_model(module).decode, None


def _where(config, numbers, evaluation: bool) -> str:
    source, is_line, number = (int(x) for x in numbers)
    specs = (config.eval_dataset or config.dataset) if evaluation else config.dataset  # val_split_ratio: the train's
    name = specs[source].name if source < len(specs) else "dataset"
    return f"dataset {name} {'line' if is_line else 'row index'} {number}"


def sampling_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def generate_and_score(method, accelerator, module, batch: dict, key: tuple, trainer_state=None) -> dict:
    """`key`: what, with a prompt's row number, seeds its group's generator ((seed, step), or evaluation's)."""
    config, tokenizer = method.config, method.run.tokenizer
    g = config.num_generations
    device = accelerator.device
    forward, all_done = _generation_forward(accelerator, module)
    rows = batch["rows"]
    prompts = [row["prompt"] for row in rows for _ in range(g)]
    extra, tool_sums = {}, {}
    if method.tools is None:
        prompt_ids = batch["input_ids"].to(device).repeat_interleave(g, 0)
        prompt_mask = batch["attention_mask"].to(device).repeat_interleave(g, 0)
        generators = [torch.Generator(device=device).manual_seed(sampling_seed(*key, *row)) for row in
                      batch["row_numbers"].tolist()]
        with torch.no_grad(), accelerator.autocast():
            completions, keep, ended = sample_completions(
                forward, prompt_ids, prompt_mask, max_new_tokens=config.max_completion_length,
                temperature=config.temperature, top_p=config.top_p, stop_ids=method.stop_ids,
                pad_id=method.pad_token_id, generators=generators, all_done=all_done)
        trained = keep
        texts = tokenizer.batch_decode([c[k].tolist() for c, k in zip(completions, keep)], skip_special_tokens=True)
        completion_values = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                             for t, p in zip(texts, prompts)]
    else:
        trajectories, environments = _tool_rollouts(method, accelerator, forward, all_done, batch, key)
        tensors = tool_rollout.padded(trajectories, method.pad_token_id, device)
        prompt_ids, prompt_mask = tensors["prompt_ids"], tensors["prompt_mask"]
        completions, keep, trained, ended = (tensors[k] for k in ("completions", "keep", "trained", "ended"))
        completion_values = [r.messages for r in trajectories]
        texts = [tokenizer.decode(r.completion, skip_special_tokens=False) for r in trajectories]
        tool_sums = {k: torch.tensor(v, dtype=torch.float64, device=device)
                     for k, v in tool_rollout.tool_sums(trajectories).items()}
        if method.tools.factories:
            extra["environments"] = environments
    loss_mask = trained & ended[:, None] if config.mask_truncated_completions else trained
    input_ids = torch.cat([prompt_ids, completions], dim=1)
    attention_mask = torch.cat([prompt_mask, keep.long()], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[:, prompt_ids.size(1):] = completions.masked_fill(~loss_mask, -100)

    column_names = sorted({k for row in rows for k in row if k != "prompt"})
    columns = {k: [row.get(k) for row in rows for _ in range(g)] for k in column_names}
    evaluation = len(key) > 1 and key[1] == "eval"
    where = [_where(config, n, evaluation) for n in batch["row_numbers"].tolist() for _ in range(g)]
    ids = [c[k].tolist() for c, k in zip(completions, keep)]
    rewards = torch.as_tensor(score(method.reward_functions, prompts, completion_values, ids, columns, where,
                                    trainer_state, extra), dtype=torch.float32, device=device).reshape(len(texts), -1)
    weights = torch.as_tensor([f.weight for f in method.reward_functions], dtype=torch.float32, device=device)
    total = grpo_loss.weighted_rewards(rewards, weights)

    units = grpo_loss.loss_units(loss_mask, config.loss_type, config.max_completion_length)
    sums = {LENGTH: keep.sum().double(), **tool_sums}  # the reward sums come with the advantages (set_advantages)
    records = [{"prompt": prompts[i], "completion": completion_values[i] if method.tools else texts[i],
                "rewards": {name: _number(rewards[i, f]) for f, name in enumerate(method.names)},
                "reward": _number(total[i]), **_ids(prompt_ids[i], prompt_mask[i], completions[i], keep[i], loss_mask[i])}
               for i in range(len(texts))]
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions_of(attention_mask),
           "labels": labels, "completion_mask": loss_mask, "rewards": rewards, "total_rewards": total, "units": units,
           "prompts": len(rows), "rollout_sums": sums, "log_records": records}
    if batch.get(FILLER):
        out[FILLER] = True
    return out


def _ids(prompt, prompt_mask, completion, keep, trained) -> dict:
    """A rollout's tokens as sampled, and which were trained (`preview` marks them from the log)."""
    return {"prompt_ids": prompt[prompt_mask.bool()].tolist(), "completion_ids": completion[keep].tolist(),
            "trained": trained[keep].long().tolist()}


def _tool_rollouts(method, accelerator, forward, all_done, batch: dict, key: tuple):
    """(the micro-batch's trajectories, each rollout's environment): rollout j of a prompt samples turn t from a
    generator seeded with (key, its row, j, t)."""
    config, g, device = method.config, method.config.num_generations, accelerator.device
    rows = [row for row in batch["rows"] for _ in range(g)]
    numbers = [tuple(n) for n in batch["row_numbers"].tolist() for _ in range(g)]
    evaluation = len(key) > 1 and key[1] == "eval"
    specs = (config.eval_dataset or config.dataset) if evaluation else config.dataset  # a row's: its system_prompt
    systems = [getattr(specs[n[0]], "system_prompt", None) if n[0] < len(specs) else None for n in numbers]
    environments, observations = method.environments.reset(rows)
    prompts = [tool_rollout.with_observation(prompt_messages(row["prompt"], system), seen)
               for row, system, seen in zip(rows, systems, observations)]
    schemas = [method.tools.schemas[method.environments.name_of(row)] for row in rows]
    sampler = tool_rollout.PolicySampler(forward, config.temperature, config.top_p, method.stop_ids,
                                         method.pad_token_id, device, all_done)

    def generator_for(i: int, turn: int):
        return torch.Generator(device=device).manual_seed(sampling_seed(*key, *numbers[i], i % g, turn))

    with torch.no_grad(), accelerator.autocast():
        trajectories = tool_rollout.run_tool_rollouts(
            sampler, method.template_tools, method.tools, prompts, schemas, environments, generator_for,
            max_prompt_length=prompt_limit(config), max_completion_length=config.max_completion_length,
            max_iterations=config.max_tool_calling_iterations)
    return trajectories, environments


def set_advantages(method, accelerator, scored: list[dict]) -> None:
    """Group-normalised advantages of every micro-batch; scale_rewards: batch divides by the std of the whole
    step's rewards over all ranks (summed moments: one all-reduce, as every rank makes it)."""
    config = method.config
    batch_std = None
    if config.scale_rewards == "batch":
        moments = sum(grpo_loss.reward_moments(b["total_rewards"]) * (0.0 if b.get(FILLER) else 1.0) for b in scored)
        batch_std = grpo_loss.std_from_moments(accelerator.reduce(moments.to(accelerator.device), "sum"))
    for b in scored:
        advantages, std = grpo_loss.group_advantages(b["total_rewards"], config.num_generations, config.scale_rewards,
                                                     batch_std=batch_std)
        b["advantages"] = advantages
        sums = grpo_loss.reward_metric_sums(b["rewards"], b["total_rewards"], std, method.names)
        b["rollout_sums"].update({k: v.to(accelerator.device) for k, v in sums.items()})
        for record, advantage in zip(b["log_records"], advantages.tolist()):
            record["advantage"] = advantage


def add_reference(method, accelerator, module, batch: dict) -> None:
    if method.config.beta > 0:
        batch["ref_logps"] = _logps(accelerator, module, batch, reference=True)


def add_old_logps(accelerator, module, batch: dict) -> None:
    """num_iterations > 1: the log-probs of the policy that generated the completions (no gradients, eval mode),
    which the importance ratio of every step trained on them divides by, as TRL's old_per_token_logps."""
    batch["old_logps"] = _logps(accelerator, module, batch, reference=False)


def _logps(accelerator, module, batch: dict, reference: bool):
    # Under FSDP2 through the prepared module (its forward gathers the weights); under DDP through the module inside:
    # a DDP forward between the micro-batches' backwards would upset its unused-parameter bookkeeping.
    through = module if accelerator.distributed_type.name == "FSDP" else accelerator.unwrap_model(module)
    return through(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], labels=batch["labels"],
                   completion_mask=batch["completion_mask"], mode="logps", reference=reference)


def save_buffer(path, scored: list[dict], step: int, processes: int) -> None:
    """A step's scored micro-batches as safetensors: tensors as tensors, the rest (counts, log records) as JSON in
    the file's metadata; `step`: the step that generated them, with `processes` processes."""
    import json

    from safetensors.torch import save_file

    tensors, rest = {}, []
    for index, batch in enumerate(scored):
        plain = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{key}"] = value.detach().cpu().contiguous()
            elif key == "rollout_sums":
                tensors.update({f"{index}/rollout_sums/{k}": v.detach().cpu().contiguous() for k, v in value.items()})
            else:
                plain[key] = value
        rest.append(plain)
    save_file(tensors, str(path), metadata={"step": str(step), "processes": str(processes), "batches": json.dumps(rest, default=str)})


def load_buffer(path, device) -> tuple[list[dict], int, int]:
    """(the scored micro-batches, the step that generated them, the processes it ran on)."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata()
        scored = [dict(plain, rollout_sums={}) for plain in json.loads(metadata["batches"])]
        for name in handle.keys():
            index, key = name.split("/", 1)
            value = handle.get_tensor(name).to(device)
            if key.startswith("rollout_sums/"):
                scored[int(index)]["rollout_sums"][key.removeprefix("rollout_sums/")] = value
            else:
                scored[int(index)][key] = value
    return scored, int(metadata["step"]), int(metadata["processes"])


def _number(value: torch.Tensor):
    value = float(value)
    return None if value != value else value
