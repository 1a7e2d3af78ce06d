"""praisonai-accel demo: a real fine-tune, offline, on CPU processes, that visibly learns in well under a minute."""

from __future__ import annotations

from pathlib import Path

import typer

TRAIN_ROWS, HELD_OUT_ROWS, SHOWN = 900, 100, 3


def demo_command(
    directory: Path = typer.Option(Path("praisonai-accel-demo"), "--dir", help="where model, data and outputs go"),
    processes: int = typer.Option(2, "--num-processes", min=1, help="CPU processes (DDP over gloo)"),
    steps: int | None = typer.Option(None, "--steps", min=1,
                                     help="optimizer steps (250 for sft, 30 for dpo, 80 for reward, 150 for grpo and "
                                          "agent, 120 for --vision)"),
    method: str = typer.Option("sft", "--method", help="sft; dpo: teach the SFT demo's model a preference; grpo: "
                                                       "teach it, from a reward, to reverse four names; reward: "
                                                       "train a reward model to tell the right answer from the "
                                                       "prompt's order; agent: teach a model to use a tool, from a "
                                                       "reward"),
    vision: bool = typer.Option(False, "--vision",
                                help="a tiny vision-language model learns the colour of drawn shapes"),
) -> None:
    """Build a tiny local model and a task with checkable answers (reverse 2 or 3 names), train it with N CPU
    processes, and show held-out answers and exact-match accuracy before and after. --method dpo starts from that
    model (training it first when it is absent) and teaches it, with DPO and LoRA, to prefer whole reversals of four
    names over the three it stops at, showing held-out preference accuracy and generation accuracy before and after.
    --method reward trains a reward model (that model with a score head) on the same pairs, showing held-out reward
    accuracy before and after. --method grpo starts from it
    too and teaches it, with GRPO and a reward for names in the right place, to reverse four names. --method agent
    teaches a tiny model to call an add tool with the right numbers and say its result (GRPO with tools, multi-turn
    trajectories), showing held-out success before and after. --vision: a tiny
    vision-language model learns to name the colour of a drawn shape, held-out exact match before and after."""
    from ..config import ConfigError
    from ._demo import claim_demo_dir

    if vision and method != "sft":
        raise ConfigError(f"--vision: the vision demo trains with sft; drop --method {method}")
    if method not in ("sft", "dpo", "grpo", "reward", "agent"):
        raise ConfigError(f"--method: {method!r} has no demo; use sft, dpo, grpo, reward or agent")
    claim_demo_dir(directory)
    if vision:
        from .demo_vision import vision_demo

        return vision_demo(directory, processes, steps)
    if method == "agent":  # commands/demo_agent.py
        from .demo_agent import agent_demo

        return agent_demo(directory, processes, steps)
    if method == "reward":  # commands/demo_reward.py
        from .demo_reward import reward_demo

        return reward_demo(directory, processes, steps, lambda: demo_command(directory, processes, None, "sft", False))
    if method == "grpo":
        from .demo_grpo import grpo_demo

        return grpo_demo(directory, processes, steps, lambda: demo_command(directory, processes, None, "sft", False))
    if method == "dpo":
        from .demo_dpo import dpo_demo

        return dpo_demo(directory, processes, steps, lambda: demo_command(directory, processes, None, "sft", False))
    from ..demo.text import demo_config, make_tiny_model, task_records, write_jsonl
    from ._demo import launch_demo, text_answers

    model_dir = directory / "tiny-llama"
    if not (model_dir / "config.json").exists():
        typer.echo(f"building a tiny model in {model_dir}", err=True)
        make_tiny_model(model_dir)
    train_rows = task_records(TRAIN_ROWS, seed=0)
    held_out = task_records(HELD_OUT_ROWS, seed=1, exclude={r["input"] for r in train_rows})
    data = write_jsonl(train_rows, directory / "data.jsonl")
    # The tiny model is trained fully: its weights are random, and a LoRA adapter on random weights learns slowly.
    raw = demo_config(model_dir.resolve(), data.resolve(), (directory / "outputs").resolve(), max_steps=steps or 250,
                      finetune_type="full", final_model_dir="model", max_seq_length=48, per_device_train_batch_size=16,
                      learning_rate=5e-3, warmup_steps=10, logging_steps=50)
    before = text_answers(model_dir, held_out)
    summary = launch_demo(directory / "config.yaml", raw, processes, directory / "outputs")
    after = text_answers(Path(summary["final_model_dir"]), held_out)
    _report(held_out, before, after, summary)
    from .demo_eval import eval_table

    eval_table(directory, model_dir, Path(summary["final_model_dir"]), directory / "outputs", held_out)


def _report(held_out: list[dict], before: list[str], after: list[str], summary: dict) -> None:
    from ..demo.text import exact_match

    show_examples(held_out, before, after)
    typer.echo(f"exact-match accuracy on {len(held_out)} held-out prompts: {exact_match(before, held_out):.0%} before, "
               f"{exact_match(after, held_out):.0%} after {summary['global_step']} steps on "
               f"{summary['num_processes']} processes; model in {summary['final_model_dir']}")


def show_examples(held_out: list[dict], before: list[str], after: list[str]) -> None:
    """A few held-out prompts as trained (demo.shown_prompt), right and wrong answers after training in about the
    proportion the accuracy has (demo.examples_to_show), each marked."""
    from ..demo.text import examples_to_show, shown_prompt

    for i in examples_to_show(after, [r["output"] for r in held_out], SHOWN):
        record, verdict = held_out[i], "right" if after[i] == held_out[i]["output"] else "wrong"
        typer.echo(f"prompt: {shown_prompt(record)}\n  before: {before[i] or '(nothing)'}\n  after:  {after[i]}"
                   f"   ({verdict}; expected: {record['output']})")
