"""praisonai-accel demo --method agent: a tiny model learns, from a reward alone, to use a tool right.

A 2-layer model is first taught the shape of a tool call (praisonai_accel.demo.agent: a few seconds of supervised
steps on "add A and B" conversations that call add(a, b) and say its result): it calls the tool, but mostly with the
wrong numbers. GRPO with `tools: [add]` then samples multi-turn trajectories (the model's call, the tool's result,
the model's answer), rewards a right final answer (`answer_reward`), and trains the model's own tokens only. The
held-out success rate (greedy trajectories whose last turn says the right sum) is shown before and after.
"""

from __future__ import annotations

from pathlib import Path

import typer

TRAIN_PROMPTS, HELD_OUT_PROMPTS, STEPS, LOGGING_STEPS = 512, 100, 150, 10


def agent_demo(directory: Path, processes: int, steps: int | None) -> None:
    from ..demo.agent import add_records, make_tool_model, success_rate
    from ..demo.text import demo_config, write_jsonl
    from ._demo import launch_demo

    base = directory / "agent_base"
    if not (base / "config.json").exists():
        typer.echo(f"teaching a tiny model the shape of a tool call: {base}", err=True)
        make_tool_model(base)
    train = add_records(TRAIN_PROMPTS, seed=2)
    held_out = add_records(HELD_OUT_PROMPTS, seed=3)
    data = write_jsonl(train, directory / "agent_data.jsonl")
    output = (directory / "agent_outputs").resolve()
    raw = demo_config(base.resolve(), data.resolve(), output, method="grpo", dataset=[{"name": str(data.resolve())}],
                      tools=["praisonai_accel.demo.agent:add"], max_tool_calling_iterations=2,
                      reward_funcs=["praisonai_accel.demo.agent:answer_reward"], num_generations=8,
                      per_device_train_batch_size=32, max_completion_length=80, max_prompt_length=64,
                      max_seq_length=144, finetune_type="full", final_model_dir="model", learning_rate=1e-3,
                      warmup_steps=2, max_steps=steps or STEPS, logging_steps=LOGGING_STEPS, save_strategy="no",
                      overwrite_output_dir=True, num_completions_to_print=2)
    before, _ = success_rate(base, held_out)
    summary = launch_demo(directory / "agent_config.yaml", raw, processes, output)
    after, trajectories = success_rate(Path(summary["final_model_dir"]), held_out)
    _report(before, after, trajectories, held_out, summary, output)


def _report(before: float, after: float, trajectories, held_out, summary, output: Path) -> None:
    from ..run_dir.metrics import read_metrics

    for trajectory, row in list(zip(trajectories, held_out))[:3]:
        turns = []
        for message in trajectory.messages:
            calls = message.get("tool_calls") or []
            turns += [f"add({c['function']['arguments']})" for c in calls] if calls else [
                f"{message['role']}: {message['content']}"]
        typer.echo(f"  {row['prompt'][0]['content']!r} -> " + " | ".join(turns))
    steps = [m for m in read_metrics(output / "metrics.jsonl") if "reward" in m]
    if steps:
        typer.echo(f"reward: {steps[0]['reward']:.2f} over the first {LOGGING_STEPS} steps, {steps[-1]['reward']:.2f} "
                   f"over the last; tool calls per trajectory {steps[-1].get('tools/call_frequency', 0):.2f}; "
                   f"trajectories in {output / 'logs' / 'completions.jsonl'}")
    typer.echo(f"success on {len(held_out)} held-out prompts (the right sum, after calling add): {before:.0%} before, "
               f"{after:.0%} after {summary['global_step']} GRPO steps on {summary['num_processes']} processes; model "
               f"in {summary['final_model_dir']}")
