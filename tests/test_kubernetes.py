"""`praisonai-accel k8s`: TrainJob and PyTorchJob manifests validated offline against Kubeflow's own CRD schemas
(../shared/fixtures/kubeflow), strictly, as the API server's strict field validation is. The pods' command runs as two
local "pods" in test_multinode.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.launcher.kubernetes import KubernetesJob, check_job, manifest, pod_command

from conftest import cli, cpu_env

KUBEFLOW = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "kubeflow"
needs_crds = pytest.mark.skipif(not KUBEFLOW.is_dir(), reason="../shared/fixtures/kubeflow is absent")


def strict(schema):
    """The CRD's OpenAPI schema as JSON Schema that refuses unknown fields wherever Kubernetes would."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validator(crd_file: str):
    import jsonschema

    crd = yaml.safe_load((KUBEFLOW / crd_file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served", True)]
    schema = strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema), crd["spec"]["group"] + "/" + version["name"], crd["spec"]["names"]["kind"]


def job(**overrides) -> KubernetesJob:
    values = dict(config_path="/workspace/config.yaml", image="ghcr.io/me/train:1.0", nodes=2, gpus_per_node=8,
                  pvc="training-data", namespace="ml", max_restarts=2)
    return KubernetesJob(**{**values, **overrides})


CONFIG = parse_config({"model_name": "Qwen/Qwen2.5-0.5B-Instruct", "dataset": "/workspace/data.jsonl",
                       "output_dir": "/workspace/outputs"})


@needs_crds
@pytest.mark.parametrize("kind, crd_file", [("trainjob", "trainer.kubeflow.org_trainjobs.yaml"),
                                            ("pytorchjob", "kubeflow.org_pytorchjobs.yaml")])
@pytest.mark.parametrize("cpu", [False, True])
def test_manifests_validate_against_the_kubeflow_crds(kind, crd_file, cpu):
    check, api_version, crd_kind = validator(crd_file)
    document = manifest(job(kind=kind, cpu=cpu))
    assert (document["apiVersion"], document["kind"]) == (api_version, crd_kind)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in check.iter_errors(document)]
    assert not errors, errors
    misspelt = copy.deepcopy(document)
    misspelt["spec"]["trainer" if kind == "trainjob" else "runPolicy"]["numNode"] = 2
    assert any("numNode" in e.message for e in check.iter_errors(misspelt)), "the validator must refuse unknown keys"


@needs_crds
def test_the_trainjob_patches_the_runtimes_own_job_and_container():
    runtime = yaml.safe_load((KUBEFLOW / "torch_distributed_runtime.yaml").read_text())
    document = manifest(job())
    assert document["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "torch-distributed"
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (patched,) = document["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert patched["name"] == replicated["name"]
    pod = patched["template"]["spec"]["template"]["spec"]
    runtime_containers = {c["name"] for c in replicated["template"]["spec"]["template"]["spec"]["containers"]}
    assert {c["name"] for c in pod["containers"]} <= runtime_containers
    assert pod["volumes"] == [{"name": "shared", "persistentVolumeClaim": {"claimName": "training-data"}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "shared", "mountPath": "/workspace"}]
    trainer = document["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    assert trainer["command"] == ["praisonai-accel", "train", "/workspace/config.yaml", "--gpus", "8", "--max-restarts", "2"]


def test_hf_token_comes_from_a_secret_and_is_never_inlined(tmp_path, tiny_model, alpaca_file):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model_name": str(tiny_model), "dataset": str(alpaca_file),
                                      "output_dir": str(tmp_path / "out")}))
    secret = "hf_" + "s3cr3t" * 6
    for kind in ("trainjob", "pytorchjob"):
        result = cli("k8s", str(config), "--nodes", "1", "--gpus-per-node", "1", "--image", "me/train:1", "--kind", kind,
                     env=cpu_env(HF_TOKEN=secret))
        assert result.returncode == 0, result.stderr
        assert secret not in result.stdout + result.stderr
        document = yaml.safe_load(result.stdout)
        containers = (document["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
                      if kind == "pytorchjob" else [document["spec"]["trainer"]])
        token = next(e for e in containers[0]["env"] if e["name"] == "HF_TOKEN")
        assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token",
                                                                            "optional": True}}}


