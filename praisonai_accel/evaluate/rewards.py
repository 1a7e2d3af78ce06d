"""The user's reward functions as a metric (`eval --reward-funcs module:function --prompts FILE.jsonl`): greedy (or
sampled, `--num-samples N`) completions of each prompt, scored by the functions as GRPO calls them
(methods/rewards.py: the same loading, keywords and checks; `model:PATH` a trained reward model), the mean reward per
function and of their weighted total, tuned and (with --base) base on the same prompts. No lm-eval needed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..errors import ConfigError

TASK = "rewards"  # the table's task column for reward rows
TOTAL = "total"  # the weighted total of the functions' rewards, as GRPO's reward


@dataclass
class Prompts:
    rows: list[dict]  # each line of the file
    path: Path

    @property
    def columns(self) -> list[str]:
        return sorted({key for row in self.rows for key in row})


def read_prompts(path: Path) -> Prompts:
    """The JSONL of prompts, each line a `prompt` (text, or messages as GRPO's dataset) and the columns the reward
    functions read; one line naming the file and line for a row that cannot be one."""
    from ..methods.grpo_data import check_prompt

    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path} line {number}: not JSON ({exc})") from None
        why = check_prompt(row) if isinstance(row, dict) else "expected a JSON object"
        if why:
            raise ConfigError(f"{path} line {number}: {why}")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return Prompts(rows, path)


def reward_entries(reward_funcs: list[str], reward_model: str | None) -> list[str]:
    entries = [entry.strip() for spec in reward_funcs for entry in spec.split(",") if entry.strip()]
    return entries + ([f"model:{reward_model}"] if reward_model else [])


def load_functions(entries: list[str], prompts: Prompts, base_dir: Path):
    """The functions loaded and checked as GRPO loads them (a module beside the working directory first), and every
    column they read present in the prompts file."""
    from ..methods.method_keys import parse_reward_entry
    from ..methods.rewards import check_columns, load_reward_functions

    for index, entry in enumerate(entries):
        try:
            parse_reward_entry(entry, index)
        except ValueError as exc:
            raise ConfigError(str(exc).replace(f"reward_funcs[{index}]", f"--reward-funcs {entry}")) from None
    spec = SimpleNamespace(reward_funcs=entries, reward_weights=None,
                           reward_format_pattern=r"^<think>.*?</think>\s*<answer>.*?</answer>$")
    try:
        functions = load_reward_functions(spec, base_dir)
    except ConfigError as exc:  # named as the option, not the config key GRPO's loader names
        raise ConfigError(re.sub(r"^reward_funcs\[\d+\]:", "--reward-funcs", str(exc))) from None
    check_columns(functions, prompts.columns, str(prompts.path))
    return functions


def _completions(model, tokenizer, prompts: Prompts, num_samples: int, max_new_tokens: int, temperature: float,
                 batch_size: int, seed: int):
    """(prompts, completions, completion ids, row numbers), each prompt num_samples times in a row."""
    import torch

    from ..models.inference import stop_token_ids
    from ..methods.grpo_data import prompt_messages

    texts, shown, rows = [], [], []
    for number, row in enumerate(prompts.rows, 1):
        prompt = row["prompt"]
        text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
            prompt_messages(prompt, None), tokenize=False, add_generation_prompt=True)
        texts += [text] * num_samples
        shown += [prompt] * num_samples
        rows += [f"{prompts.path} line {number}"] * num_samples
    stops = stop_token_ids(model, tokenizer)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if num_samples > 1 else {"do_sample": False}
    torch.manual_seed(seed)  # the same draws for tuned and base
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    ids_out = []
    try:
        for start in range(0, len(texts), batch_size):
            inputs = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                               add_special_tokens=False).to(model.device)
            with torch.inference_mode():
                output = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=stops,
                                        pad_token_id=tokenizer.pad_token_id, **sampling)
            for row in output[:, inputs["input_ids"].shape[1]:].tolist():
                ends = [i for i, token in enumerate(row) if token in stops]
                ids_out.append(row[:ends[0]] if ends else row)
    finally:
        tokenizer.padding_side = side
    completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in ids_out]
    completions = [text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
                   for text, prompt in zip(completions, shown)]
    return shown, completions, ids_out, rows


def _scored(functions, prompts: Prompts, num_samples: int, generated) -> dict:
    """{function name: {"mean", "stderr", "per_item": {prompt index: mean over its samples}}}, and the total."""
    import torch

    from ..methods.grpo_loss import weighted_rewards
    from ..methods.rewards import score

    shown, completions, ids, rows = generated
    columns = {key: [row.get(key) for row in prompts.rows for _ in range(num_samples)]
               for key in prompts.columns if key != "prompt"}
    rewards = score(functions, shown, completions, ids, columns, rows)  # [N, F], NaN: not applicable
    weights = torch.tensor([f.weight for f in functions])
    named = {f.short_name: rewards[:, j] for j, f in enumerate(functions)}
    if len(functions) > 1:
        named[TOTAL] = weighted_rewards(rewards, weights)
    out = {}
    for name, values in named.items():
        per_prompt = values.view(len(prompts.rows), num_samples)
        items = {str(i): float(v) for i, v in enumerate(torch.nanmean(per_prompt, dim=1).tolist()) if v == v}
        kept = torch.tensor(list(items.values()), dtype=torch.float64)
        stderr = float(kept.std() / len(kept) ** 0.5) if len(kept) > 1 else None
        out[name] = {"mean": float(kept.mean()) if len(kept) else None, "stderr": stderr, "per_item": items}
    out["completions"] = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return out


def score_rewards(target, functions, prompts: Prompts, *, num_samples: int = 1, max_new_tokens: int = 128,
                  temperature: float = 1.0, batch_size: int = 8, base: bool = False, seed: int = 0,
                  device=None) -> dict:
    """{"tuned": per function, "base": ... (with base)}: the base as score.score has it: an adapter's with the
    adapter disabled, a full fine-tune's by loading the model it started from (with the run's tokenizer)."""
    from .score import load_model

    model, tokenizer = load_model(target, device)
    complete = lambda m: _completions(m.eval(), tokenizer, prompts, num_samples, max_new_tokens, temperature,
                                      batch_size, seed)
    out = {"tuned": _scored(functions, prompts, num_samples, complete(model))}
    if base and target.adapter:
        with model.disable_adapter():
            out["base"] = _scored(functions, prompts, num_samples, complete(model))
    elif base:
        del model
        model = load_model(target.base_target(), device)[0]
        out["base"] = _scored(functions, prompts, num_samples, complete(model))
    return out


def reward_rows(scored: dict) -> list:
    """compare.Row per function (and the total): the mean reward, its standard error over prompts, base against
    tuned with the paired test on the same prompts."""
    from .compare import Row, paired_test

    tuned, base = scored["tuned"], scored.get("base")
    out = []
    for name, value in tuned.items():
        if name == "completions" or value["mean"] is None:
            continue
        row = Row(TASK, f"{name} (mean)", value["mean"], value["stderr"])
        if base is not None:
            row.base, row.base_stderr = base[name]["mean"], base[name]["stderr"]
            row.paired_n, row.paired_p = paired_test(value["per_item"], base[name]["per_item"])
        out.append(row)
    return out
