"""Before the model loads, every rank checks that the job can run, so a bad network, a small /dev/shm, mismatched
installs or too little memory or disk are one line with the numbers, not a silent hang or a bus error an hour in.

- one tiny all-reduce over the transport training uses, with a short timeout (`preflight_timeout`);
- the package versions of every rank, which must agree;
- /dev/shm where NCCL puts its intra-node buffers;
- host RAM for the copies of the model this machine loads, and disk for the checkpoints kept.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
from importlib import metadata
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..models.files import local_weight_bytes
from ..runtime.distributed import attempt_id

log = logging.getLogger("praisonai_accel")

VERSIONED = ("torch", "transformers", "peft", "accelerate", "praisonai-accel")
SHM_NEEDED_BYTES = 1 << 30  # what 8 NCCL processes of a node comfortably share; Docker's default is 64 MiB


class PreflightError(ConfigError):
    """The job cannot run as launched; said once per node, before the model loads."""


def package_versions() -> dict[str, str]:
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def run_preflight(accelerator, config: TrainConfig, local_processes: int, fsdp: bool = False) -> None:
    import torch

    if accelerator.num_processes > 1:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        prefix = f"praisonai-accel-preflight/{attempt_id()}"
        rank, world = accelerator.process_index, accelerator.num_processes
        store.set(f"{prefix}/{rank}", json.dumps({"host": socket.gethostname(), "versions": package_versions()}))
        reached = lambda: store.set(f"{prefix}/{rank}/reached", "1")  # noqa: E731
        if not _all_reduce_within(config.preflight_timeout, accelerator.device, reached):
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}/reached"])]
            raise PreflightError(no_answer_message(missing, _hosts(store, prefix, world), world, config.preflight_timeout,
                                                   dist.get_backend()))
        peers = [json.loads(store.get(f"{prefix}/{r}")) for r in range(world)]
        mismatch = version_mismatch(peers)
        if mismatch:
            raise PreflightError(mismatch)
    if accelerator.is_local_main_process:
        for warning in resource_warnings(config, local_processes, torch.cuda.is_available(), fsdp):
            log.warning("warning: %s", warning)


def _all_reduce_within(seconds: float, device, reached) -> bool:
    import torch
    import torch.distributed as dist

    reached()
    work = dist.all_reduce(torch.ones(1, device=device), async_op=True)
    try:
        done = work.wait(datetime.timedelta(seconds=seconds))
    except Exception:  # gloo raises on a timeout
        return False
    return done is not False


def _hosts(store, prefix: str, world: int) -> dict[int, str]:
    hosts = {}
    for r in range(world):
        if store.check([f"{prefix}/{r}"]):
            hosts[r] = json.loads(store.get(f"{prefix}/{r}"))["host"]
    return hosts


def no_answer_message(missing: list[int], hosts: dict[int, str], world: int, seconds: float, backend: str) -> str:
    interface = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if missing:
        who = ", ".join(f"rank {r}" + (f" on {hosts[r]}" if r in hosts else "") for r in missing)
        what = f"{who} did not reach it"
    else:
        what = f"every rank reached it, on {', '.join(sorted(set(hosts.values())))}, and it still did not complete"
    return (f"preflight: an all-reduce across {world} ranks ({backend}) did not complete in {seconds:g} s: {what}; "
            f"check that the nodes reach each other on the network interface {backend} uses (set {interface} to "
            "it, e.g. eth0) and that no firewall blocks the ports between them")


def version_mismatch(peers: list[dict]) -> str:
    """One line naming each package whose version differs between ranks, and where each version is."""
    parts = []
    for name in VERSIONED:
        where: dict[str, list[str]] = {}
        for rank, peer in enumerate(peers):
            where.setdefault(peer["versions"].get(name, "?"), []).append(f"{peer['host']} rank {rank}")
        if len(where) > 1:
            parts.append(f"{name} " + " vs ".join(f"{v} ({', '.join(ranks)})" for v, ranks in where.items()))
    if not parts:
        return ""
    return "preflight: package versions differ between ranks: " + "; ".join(parts) + "; install the same on every node"


def resource_warnings(config: TrainConfig, local_processes: int, cuda: bool, fsdp: bool = False,
                      shm: str = "/dev/shm", available_ram: int | None = None, free_disk: int | None = None) -> list[str]:
    warnings = []
    if cuda and local_processes > 1:
        try:
            stats = os.statvfs(shm)
            size = stats.f_frsize * stats.f_blocks
        except OSError:
            size = None
        if size is not None and size < SHM_NEEDED_BYTES:
            warnings.append(f"/dev/shm is {size / 2**20:.0f} MiB: NCCL's shared memory between the {local_processes} "
                            "processes of this machine can die with 'bus error'; give the container more "
                            "(docker run --shm-size=8g, or --ipc=host) or set NCCL_SHM_DISABLE=1")
    weights = local_weight_bytes(config.model_name)
    if weights:
        copies = 1 if fsdp else local_processes  # FSDP: rank 0 loads the model and shards it
        ram = available_ram if available_ram is not None else _available_ram()
        if ram and copies * weights > ram:
            warnings.append(f"host RAM: {copies} process(es) here each load a full copy of the model "
                            f"({copies} x {weights / 2**30:.1f} GiB) and {ram / 2**30:.1f} GiB is available; expect the "
                            "out-of-memory killer: fewer processes, finetune_type: qlora, or --fsdp")
        if config.finetune_type == "full":
            kept = (config.save_total_limit or 1) + 1  # the checkpoints kept, and the final model
            need = kept * weights * 3  # weights, and Adam's two moments, at the weights' size
            free = free_disk if free_disk is not None else _free_disk(config.output_path())
            if free is not None and need > free:
                warnings.append(f"disk: {kept - 1} checkpoint(s) of full fine-tuning and the final model need about "
                                f"{need / 2**30:.1f} GiB (weights and optimizer state) and {free / 2**30:.1f} GiB is "
                                f"free under {config.output_dir}; lower save_total_limit or free space")
    return warnings


def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _free_disk(path: Path) -> int | None:
    for candidate in (path, *path.resolve().parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None