def test_the_pytorchjob_pods_pass_the_operators_rendezvous():
    document = manifest(job(kind="pytorchjob", nodes=3))
    replicas = document["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    (container,) = replicas["Worker"]["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["command"] == pod_command(job(kind="pytorchjob", nodes=3))
    assert container["command"][5:13] == ["--nnodes", "3", "--node-rank", "$(RANK)", "--main-addr", "$(MASTER_ADDR)",
                                          "--main-port", "$(MASTER_PORT)"]
    assert replicas["Master"]["restartPolicy"] == "OnFailure" and document["spec"]["nprocPerNode"] == "8"


@pytest.mark.parametrize("overrides, config, message", [
    ({"pvc": None}, CONFIG, "--nodes 2: output_dir must be on a volume every pod mounts; give --pvc NAME"),
    ({}, parse_config({"model_name": "m", "dataset": "d", "output_dir": "/scratch/out"}),
     "output_dir: /scratch/out is not under the volume mounted at /workspace"),
    ({}, parse_config({"model_name": "m", "dataset": "d", "output_dir": "outputs"}),
     "output_dir: outputs is not under the volume mounted at /workspace"),
    ({"name": "My_Job"}, CONFIG, "--name 'My_Job': not a valid Kubernetes name"),
    ({"namespace": "a b"}, CONFIG, "--namespace 'a b': not a valid Kubernetes name"),
    ({"image": "me/train:1\n  command: [sh]"}, CONFIG, "not a valid Kubernetes image reference"),
    ({"image": "$(rm -rf /)"}, CONFIG, "not a valid Kubernetes image reference"),
    ({"mount_path": "data"}, CONFIG, "--mount-path data: must be an absolute path in the pod"),
    ({"kind": "mpijob"}, CONFIG, "--kind mpijob: expected one of trainjob, pytorchjob"),
])
def test_bad_values_are_one_line_before_any_manifest(overrides, config, message):
    with pytest.raises(ConfigError, match=None) as caught:
        check_job(job(**overrides), config)
    assert message in str(caught.value)


def test_the_cli_refuses_with_one_line(tmp_path, tiny_model, alpaca_file):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model_name": str(tiny_model), "dataset": str(alpaca_file),
                                      "output_dir": str(tmp_path / "out")}))
    result = cli("k8s", str(config), "--nodes", "2", "--gpus-per-node", "1", "--image", "me/train:1")
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: --nodes 2: output_dir must be on a volume every pod mounts; give --pvc NAME"]


def test_train_reads_the_rendezvous_a_trainjob_gives_its_pods(tmp_path, tiny_model, alpaca_file):
    from conftest import write_config

    config = write_config(tmp_path, tiny_model, alpaca_file)
    pod = dict(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK="1", PET_MASTER_ADDR="10.0.0.7", PET_MASTER_PORT="29511")
    dry = cli("train", str(config), "--cpu", "--num-processes", "1", "--dry-run", env=cpu_env(**pod))
    assert dry.returncode == 0, dry.stderr
    assert "# processes: 2 (1 per node x 2 nodes)" in dry.stdout
    assert "machine_rank: 1" in dry.stdout and "main_process_ip: 10.0.0.7" in dry.stdout and "main_process_port: 29511" in dry.stdout
    elastic = cli("train", str(config), "--cpu", "--dry-run", env=cpu_env(**{**pod, "PET_NNODES": "1:4"}))
    assert elastic.returncode != 0 and elastic.stderr.strip().splitlines() == [
        "error: PET_NNODES=1:4, PET_NODE_RANK=1, PET_MASTER_PORT=29511: expected whole numbers (a fixed node count: an "
        "elastic range such as 1:4 is not supported)"]
