"""praisonai-accel eval: score a run's model (its adapter on its base), a checkpoint or a model on lm-eval tasks,
against the base too with --base, on N ranks; a regression gate for CI."""

from __future__ import annotations

import functools
import json
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import INTERRUPTED_EXIT_CODE
from ._common import fail


def said_when_interrupted(command):
    """Ctrl-C, in this process or forwarded to the ranks: one line and exit 130, no traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            # a new line first, as click's Abort writes one: lm-eval's bar may be on screen, unfinished
            typer.echo("\npraisonai-accel: eval interrupted (its results file is written when it ends)", err=True)
            raise typer.Exit(INTERRUPTED_EXIT_CODE) from None

    return run


@said_when_interrupted
def eval_command(
    target: Optional[str] = typer.Argument(None, help="a run's output_dir, a checkpoint-<step> directory, a model directory or a Hub id (none with --endpoint)"),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="lm-eval task names, comma-separated (its own, or YAML tasks under --include-path)"),
    include_path: Optional[Path] = typer.Option(None, "--include-path", help="a directory of lm-eval YAML tasks"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", min=1, help="ranks that share the requests (GPUs, or CPU processes with --cpu)"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPUs: a count, 'all' or ids such as 0,1"),
    cpu: bool = typer.Option(False, "--cpu", help="CPU processes (gloo), even where GPUs are visible"),
    limit: Optional[float] = typer.Option(None, "--limit", help="at most K documents per task (a fraction below 1)"),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", min=0),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    apply_chat_template: Optional[bool] = typer.Option(None, "--apply-chat-template/--no-apply-chat-template", help="render prompts with the model's chat template (default: as the run trained; none for a model that is no run)", show_default=False),
    log_samples: bool = typer.Option(False, "--log-samples", help="keep every document's prompt, output and score in the results file"),
    output: Optional[Path] = typer.Option(None, "--output", help="the results JSON (default <output_dir>/eval/<timestamp>.json)"),
    base: bool = typer.Option(False, "--base", help="score the base model too (the adapter disabled) and show the change"),
    max_regression: Optional[List[str]] = typer.Option(None, "--max-regression", help="TASK=DELTA: exit 1 when TASK drops by more than DELTA against the base (implies --base); repeat for several"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    reward_funcs: Optional[List[str]] = typer.Option(None, "--reward-funcs", help="module:function (GRPO's contract), a built-in or model:PATH; the mean reward of completions of --prompts is a metric; repeat or comma-separate for several"),
    reward_model: Optional[str] = typer.Option(None, "--reward-model", help="a trained reward model (method: reward): short for --reward-funcs model:PATH"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="a JSONL of prompts for --reward-funcs: `prompt` (text or messages) and the columns the functions read"),
    num_samples: int = typer.Option(1, "--num-samples", min=1, help="completions per prompt: 1 greedy, more sampled at --temperature"),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0, help="sampling temperature with --num-samples > 1"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="the longest completion for --reward-funcs"),
    seed: int = typer.Option(0, "--seed", help="the seed of sampled completions (the same for base and tuned)"),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="score a served model instead of TARGET: the /v1 base URL `serve` printed (any OpenAI-compatible server)"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the model name the endpoint serves (default: the first it lists)"),
    completions: bool = typer.Option(False, "--completions", help="with --endpoint: lm-eval's local-completions (plain prompts, log-probabilities) instead of local-chat-completions"),
) -> None:
    """Score a model on lm-eval tasks and/or the user's reward functions; with --base, base against tuned with the
    change and a paired test."""
    from ..evaluate.compare import check_gate_tasks, parse_max_regression, regressions, render, rows
    from ..evaluate.results import default_path, write_results
    from ..evaluate.rewards import TASK, load_functions, read_prompts, reward_entries, reward_rows
    from ..evaluate.score import EvalRequest
    from ..evaluate.targets import chat_template_choice, check_base, resolve_target
    from ..evaluate.tasks import build_tasks, check_include_path, import_lm_eval, parse_task_names
    from ..launcher.eval_plan import EvalLaunch
    from ..launcher.plan import count_cuda_gpus, resolve_processes

    entries = reward_entries(reward_funcs or [], reward_model)
    reward_option = "--reward-funcs" if reward_funcs else "--reward-model"  # the one the user typed, in its errors
    if endpoint is not None or target is None:
        return _eval_endpoint(target, endpoint, model_name, completions, tasks, include_path, limit, num_fewshot,
                              batch_size, log_samples, output, base or bool(max_regression), entries,
                              num_processes or gpus, reward_option)
    if bool(entries) != (prompts is not None):
        fail("--prompts: needs --reward-funcs or --reward-model" if prompts else
             f"{reward_option}: needs --prompts FILE.jsonl (the prompts whose completions are scored)")
    if not tasks and not entries:
        fail("name what to score: --tasks NAME[,NAME...] and/or --reward-funcs module:function with --prompts FILE")
    names = parse_task_names(tasks) if tasks else []
    gates = parse_max_regression(max_regression or [])
    check_gate_tasks(gates, names + ([TASK] if entries else []))
    base = base or bool(gates)
    processes, gpu_ids = resolve_processes(gpus, cpu, num_processes, count_cuda_gpus)
    # the ranks of a multi-process eval start now and wait: their imports overlap the checks below, and a check
    # that fails cancels them before any model loads
    with EvalLaunch(processes, gpu_ids, cpu) if names and processes > 1 else nullcontext() as ranks:
        if names:
            import_lm_eval()
            check_include_path(include_path)
        resolved = resolve_target(target, trust_remote_code)
        if base:
            check_base(resolved)
        if names:
            apply_chat_template, template_line = chat_template_choice(resolved, apply_chat_template)
        if entries:  # every function loaded and every column it reads found before any model loads
            prompt_rows = read_prompts(prompts)
            functions = load_functions(entries, prompt_rows, Path.cwd())
        manager = build_tasks(names, include_path)[0] if names else None  # every task checked before a model loads
        if names and template_line:
            typer.echo(template_line, err=True)
        request = EvalRequest(resolved, names, str(include_path.resolve()) if include_path else None, limit, num_fewshot,
                              batch_size, bool(apply_chat_template), log_samples, base)
        scored = _score(request, ranks, gpu_ids, cpu, manager) if names else {"processes": 1}
    table = rows(scored["tuned"], scored.get("base")) if names else []
    options = json.loads(request.to_json())
    if entries:
        scored["rewards"] = _score_rewards(resolved, functions, prompt_rows, num_samples, max_new_tokens,
                                           temperature, batch_size, base, seed, cpu, gpu_ids)
        table = table + reward_rows(scored["rewards"])
        options.update(reward_funcs=entries, prompts=str(prompts), num_samples=num_samples, seed=seed,
                       temperature=temperature if num_samples > 1 else 0.0, max_new_tokens=max_new_tokens)
    path = output or default_path(resolved.output_dir)
    write_results(path, resolved.description(), options, scored, [r.as_dict() for r in table])
    render(table, f"{target}" + (" (base vs tuned)" if base else ""))
    typer.echo(f"results: {path}", err=True)
    failed = regressions(table, gates)
    for line in failed:
        typer.echo(f"regression: {line}", err=True)
    if failed:
        raise typer.Exit(1)


def _eval_endpoint(target, url, model_name, completions, tasks, include_path, limit, num_fewshot, batch_size,
                   log_samples, output, base, entries, processes, reward_option) -> None:
    """--endpoint: lm-eval's API model against the served URL, in this process (the server holds the model)."""
    from ..evaluate.compare import render, rows
    from ..evaluate.endpoint import check_task_types, endpoint, score_endpoint, served_model_name
    from ..evaluate.results import default_path, write_results
    from ..evaluate.score import EvalRequest
    from ..evaluate.targets import EvalTarget
    from ..evaluate.tasks import build_tasks, check_include_path, import_lm_eval, parse_task_names

    if url is None:
        fail("TARGET: name a run, checkpoint or model to score (or --endpoint URL for a served one)")
    if target is not None:
        fail(f"--endpoint: scores the served model; drop TARGET {target}")
    for given, option in ((base, "--base / --max-regression"), (entries, reward_option),
                          (processes, "--num-processes / --gpus")):
        if given:
            fail(f"{option}: not with --endpoint (one served model, scored in this process)")
    if not tasks:
        fail("--endpoint: name the tasks to score with --tasks")
    names = parse_task_names(tasks)
    import_lm_eval()
    check_include_path(include_path)
    model = endpoint(url, "model", completions, None)  # the URL checked before the server is asked anything
    manager, task_dict = build_tasks(names, include_path, images=True)
    check_task_types(task_dict, completions)
    name = model_name or served_model_name(url)
    model = endpoint(url, name, completions, None)

    request = EvalRequest(EvalTarget(url, name, False, None, None, None, False), names,
                          str(include_path.resolve()) if include_path else None, limit, num_fewshot, batch_size,
                          model.apply_chat_template, log_samples)
    scored = score_endpoint(model, request, manager)
    table = rows(scored["tuned"])
    path = output or default_path(None)
    described = {"target": url, "model": name, "adapter": None, "checkpoint_step": None, "config_sha256": None,
                 "endpoint": {"base_url": url, "lm_eval_model": model.model}}
    options = {k: v for k, v in json.loads(request.to_json()).items() if k != "target"}
    write_results(path, described, {**options, "target": url}, scored, [r.as_dict() for r in table])
    render(table, f"{name} at {url}")
    typer.echo(f"results: {path}", err=True)


