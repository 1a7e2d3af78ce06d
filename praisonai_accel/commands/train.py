"""praisonai-accel train CONFIG: validate, write the accelerate config, launch the training module."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import yaml

from ..errors import first_line
from ._common import (
    bf16_supported, check_checkpointing, check_device_map, check_final_model_dir, check_hub_access, check_local_inputs, check_resume,
    check_not_deepspeed, check_trackers, count_cuda_gpus, fail, load_config_or_fail,
)
from .export import check_gguf_before_training


def resolve_processes(gpus: Optional[str], cpu: bool, num_processes: Optional[int], available_gpus) -> tuple[int, Optional[list[int]]]:
    from ..launch import parse_gpus

    if cpu:
        if gpus is not None:
            fail("--cpu and --gpus cannot be used together")
        return num_processes or 1, None
    if gpus is None and num_processes is not None:
        gpus = str(num_processes)  # --num-processes N without --cpu means N GPUs
    if gpus is None:
        return 1, None
    return parse_gpus(gpus, available_gpus())


def rendezvous_from_environment(environ=None) -> Optional[tuple[int, int, str, int]]:
    """(nodes, node rank, main address, main port) from the variables a Kubeflow TrainJob gives its pods
    (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT), or None when they are absent."""
    import os

    environ = os.environ if environ is None else environ
    names = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
    if not all(environ.get(name) for name in names):
        return None
    values = [environ[name] for name in names]
    if not values[0].isdigit() or not values[1].isdigit() or not values[3].isdigit():
        fail(f"PET_NNODES={values[0]}, PET_NODE_RANK={values[1]}, PET_MASTER_PORT={values[3]}: expected whole numbers "
             "(a fixed node count: an elastic range such as 1:4 is not supported)")
    return int(values[0]), int(values[1]), values[2], int(values[3])


def resolve_nodes(nnodes: int, node_rank: Optional[int], main_addr: Optional[str], main_port: Optional[int],
                  rdzv_endpoint: Optional[str]):
    from ..launch import Nodes

    from_pods = rendezvous_from_environment()
    if from_pods and from_pods[0] > 1 and nnodes == 1 and node_rank is None and not main_addr and not rdzv_endpoint:
        nnodes, node_rank, main_addr, main_port = from_pods

    if nnodes == 1:
        if node_rank or main_addr or rdzv_endpoint:
            fail("--node-rank, --main-addr and --rdzv-endpoint need --nnodes greater than 1")
        return Nodes()
    if rdzv_endpoint:
        if node_rank is not None or main_addr:
            fail("--rdzv-endpoint assigns ranks itself: leave out --node-rank and --main-addr")
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            fail(f"--rdzv-endpoint {rdzv_endpoint}: expected HOST:PORT")
        return Nodes(count=nnodes, rdzv_endpoint=rdzv_endpoint)
    if node_rank is None or not main_addr:
        fail(f"--nnodes {nnodes}: give --node-rank R and --main-addr HOST (static), or --rdzv-endpoint HOST:PORT (c10d)")
    if not 0 <= node_rank < nnodes:
        fail(f"--node-rank {node_rank}: must be between 0 and {nnodes - 1}")
    return Nodes(count=nnodes, rank=node_rank, main_addr=main_addr, main_port=main_port)


def memory_note(config, processes_here: int, fsdp: bool = False) -> str:
    """What the processes of this machine hold in host memory, for a worker the out-of-memory killer ended."""
    import os

    from ..preflight import local_weight_bytes

    weights = local_weight_bytes(config.model_name)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    held = ("rank 0 loads the whole model before FSDP shards it" if fsdp else
            f"each of the {processes_here} processes on this machine loads a full copy of the model")
    held += f" ({weights / 2**30:.1f} GiB of weights)" if weights else ""
    return held + (f" and it has {ram / 2**30:.1f} GiB of RAM" if ram else "")


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
    ray: bool = typer.Option(False, "--ray", help="run the workers as a Ray Train TorchTrainer (pip install 'praisonai-accel[ray]')"),
    num_workers: int = typer.Option(2, "--num-workers", min=1, help="Ray Train workers (processes), with --ray"),
    address: Optional[str] = typer.Option(None, "--address", help="a running Ray cluster's address, with --ray (default: a local one)"),
) -> None:
    """Fine-tune a model as described by CONFIG."""
    from ..distributed import VERBOSE_ENV, resolve_mixed_precision
    from ..launch import MEMORY_NOTE_ENV, LaunchError, launch, plan_launch

    cfg = load_config_or_fail(config)
    check_local_inputs(cfg)
    check_trackers(cfg)
    check_gguf_before_training(cfg)
    if accelerate_config is not None and not accelerate_config.is_file():
        fail(f"--accelerate-config: no such file '{accelerate_config}'")
    if accelerate_config is not None:
        check_not_deepspeed(accelerate_config)
    if accelerate_config is not None and (nnodes > 1 or fsdp):
        fail("--accelerate-config is used as is: put the machines and FSDP settings in it instead of --nnodes/--fsdp")
    if ray:
        train_on_ray(config, cfg, num_workers, address, cpu, max_restarts, gpus, nnodes, fsdp, accelerate_config, dry_run)
    nodes = resolve_nodes(nnodes, node_rank, main_addr, main_port, rdzv_endpoint)
    try:
        per_node, gpu_ids = resolve_processes(gpus, cpu, num_processes, count_cuda_gpus)
        # Only a generated multi-GPU accelerate config records the precision; the training module decides anyway.
        on_gpus = not cpu and (per_node > 1 or nodes.count > 1) and accelerate_config is None
        precision = resolve_mixed_precision(cfg.mixed_precision, on_gpus, on_gpus and bf16_supported())
        plan = plan_launch(config, cfg, num_processes=per_node, gpu_ids=gpu_ids, cpu=cpu, mixed_precision=precision,
                           accelerate_config_file=accelerate_config, nodes=nodes, max_restarts=max_restarts, fsdp=fsdp)
    except (LaunchError, ValueError, OSError, yaml.YAMLError) as exc:
        fail(first_line(exc))
    if verbose:
        plan.env[VERBOSE_ENV] = "1"
    if plan.num_processes > 1 and not dry_run:
        plan.env[MEMORY_NOTE_ENV] = memory_note(cfg, per_node, fsdp)

    check_device_map(cfg, plan.num_processes)
    check_checkpointing(cfg, plan.num_processes)
    check_final_model_dir(cfg)
    start = check_resume(cfg, plan.num_processes)
    if not dry_run:
        check_hub_access(cfg)
    per_device, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    effective = f"{per_device} x {accum} x {plan.num_processes} = {per_device * accum * plan.num_processes}"
    if dry_run:
        typer.echo("# resolved config")
        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
        typer.echo(f"# processes: {plan.num_processes}" + (f" ({per_node} per node x {nodes.count} nodes)" if nodes.count > 1 else ""))
        typer.echo(f"# effective batch (per device x accumulation x processes): {effective}")
        typer.echo(f"# start: {start}")
        if plan.generated_config:
            typer.echo(f"# accelerate config to write: {plan.accelerate_config_path}")
            typer.echo(yaml.safe_dump(plan.accelerate_config, sort_keys=True).rstrip())
        typer.echo("# launch command")
        typer.echo(plan.printable())
        return
    status = preprocess_beside_workers(cfg, plan)
    where = f" on node {nodes.rank if nodes.backend == 'static' else '(rank from rendezvous)'} of {nodes.count}" if nodes.count > 1 else ""
    typer.echo(f"launching {plan.num_processes} process(es){where}, effective batch {effective}", err=True)
    try:
        code = launch(plan)
    finally:
        status.unlink(missing_ok=True)
    raise typer.Exit(code)


def train_on_ray(config: Path, cfg, num_workers: int, address: Optional[str], cpu: bool, max_restarts: int,
                 gpus: Optional[str], nnodes: int, fsdp: bool, accelerate_config: Optional[Path], dry_run: bool) -> None:
    """--ray: the same checks, the data tokenized here, then Ray Train's workers run the training module."""
    from ..config import ConfigError
    from ..ray_engine import import_ray, run_with_ray

    if gpus is not None or nnodes > 1 or fsdp or accelerate_config is not None:
        fail("--ray places the workers itself: use --num-workers (and --address for a cluster) instead of --gpus, "
             "--nnodes, --fsdp or --accelerate-config")
    try:
        import_ray()
    except ConfigError as exc:
        fail(str(exc))
    check_device_map(cfg, num_workers)
    check_checkpointing(cfg, num_workers)
    check_final_model_dir(cfg)
    start = check_resume(cfg, num_workers)
    if dry_run:
        typer.echo(f"# Ray Train: {num_workers} worker(s) on {address or 'a local Ray instance'}; start: {start}")
        raise typer.Exit(0)
    check_hub_access(cfg)
    from ._common import tokenized_or_fail

    tokenized_or_fail(cfg)  # once, here: the workers only read the cache
    typer.echo(f"launching {num_workers} Ray Train worker(s), effective batch {cfg.per_device_train_batch_size} x "
               f"{cfg.gradient_accumulation_steps} x {num_workers}", err=True)
    raise typer.Exit(run_with_ray(config, cfg, num_workers, address, cpu, max_restarts))


