"""praisonai-accel train CONFIG: check, plan, tokenize beside the starting workers, launch."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import yaml

from ..config import load_config
from ..data.vision_processor import model_inputs
from ..errors import first_line
from ..launcher.prelaunch import check_accelerate_config, check_launch
from ._common import fail


def train_command(
    config: Path = typer.Argument(..., help="config.yaml describing model, data and hyperparameters"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPUs on this node: a count, 'all', or ids such as 0,1"),
    cpu: bool = typer.Option(False, "--cpu", help="train on CPU processes (gloo), e.g. to try a config"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", min=1, help="processes on this node with --cpu"),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="machines in the job; run this command on each (in a Kubeflow TrainJob pod, read from PET_*)"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="this machine's rank (static rendezvous)"),
    main_addr: Optional[str] = typer.Option(None, "--main-addr", help="address of node 0 (static rendezvous)"),
    main_port: Optional[int] = typer.Option(None, "--main-port", help="port on node 0 (default 29500)"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of a c10d rendezvous: the same command on every node"),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="restart failed workers up to K times; they resume from the latest checkpoint"),
    fsdp: bool = typer.Option(False, "--fsdp", help="shard the model with FSDP2 (GPUs, or CPU processes over gloo with --cpu)"),
    accelerate_config: Optional[Path] = typer.Option(None, "--accelerate-config", help="use this accelerate config file as is (DeepSpeed, custom FSDP)"),
    verbose: bool = typer.Option(False, "--verbose", help="show the libraries' own output (progress bars, per-rank warnings)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and launch command, run nothing"),
    ray: bool = typer.Option(False, "--ray", help="run the workers as a Ray Train TorchTrainer; needs the ray extra: pip install 'praisonai-accel\\[ray]'"),  # \\[: rich reads [ray] as markup
    num_workers: int = typer.Option(2, "--num-workers", min=1, help="Ray Train workers (processes), with --ray"),
    address: Optional[str] = typer.Option(None, "--address", help="a running Ray cluster's address, with --ray (default: a local one)"),
) -> None:
    """Fine-tune a model as described by CONFIG."""
    import uuid

    from ..runtime.distributed import gpu_has_bf16, resolve_mixed_precision
    from ..runtime.handoff import worker_environment
    from ..launcher.accelerate_config import read_accelerate_config, total_processes
    from ..launcher.local import launch
    from ..launcher.plan import count_cuda_gpus, memory_note, plan_launch, resolve_nodes, resolve_processes
    from ..run_dir.manifest import verdicts

    cfg = load_config(config)
    if accelerate_config is not None:
        check_accelerate_config(accelerate_config)
    if accelerate_config is not None and (nnodes > 1 or fsdp):
        fail("--accelerate-config is used as is: put the machines and FSDP settings in it instead of --nnodes/--fsdp")
    if ray:
        train_on_ray(config, cfg, num_workers, address, cpu, max_restarts, gpus, nnodes, fsdp, accelerate_config, dry_run)
    nodes = resolve_nodes(nnodes, node_rank, main_addr, main_port, rdzv_endpoint)
    per_node, gpu_ids = resolve_processes(gpus, cpu, num_processes, count_cuda_gpus)
    # Only a generated multi-GPU accelerate config records the precision; the training module decides anyway.
    on_gpus = not cpu and (per_node > 1 or nodes.count > 1) and accelerate_config is None
    precision = resolve_mixed_precision(cfg.mixed_precision, on_gpus, on_gpus and gpu_has_bf16())
    processes, here = per_node * nodes.count, per_node
    sharded = fsdp
    if accelerate_config is not None:
        accel = read_accelerate_config(accelerate_config)
        processes = total_processes(accel)
        here = max(1, processes // int(accel.get("num_machines", 1) or 1))
        sharded = str(accel.get("distributed_type", "")).upper() == "FSDP"

    inputs = model_inputs(cfg)
    start = check_launch(cfg, processes, dry_run=dry_run, inputs=inputs, fsdp=sharded)
    status = None if dry_run else cfg.output_path() / "logs" / f".preprocessing-{uuid.uuid4().hex}.json"
    handoff = worker_environment(verbose=verbose, preprocessing_status=status, run_lock=not dry_run,
                                 checked_checkpoints=verdicts(),
                                 memory_note=memory_note(cfg, here, fsdp) if processes > 1 and not dry_run else "")
    try:
        plan = plan_launch(config, cfg, num_processes=per_node, gpu_ids=gpu_ids, cpu=cpu, mixed_precision=precision,
                           accelerate_config_file=accelerate_config, nodes=nodes, max_restarts=max_restarts, fsdp=fsdp,
                           worker_env=handoff)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        fail(first_line(exc))
    per_device, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    groups = plan.num_processes // cfg.sequence_parallel_size  # a sequence-parallel group trains one row at a time
    effective = f"{per_device} x {accum} x {groups} = {per_device * accum * groups}"
    if dry_run:
        shown = keys_shown(cfg, inputs.images)
        left_out = len(cfg.model_dump()) - len(shown)
        typer.echo("# resolved config" + (f" ({left_out} keys at their default that this run does not read left out)"
                                          if left_out else ""))
        typer.echo(yaml.safe_dump(shown, sort_keys=False).rstrip())
        typer.echo(f"# processes: {plan.num_processes}" + (f" ({per_node} per node x {nodes.count} nodes)" if nodes.count > 1 else ""))
        typer.echo(f"# effective batch (per device x accumulation x processes): {effective}")
        typer.echo(f"# start: {start}")
        if plan.generated_config:
            typer.echo(f"# accelerate config to write: {plan.accelerate_config_path}")
            typer.echo(yaml.safe_dump(plan.accelerate_config, sort_keys=True).rstrip())
        typer.echo("# launch command")
        typer.echo(plan.printable())
        return
    rows_checked = check_rows_before_launch(cfg)
    hold_run_lock(cfg, nodes)  # after every check: a refused launch writes nothing, not even output_dir
    preprocess_beside_workers(cfg, status, rows_checked)
    where = f" on node {nodes.rank if nodes.backend == 'static' else '(rank from rendezvous)'} of {nodes.count}" if nodes.count > 1 else ""
    typer.echo(f"launching {plan.num_processes} process(es){where}, effective batch {effective}", err=True)
    try:
        code = launch(plan)
    finally:
        status.unlink(missing_ok=True)
    raise typer.Exit(code)


def keys_the_method_does_not_read(cfg) -> set[str]:
    """The run's method keys that its settings leave unread (the method class says): the one place --dry-run asks.
    Other methods' keys are not in the run's config at all (methods/registry composes only the chosen method's)."""
    return type(cfg).training_method.unread_keys(cfg)


# Keys that only mean something when another key says so: (the keys, whether this run reads them).
_DEPENDENT_KEYS = (
    (("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_bias", "use_rslora"), lambda c: c.uses_lora),
    (("hub_strategy", "hub_private"), lambda c: c.push_to_hub or c.huggingface_save_gguf),
    (("ollama_base", "ollama_push"), lambda c: bool(c.ollama_model)),
    (("quantization_method", "huggingface_save_gguf", "ollama_save"), lambda c: c.save_gguf),
    (("save_steps", "save_total_limit"), lambda c: c.save_strategy != "no"),
    (("eval_steps", "per_device_eval_batch_size", "load_best_model_at_end", "metric_for_best_model",
      "greater_is_better", "early_stopping_patience", "early_stopping_threshold"), lambda c: c.eval_strategy != "no"),
    (("tiled_mlp_shards",), lambda c: c.tiled_mlp),
    (("group_by_length_window",), lambda c: c.group_by_length),
)


def keys_shown(cfg, takes_images: bool | None) -> dict:
    """The resolved config as --dry-run prints it: every key this run reads, and every key written with another
    value than its default; keys at their default that the method, the model (no images) or the settings leave
    unread are left out."""
    from ..config.vision import VISION_KEYS

    unread = keys_the_method_does_not_read(cfg)
    if takes_images is False:
        unread |= set(VISION_KEYS)
    for keys, read in _DEPENDENT_KEYS:
        if not read(cfg):
            unread |= set(keys)
    fields = type(cfg).model_fields

    def at_default(key: str) -> bool:
        value, default = getattr(cfg, key), fields[key].default
        return value == default or value == [default]  # quantization_method: validated into a list

    return {key: value for key, value in cfg.model_dump(mode="json").items() if key not in unread or not at_default(key)}


def train_on_ray(config: Path, cfg, num_workers: int, address: Optional[str], cpu: bool, max_restarts: int,
                 gpus: Optional[str], nnodes: int, fsdp: bool, accelerate_config: Optional[Path], dry_run: bool) -> None:
    """--ray: the same checks, the data tokenized here, then Ray Train's workers run the training module."""
    from ..launcher.ray import import_ray, run_with_ray

    if gpus is not None or nnodes > 1 or fsdp or accelerate_config is not None:
        fail("--ray places the workers itself: use --num-workers (and --address for a cluster) instead of --gpus, "
             "--nnodes, --fsdp or --accelerate-config")
    import_ray()
    start = check_launch(cfg, num_workers, dry_run=dry_run, inputs=model_inputs(cfg))
    if dry_run:
        typer.echo(f"# Ray Train: {num_workers} worker(s) on {address or 'a local Ray instance'}; start: {start}")
        raise typer.Exit(0)
    hold_run_lock(cfg, None)
    from ..runtime.handoff import worker_environment
    from ..run_dir.manifest import verdicts
    from ._common import tokenized_or_fail

    tokenized_or_fail(cfg)  # once, here: the workers only read the cache
    typer.echo(f"launching {num_workers} Ray Train worker(s), effective batch {cfg.per_device_train_batch_size} x "
               f"{cfg.gradient_accumulation_steps} x {num_workers}", err=True)
    handoff = worker_environment(run_lock=True, checked_checkpoints=verdicts())
    raise typer.Exit(run_with_ray(config, cfg, num_workers, address, cpu, max_restarts, handoff))


def hold_run_lock(cfg, nodes) -> None:
    """One run per output_dir, held until this process exits; refused in one line when another run holds it."""
    from ..run_dir.lock import RunLocked, launcher_lock

    try:
        launcher_lock(cfg.output_path(), nodes)
    except RunLocked as exc:
        fail(first_line(exc))
    except OSError as exc:  # a folder it may not write in, a full disk
        fail(f"output_dir: cannot write in '{cfg.output_dir}': {exc.strerror or first_line(exc)}")


def check_rows_before_launch(cfg):
    """Every row checked against its format here, before a worker starts or anything is written (a bad row is one
    line and exit 2): (tokenizer, the method's data half) for the tokenizing that follows, or None when the cache
    already holds these datasets (their rows were checked when it was built)."""
    import sys

    from ..data import DataError, cached_for_inputs, check_rows, load_tokenizer
    from ..logs import quiet_datasets
    from ..methods import method_for
    from ._common import cannot_load_tokenizer

    if cached_for_inputs(cfg):
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # in this process only: the workers keep --verbose's choice
    quiet_datasets(progress=sys.stderr.isatty())
    try:
        tokenizer = load_tokenizer(cfg)
    except DataError:
        raise  # already one line (one_line_errors)
    except Exception as exc:
        fail(cannot_load_tokenizer(cfg, exc))
    method_data = method_for(cfg).data(tokenizer)
    try:
        check_rows(cfg, method_data)
    except DataError:
        raise
    except Exception as exc:  # a file the datasets library cannot read, say
        fail(f"preprocessing: {type(exc).__name__}: {first_line(exc)}")
    return tokenizer, method_data


def preprocess_beside_workers(cfg, status: Path, rows_checked) -> None:
    """Tokenize in this process while the workers start (importing torch and loading the model takes them longer
    than a small dataset takes here); they wait for it through the status file (handoff.py), never in a collective
    that would time out on a large dataset. A failure reaches the console once, through rank 0."""
    import threading

    from ..data import DataError, load_datasets
    from ..runtime.handoff import write_preprocessing_status

    write_preprocessing_status(status, "running")

    def work() -> None:
        if rows_checked is None:
            write_preprocessing_status(status, "done", cached=True)
            return
        tokenizer, method_data = rows_checked
        try:
            cached = load_datasets(cfg, tokenizer, method_data)[2]
        except DataError as exc:
            write_preprocessing_status(status, "failed", str(exc))
        except Exception as exc:
            write_preprocessing_status(status, "failed", f"preprocessing: {type(exc).__name__}: {first_line(exc)}")
        else:
            write_preprocessing_status(status, "done", cached=cached)

    threading.Thread(target=work, name="preprocessing", daemon=True).start()