def _score_rewards(target, functions, prompts, num_samples, max_new_tokens, temperature, batch_size, base, seed, cpu,
                   gpu_ids) -> dict:
    """In this process: generation and the user's functions (which may hold a judge model or call a service)."""
    from ..evaluate.rewards import score_rewards
    from ..methods.rewards import RewardError

    device = "cpu" if cpu else (f"cuda:{gpu_ids[0]}" if gpu_ids else None)
    try:
        return score_rewards(target, functions, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                             temperature=temperature, batch_size=batch_size, base=base, seed=seed, device=device)
    except RewardError as exc:
        fail(str(exc), code=1)


def _score(request, ranks, gpu_ids, cpu: bool, manager) -> dict:
    """In this process for one rank; otherwise by the N ranks started (and waiting) as `train` launches its
    workers."""
    if ranks is None:
        from ..evaluate.score import score
        from ..logs import show_progress_lines

        show_progress_lines()
        device = "cpu" if cpu else (f"cuda:{gpu_ids[0]}" if gpu_ids else None)
        return score(request, manager=manager, device=device)
    typer.echo(f"launching {ranks.plan.num_processes} process(es)", err=True)
    code, result, said = ranks.run(request.to_json())
    if code == INTERRUPTED_EXIT_CODE:
        raise KeyboardInterrupt  # Ctrl-C, forwarded to the ranks, which left quietly: said once, as for one rank
    if code != 0 or result is None:
        if said:  # a rank's own "error:" line is the one line
            raise typer.Exit(code or 1)
        fail(f"the evaluation failed (exit code {code})", code=code or 1)
    return result
