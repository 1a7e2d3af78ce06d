"""Kubernetes manifests for Kubeflow Trainer, an engine beside torchrun and SLURM.

The default is Kubeflow Trainer v2's TrainJob (trainer.kubeflow.org/v1alpha1) on the `torch-distributed`
ClusterTrainingRuntime, whose pods get PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
PET_MASTER_PORT; `--kind pytorchjob` gives the older Training Operator's PyTorchJob (kubeflow.org/v1), whose pods get
MASTER_ADDR, MASTER_PORT and RANK. Either way each pod runs `praisonai-accel train CONFIG`, one launcher per node, so
the launch plan, the checkpoints and the exact resume are the ones every other engine uses. Every value written
into the manifest is validated here and quoted by the YAML writer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..config import CONTROL_CHARACTERS, ConfigError, TrainConfig

KINDS = ("trainjob", "pytorchjob")
RUNTIME = "torch-distributed"
TRAINER_CONTAINER = "node"  # the torch-distributed runtime's container
PYTORCH_CONTAINER = "pytorch"  # the name the Training Operator requires
VOLUME = "shared"
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123 label: names and namespaces
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # RFC 1123 subdomain: PVC and Secret names
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@]*$")


@dataclass(frozen=True)
class KubernetesJob:
    config_path: str  # where the pods find config.yaml (on the volume, or in the image)
    image: str
    nodes: int
    gpus_per_node: int
    kind: str = "trainjob"
    name: str = "praisonai-accel"
    namespace: str | None = None
    pvc: str | None = None
    mount_path: str = "/workspace"
    cpu: bool = False
    max_restarts: int = 0
    hf_token_secret: str = "hf-token"  # Secret holding HF_TOKEN under the key `token`; optional in the pod
    grace_seconds: int = 120


def check_job(job: KubernetesJob, config: TrainConfig) -> None:
    """Every value the manifest will hold, and the rule that every pod must share output_dir."""
    if job.kind not in KINDS:
        raise ConfigError(f"--kind {job.kind}: expected one of {', '.join(KINDS)}")
    for flag, value, pattern in (("--name", job.name, _LABEL), ("--namespace", job.namespace, _LABEL),
                                 ("--pvc", job.pvc, _SUBDOMAIN), ("--hf-token-secret", job.hf_token_secret, _SUBDOMAIN),
                                 ("--image", job.image, _IMAGE)):
        if value is not None and not pattern.match(value):
            raise ConfigError(f"{flag} '{value}': not a valid Kubernetes "
                              f"{'image reference' if flag == '--image' else 'name (lower case letters, digits, -)'}")
    for flag, value in (("CONFIG", job.config_path), ("--mount-path", job.mount_path)):
        if CONTROL_CHARACTERS.search(value) or not value:
            raise ConfigError(f"{flag}: control characters or an empty path cannot go into a manifest")
    if not PurePosixPath(job.mount_path).is_absolute():
        raise ConfigError(f"--mount-path {job.mount_path}: must be an absolute path in the pod")
    if job.nodes > 1 and job.pvc is None:
        raise ConfigError(f"--nodes {job.nodes}: output_dir must be on a volume every pod mounts; give --pvc NAME")
    if job.pvc is not None:
        for key, value in (("output_dir", config.output_dir), ("dataset_prepared_path", config.dataset_prepared_path)):
            if value is not None and not _under(value, job.mount_path):
                raise ConfigError(f"{key}: {value} is not under the volume mounted at {job.mount_path}; every pod must "
                                  f"see it: put it under {job.mount_path}")


def _under(path: str, mount: str) -> bool:
    candidate = PurePosixPath(path)
    return candidate.is_absolute() and PurePosixPath(mount) in (candidate, *candidate.parents)


def pod_command(job: KubernetesJob) -> list[str]:
    """What each pod runs: one `praisonai-accel train` launcher per node. A TrainJob's pods give the rendezvous in
    PET_* variables, which the command reads itself; a PyTorchJob's as MASTER_ADDR, MASTER_PORT and RANK, which
    Kubernetes substitutes for $(NAME) in the command."""
    command = ["praisonai-accel", "train", job.config_path]
    command += ["--cpu", "--num-processes", str(job.gpus_per_node)] if job.cpu else ["--gpus", str(job.gpus_per_node)]
    if job.kind == "pytorchjob" and job.nodes > 1:
        command += ["--nnodes", str(job.nodes), "--node-rank", "$(RANK)", "--main-addr", "$(MASTER_ADDR)",
                    "--main-port", "$(MASTER_PORT)"]
    if job.max_restarts:
        command += ["--max-restarts", str(job.max_restarts)]
    return command


def _env(job: KubernetesJob) -> list[dict]:
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": job.hf_token_secret, "key": "token",
                                                                "optional": True}}}
    return [token, {"name": "PYTHONUNBUFFERED", "value": "1"}]


def _resources(job: KubernetesJob) -> dict:
    return {} if job.cpu else {"limits": {"nvidia.com/gpu": job.gpus_per_node}}


def _volumes(job: KubernetesJob) -> tuple[list[dict], list[dict]]:
    if job.pvc is None:
        return [], []
    return ([{"name": VOLUME, "persistentVolumeClaim": {"claimName": job.pvc}}],
            [{"name": VOLUME, "mountPath": job.mount_path}])


def _metadata(job: KubernetesJob) -> dict:
    metadata = {"name": job.name, "labels": {"app.kubernetes.io/created-by": "praisonai-accel"}}
    if job.namespace:
        metadata["namespace"] = job.namespace
    return metadata


def trainjob_manifest(job: KubernetesJob) -> dict:
    volumes, mounts = _volumes(job)
    pod_spec: dict = {"terminationGracePeriodSeconds": job.grace_seconds}  # time for the preemption save
    if volumes:
        pod_spec["volumes"] = volumes
        pod_spec["containers"] = [{"name": TRAINER_CONTAINER, "volumeMounts": mounts}]
    trainer = {"image": job.image, "command": pod_command(job), "numNodes": job.nodes, "env": _env(job)}
    if not job.cpu:
        trainer["resourcesPerNode"] = _resources(job)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(job),
        "spec": {
            "runtimeRef": {"name": RUNTIME, "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [{"manager": "praisonai-accel", "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod_spec}}}}]}}}}],
        },
    }


def pytorchjob_manifest(job: KubernetesJob) -> dict:
    volumes, mounts = _volumes(job)

    def replica(count: int) -> dict:
        container = {"name": PYTORCH_CONTAINER, "image": job.image, "command": pod_command(job), "env": _env(job)}
        if mounts:
            container["volumeMounts"] = mounts
        if not job.cpu:
            container["resources"] = _resources(job)
        spec = {"containers": [container], "terminationGracePeriodSeconds": job.grace_seconds}
        if volumes:
            spec["volumes"] = volumes
        # OnFailure: Kubernetes restarts the pod and `praisonai-accel train` resumes from the latest checkpoint
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": spec}}

    replicas = {"Master": replica(1)}
    if job.nodes > 1:
        replicas["Worker"] = replica(job.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job),
        "spec": {"nprocPerNode": str(job.gpus_per_node), "pytorchReplicaSpecs": replicas,
                 "runPolicy": {"backoffLimit": max(job.max_restarts, 1) * job.nodes, "cleanPodPolicy": "Running"}},
    }


def manifest(job: KubernetesJob) -> dict:
    return trainjob_manifest(job) if job.kind == "trainjob" else pytorchjob_manifest(job)


def render(job: KubernetesJob) -> str:
    import yaml

    return yaml.safe_dump(manifest(job), sort_keys=False, default_flow_style=False)
