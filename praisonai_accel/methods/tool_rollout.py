"""Multi-turn rollouts with tools, on token ids: sample a turn, parse its tool calls, run them, append the results
as the chat template renders them, sample the next turn (continuing from the KV cache the last turn left); until a
turn calls no tool, max_tool_calling_iterations is reached or the completion has max_completion_length tokens (TRL's
GRPOTrainer._tool_call_loop).

The model's tokens are kept exactly as sampled (never decoded and re-encoded) and are the only ones trained; the
tool results and the template's glue between turns (TRL's `_get_tool_suffix_ids`: the difference between a
conversation rendered with and without the tool messages) are in the sequence, attended, and never trained.

Each rollout (a prompt's j-th completion) samples turn t from its own generator, seeded from (seed, step, row, j,
t): what it samples depends on nothing else in its batch, so 2 ranks x B rollouts equal 1 rank x 2B, and a resumed
run samples what the uninterrupted one would have. The KV cache is kept across turns: a turn prefills only the tool
results and glue after the last one (PolicySampler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .generation import Continuation, left_pad, sample_turn
from .tools import ToolSet, call_tool, route_tool_output, tool_functions


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)  # 1: a token the model sampled; 0: a tool result or glue
    messages: list[dict] = field(default_factory=list)  # the assistant and tool messages, as TRL's completions
    ended: bool = False  # its last turn stopped on a stop token (not cut at max_completion_length)
    calls: int = 0
    failures: int = 0
    turns: int = 0
    iterations: int = 0  # turns whose tool calls were run and answered


class TemplateTools:
    """The run's tokenizer as the tool loop needs it: tool calls parsed from a turn's ids by the chat template's own
    format (TRL's response schemas), tool results rendered by the template."""

    def __init__(self, tokenizer, stop_ids):
        from trl.chat_template_utils import add_response_schema, supports_tool_calling

        if not supports_tool_calling(tokenizer):
            raise ValueError("its chat template does not render tool calls and tool results")
        if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
            add_response_schema(tokenizer)  # ValueError for a template TRL cannot parse tool calls from
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)

    def prompt_ids(self, messages: list[dict], schemas: list[dict], max_length: int) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                                  add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-max_length:]

    def parse(self, ids: list[int], before: list[int], schemas: list[dict]) -> dict:
        """The turn `ids` as a message; `before`: the conversation's ids up to it (some formats read the header)."""
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=before, tools=schemas or None)

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The ids between the end of the assistant's turn and the start of its next one: the tool results and the
        template's glue, rendered as the template renders them after a tool call (TRL's dummy conversation). The
        turn ends at its end-of-turn token: counted rather than compared, since some templates (Qwen3) render a
        last assistant turn differently from one that tool results follow."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = self._ids(dummy, add_generation_prompt=False)
        full = self._ids(dummy + tool_messages, add_generation_prompt=True)
        ends = [i for i, token in enumerate(prefix) if token in self.stop_ids]
        if not ends:
            raise ValueError("the chat template ends an assistant turn with none of the model's stop tokens")
        after = [i for i, token in enumerate(full) if token in self.stop_ids]
        if len(after) < len(ends):
            raise ValueError("the chat template renders an assistant turn differently once tool results follow it")
        return full[after[len(ends) - 1] + 1:]

    def _ids(self, messages, add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class PolicySampler:
    """Generation as the rollouts call it: a batch of unpadded id lists in, one sampled turn per row out. The KV cache
    is carried from one turn to the next: a row that extends what the last turn left in the cache (its turn, the tool
    results and glue after it) prefills only what is new."""

    forward: Callable
    temperature: float
    top_p: float
    stop_ids: list[int]
    pad_id: int
    device: torch.device
    all_done: Callable | None = None
    carried: Continuation | None = None  # what the last call left in the cache

    def __call__(self, inputs: list[list[int]], budgets: list[int], generators: list) -> list[tuple[list[int], bool]]:
        """(the turn's ids, up to and including its stop token, whether it stopped) per row; a row gets at most its
        budget of tokens."""
        start, new = self._continuation(inputs)
        ids, mask = left_pad(new, self.pad_id, self.device)
        tokens, keep, ended, self.carried = sample_turn(
            self.forward, ids, mask, max_new_tokens=max(budgets), temperature=self.temperature, top_p=self.top_p,
            stop_ids=self.stop_ids, pad_id=self.pad_id, generators=generators, all_done=self.all_done, start=start)
        out = []
        for i, budget in enumerate(budgets):
            row = tokens[i][keep[i]].tolist()
            stopped = bool(ended[i]) and len(row) <= budget
            out.append((row[:budget], stopped))
        return out

    def _continuation(self, inputs: list[list[int]]) -> tuple[Continuation | None, list[list[int]]]:
        """(the carried cache, its rows in the order of `inputs`, and each input's ids after them), or (None, the
        inputs whole) where an input extends none of the cached rows in turn: rows leave between turns, never
        arrive, and keep their order."""
        if self.carried is None:
            return None, inputs
        cached, rows, j = self.carried.rows(), [], 0
        for ids in inputs:
            while j < len(cached) and not (len(ids) > len(cached[j]) and ids[:len(cached[j])] == cached[j]):
                j += 1
            if j == len(cached):
                return None, inputs
            rows.append(j)
            j += 1
        return self.carried.select(rows), [ids[len(cached[j]):] for ids, j in zip(inputs, rows)]

    def keep_up(self) -> None:
        """FSDP2: this rank's rollouts have ended while another rank's go on; its forwards are collectives, so it
        samples a throwaway turn alongside theirs."""
        self([[self.pad_id]], [1], [torch.Generator(device=self.device)])


def run_tool_rollouts(sampler, template: TemplateTools, tools: ToolSet, prompts: list[list[dict]],
                      schemas: list[list[dict]], environments: list, generator_for: Callable[[int, int], object], *,
                      max_prompt_length: int, max_completion_length: int, max_iterations: int | None
                      ) -> list[Trajectory]:
    """One trajectory per prompt (a group's prompts repeated). `generator_for(rollout, turn)`: its generator."""
    route_tool_output()
    rollouts = [Trajectory(template.prompt_ids(p, s, max_prompt_length)) for p, s in zip(prompts, schemas)]
    functions = [tool_functions(tools, env) for env in environments]
    active = list(range(len(rollouts)))
    turn = 0
    all_done = getattr(sampler, "all_done", None)
    while not (all_done(not active) if all_done is not None else not active):
        if not active:
            sampler.keep_up()
            turn += 1
            continue
        budgets = [max_completion_length - len(rollouts[i].completion) for i in active]
        sampled = sampler([rollouts[i].prompt_ids + rollouts[i].completion for i in active], budgets,
                          [generator_for(i, turn) for i in active])
        still = []
        for i, (ids, stopped) in zip(active, sampled):
            r = rollouts[i]
            before = r.prompt_ids + r.completion
            r.completion += ids
            r.trained += [1] * len(ids)
            r.turns += 1
            r.ended = stopped
            message = template.parse(ids, before, schemas[i])
            r.messages.append(message)
            calls = message.get("tool_calls") or []
            if not stopped or not calls or (max_iterations is not None and r.iterations >= max_iterations):
                continue
            results = []
            for call in calls:
                name, text, failed = call_tool(functions[i], call, tools.timeout, tools.max_result_length)
                results.append({"role": "tool", "name": name, "content": text})
                r.calls += 1
                r.failures += failed
            suffix = template.suffix_ids(results)
            # no room left for the model to answer the results: they are dropped, as TRL drops overlong ones
            if len(r.completion) + len(suffix) >= max_completion_length:
                continue
            r.messages += results
            r.completion += suffix
            r.trained += [0] * len(suffix)
            r.iterations += 1
            still.append(i)
        active = still
        turn += 1
    return rollouts


def padded(rollouts: list[Trajectory], pad_id: int, device) -> dict[str, torch.Tensor]:
    """The rollouts as tensors: prompts left-padded, completions right-padded; `keep`: completion tokens (tool
    results too), `trained`: the model's own, `ended` per row."""
    prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in rollouts], pad_id)
    c = max(max(len(r.completion) for r in rollouts), 1)
    n = len(rollouts)
    completions = torch.full((n, c), pad_id, dtype=torch.long)
    keep = torch.zeros((n, c), dtype=torch.bool)
    trained = torch.zeros((n, c), dtype=torch.bool)
    for i, r in enumerate(rollouts):
        if r.completion:
            completions[i, :len(r.completion)] = torch.as_tensor(r.completion)
            keep[i, :len(r.completion)] = True
            trained[i, :len(r.completion)] = torch.as_tensor(r.trained, dtype=torch.bool)
    ended = torch.as_tensor([r.ended for r in rollouts], dtype=torch.bool)
    return {name: value.to(device) for name, value in (("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask),
                                                        ("completions", completions), ("keep", keep),
                                                        ("trained", trained), ("ended", ended))}


class Environments:
    """One environment per rollout (TRL's contract), made once and reset before every rollout: the pool grows to
    the most rollouts a micro-batch holds of each kind."""

    def __init__(self, tools: ToolSet):
        self.tools = tools
        self.pool: dict[str | None, list] = {name: [] for name in tools.factories}

    def name_of(self, row: dict) -> str | None:
        return row.get("environment") if self.tools.multi_environment else None

    def reset(self, rows: list[dict]) -> tuple[list, list]:
        """(the rollouts' environments, each reset with its row, and the observations their reset returned)."""
        if not self.tools.factories:
            return [None] * len(rows), [None] * len(rows)
        used: dict[str | None, int] = {}
        environments, observations = [], []
        for row in rows:
            name = self.name_of(row)
            pool = self.pool[name]
            index = used[name] = used.get(name, -1) + 1
            if index == len(pool):
                pool.append(self.tools.factories[name]())
            environment = pool[index]
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.tools.multi_environment else row
            observations.append(environment.reset(**kwargs))
            environments.append(environment)
        return environments, observations


def with_observation(messages: list[dict], observation) -> list[dict]:
    """The prompt with what reset() returned appended to its last message (TRL's rule), the row left untouched."""
    if observation is None:
        return messages
    last = messages[-1]
    content = last["content"]
    if isinstance(content, list):
        content = content + ([{"type": "text", "text": observation}] if isinstance(observation, str) else observation)
    else:
        content = content + str(observation)
    return [*messages[:-1], {**last, "content": content}]


def tool_sums(rollouts: list[Trajectory]) -> dict[str, float]:
    """What the metrics of a tool rollout sum over completions (methods/grpo.py reads them)."""
    return {"tools/calls_sum": float(sum(r.calls for r in rollouts)),
            "tools/failures_sum": float(sum(r.failures for r in rollouts)),
            "tools/turns_sum": float(sum(r.turns for r in rollouts)),
            "tools/model_tokens_sum": float(sum(sum(r.trained) for r in rollouts))}