def preprocess_beside_workers(cfg, plan) -> Path:
    """Tokenize in this process while the workers start (importing torch and loading the model takes them longer
    than a small dataset takes here); they wait for it through a status file, never in a collective that would time
    out on a large dataset. A failure reaches the console once, through rank 0."""
    import sys
    import threading
    import uuid

    from ..data import (
        PREPROCESSING_ENV, DataError, cached_for_inputs, ensure_chat_template, load_datasets, quiet_datasets,
        write_preprocessing_status,
    )
    from ..model import load_tokenizer
    from ._common import cannot_load_tokenizer

    status = cfg.output_path() / "logs" / f".preprocessing-{uuid.uuid4().hex}.json"
    write_preprocessing_status(status, "running")
    plan.env[PREPROCESSING_ENV] = str(status.resolve())
    quiet_datasets(progress=sys.stderr.isatty())

    def work() -> None:
        if cached_for_inputs(cfg):
            write_preprocessing_status(status, "done", cached=True)
            return
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # in this process only: the workers keep --verbose's choice
        try:
            tokenizer = load_tokenizer(cfg)
        except Exception as exc:
            write_preprocessing_status(status, "failed", cannot_load_tokenizer(cfg, exc))
            return
        try:
            ensure_chat_template(tokenizer, cfg.chat_template)
            cached = load_datasets(cfg, tokenizer)[2]
        except DataError as exc:
            write_preprocessing_status(status, "failed", str(exc))
        except Exception as exc:
            write_preprocessing_status(status, "failed", f"preprocessing: {type(exc).__name__}: {first_line(exc)}")
        else:
            write_preprocessing_status(status, "done", cached=cached)

    threading.Thread(target=work, name="preprocessing", daemon=True).start()
    return status
