"""Rank environment, per-rank device maps, and the UNSLOTH_USE_NEW_MODEL dance (with unsloth absent)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.runtime.distributed import (
    DistEnv, mark_unsloth_ddp, resolve_device_map, resolve_mixed_precision,
)
from praisonai_accel.models import loading as model_module
from praisonai_accel.data.vision_processor import ModelInputs

TEXT = ModelInputs(False)  # a text model


def test_env_is_read_from_torchrun_variables():
    env = DistEnv.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert (env.rank, env.local_rank, env.world_size, env.is_distributed, env.is_main) == (3, 1, 4, True, False)
    assert DistEnv.from_environ({}) == DistEnv(0, 0, 1)


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_each_ddp_rank_loads_the_full_model_on_its_own_gpu(local_rank):
    env = DistEnv(rank=local_rank, local_rank=local_rank, world_size=4)
    assert resolve_device_map(None, env, cuda_available=True) == {"": local_rank}
    assert resolve_device_map(None, env, cuda_available=False) is None  # CPU: no device_map at all


def test_ranks_beyond_the_gpu_count_share_gpus_as_accelerate_places_them():
    """Two ranks on one GPU (gloo): both load on cuda:0, where accelerate's set_device puts them too."""
    assert [resolve_device_map(None, DistEnv(r, r, 4), True, device_count=2) for r in range(4)] == [
        {"": 0}, {"": 1}, {"": 0}, {"": 1}]
    assert resolve_device_map(None, DistEnv(1, 1, 2), True, device_count=1) == {"": 0}


def test_ddp_backend_is_chosen_by_environment_variable():
    from praisonai_accel.runtime.distributed import DDP_BACKEND_ENV, ddp_backend_kwargs

    two = {"WORLD_SIZE": "2"}
    assert ddp_backend_kwargs(two) == {} and ddp_backend_kwargs({**two, DDP_BACKEND_ENV: ""}) == {}
    assert ddp_backend_kwargs({**two, DDP_BACKEND_ENV: "Gloo"}) == {"backend": "gloo"}
    # one process: no process group, whatever the variable says (accelerate would expect one if given a backend)
    assert ddp_backend_kwargs({DDP_BACKEND_ENV: "gloo"}) == {}
    with pytest.raises(ConfigError, match=f"{DDP_BACKEND_ENV}=mpi: expected one of nccl, gloo"):
        ddp_backend_kwargs({DDP_BACKEND_ENV: "mpi"})
    from accelerate.utils import InitProcessGroupKwargs

    # what _build_accelerator hands accelerate: the backend reaches init_process_group only when named
    assert InitProcessGroupKwargs(**ddp_backend_kwargs({**two, DDP_BACKEND_ENV: "gloo"})).to_kwargs()["backend"] == "gloo"
    assert "backend" not in InitProcessGroupKwargs(**ddp_backend_kwargs(two)).to_kwargs()


@pytest.mark.parametrize("requested", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_sharding_device_maps_are_refused_under_ddp(requested):
    with pytest.raises(ConfigError, match=f"device_map: '{requested}' spreads one model over several GPUs"):
        resolve_device_map(requested, DistEnv(0, 0, 2), cuda_available=True)


def test_under_fsdp_nothing_is_placed_by_from_pretrained():
    from praisonai_accel.runtime.distributed import fsdp_requested

    assert fsdp_requested({"ACCELERATE_USE_FSDP": "true"}) and not fsdp_requested({})
    for rank in (0, 1):
        assert resolve_device_map(None, DistEnv(rank, rank, 2), cuda_available=True, sharded=True) is None
    with pytest.raises(ConfigError, match="under FSDP"):
        resolve_device_map("auto", DistEnv(0, 0, 2), True, sharded=True)


def test_single_process_keeps_the_users_device_map():
    single = DistEnv()
    assert resolve_device_map("auto", single, True) == "auto"
    assert resolve_device_map(None, single, True) == {"": 0}
    assert resolve_device_map(None, single, False) is None
    with pytest.raises(ConfigError):
        resolve_device_map({"model": 0}, DistEnv(0, 0, 2), True)


def test_mixed_precision_auto():
    assert resolve_mixed_precision("auto", use_cuda=False, bf16_supported=False) == "no"
    assert resolve_mixed_precision("auto", use_cuda=True, bf16_supported=True) == "bf16"
    assert resolve_mixed_precision("auto", use_cuda=True, bf16_supported=False) == "fp16"
    assert resolve_mixed_precision("fp16", use_cuda=False, bf16_supported=False) == "fp16"


def test_unsloth_flag_is_set_only_under_ddp():
    environ = {}
    mark_unsloth_ddp(DistEnv(), environ)
    assert environ == {}
    mark_unsloth_ddp(DistEnv(0, 0, 2), environ)
    assert environ == {"UNSLOTH_USE_NEW_MODEL": "1"}


def _fake_unsloth(seen: dict):
    """unsloth's dispatch as its 2026 source has it: FastLanguageModel.from_pretrained sets UNSLOTH_USE_NEW_MODEL=0 and
    loads a Llama with FastLlamaModel; FastModel (FastBaseModel) sets it to 1; get_peft_model takes the path the flag
    names, whichever class it is called on."""

    def peft(model, **kwargs):
        path = "FastBaseModel" if os.environ.get("UNSLOTH_USE_NEW_MODEL", "0") == "1" else "FastLlamaModel"
        seen["peft_path"], seen["peft"] = path, kwargs
        return f"peft-model({model} via {path})"

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            os.environ["UNSLOTH_USE_NEW_MODEL"] = "0"
            seen["from_pretrained"], seen["load_path"] = kwargs, "FastLlamaModel"
            return "llama", "tokenizer"

        get_peft_model = staticmethod(peft)

    class FastModel:
        @staticmethod
        def from_pretrained(**kwargs):
            os.environ["UNSLOTH_USE_NEW_MODEL"] = "1"
            seen["from_pretrained"], seen["load_path"] = kwargs, "FastBaseModel"
            return "base", "tokenizer"

        get_peft_model = staticmethod(peft)

    return types.SimpleNamespace(FastLanguageModel=FastLanguageModel, FastModel=FastModel)


@pytest.fixture(autouse=True)
def _settled_templates(monkeypatch):
    """The fake unsloth hands back the text 'tokenizer'; its chat template is settled like any other (recorded)."""
    settled = []
    monkeypatch.setattr(model_module, "ensure_chat_template", lambda tokenizer, override=None: settled.append(tokenizer))
    return settled


@pytest.mark.parametrize("world_size, path", [(2, "FastBaseModel"), (1, "FastLlamaModel")])
def test_unsloth_loads_and_builds_the_peft_model_on_one_path(monkeypatch, world_size, path, _settled_templates):
    """Under DDP, loading and get_peft_model both go through FastModel (FastBaseModel); on one process both through
    FastLanguageModel (FastLlamaModel). Setting the flag back to 1 after FastLanguageModel loaded, as this project did,
    gave a FastLlamaModel model FastBaseModel's PEFT path."""
    seen: dict = {}
    monkeypatch.delenv("UNSLOTH_USE_NEW_MODEL", raising=False)
    monkeypatch.setitem(sys.modules, "unsloth", _fake_unsloth(seen))

    def import_unsloth():
        seen["flag_at_import"] = os.environ.get("UNSLOTH_USE_NEW_MODEL")
        return sys.modules["unsloth"], ""

    monkeypatch.setattr(model_module, "import_unsloth", import_unsloth)
    config = parse_config({"model_name": "m", "dataset": "d", "lora_r": 4})
    env = DistEnv(rank=world_size - 1, local_rank=world_size - 1, world_size=world_size)
    backend = model_module.choose_backend(config, env, use_cuda=True, inputs=TEXT)  # "m": a text model on the Hub
    assert backend.name == "unsloth" and seen["flag_at_import"] == ("1" if world_size > 1 else None)
    model, tokenizer = model_module.load_model_and_tokenizer(config, env, backend, use_cuda=True, bf16_supported=True,
                                                            inputs=TEXT)
    assert seen["load_path"] == seen["peft_path"] == path and tokenizer == "tokenizer"
    assert _settled_templates == ["tokenizer"]  # unsloth's tokenizer gets the run's chat template too
    assert model == f"peft-model({'base' if world_size > 1 else 'llama'} via {path})"
    assert seen["from_pretrained"]["device_map"] == ({"": 1} if world_size > 1 else {"": 0})
    assert seen["peft"]["r"] == 4 and seen["peft"]["random_state"] == config.seed


def test_unsloth_import_failure_of_any_kind_falls_back(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "unsloth":
            raise NotImplementedError("Unsloth cannot find any torch accelerator? You need a GPU.")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "unsloth", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    module, why = model_module.import_unsloth()
    assert module is None and why.startswith("NotImplementedError")
    config = parse_config({"model_name": "m", "dataset": "d"})
    assert model_module.choose_backend(config, DistEnv(), use_cuda=True, inputs=TEXT).name == "transformers"
    with pytest.raises(ConfigError, match="use_unsloth: true, but unsloth cannot be imported"):
        model_module.choose_backend(parse_config({"model_name": "m", "dataset": "d", "use_unsloth": True}), DistEnv(),
                                    True, TEXT)


def test_unsloth_is_not_used_without_a_gpu():
    config = parse_config({"model_name": "m", "dataset": "d"})
    assert model_module.choose_backend(config, DistEnv(0, 0, 2), use_cuda=False, inputs=TEXT).name == "transformers"
    with pytest.raises(ConfigError, match="use_unsloth: true needs a CUDA GPU"):
        model_module.choose_backend(parse_config({"model_name": "m", "dataset": "d", "use_unsloth": True}), DistEnv(),
                                    False, TEXT)


@pytest.mark.parametrize("capability, precision, dtype", [((7, 5), "fp16", "float16"), ((7, 0), "fp16", "float16"),
                                                         ((8, 0), "bf16", "bfloat16"), ((9, 0), "bf16", "bfloat16")])
def test_bf16_only_from_compute_capability_8_and_every_dtype_agrees(monkeypatch, capability, precision, dtype):
    """A T4 (7.5) or V100 (7.0) emulates bf16, and torch.cuda.is_bf16_supported() says yes there; only native bf16
    counts. Autocast, the model's weights and unsloth's dtype then all follow from the same answer."""
    import torch

    from praisonai_accel.runtime.distributed import gpu_has_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",  # as torch answers: emulation counts unless excluded
                        lambda including_emulation=True: including_emulation or capability >= (8, 0))
    bf16 = gpu_has_bf16()
    assert bf16 == (capability >= (8, 0))
    assert resolve_mixed_precision("auto", use_cuda=True, bf16_supported=bf16) == precision
    lora = parse_config({"model_name": "m", "dataset": "d"})
    assert model_module.resolve_torch_dtype(lora, use_cuda=True, bf16_supported=bf16) == getattr(torch, dtype)
    seen: dict = {}
    monkeypatch.setitem(sys.modules, "unsloth", _fake_unsloth(seen))
    backend = model_module.Backend("unsloth", module=sys.modules["unsloth"])
    model_module.load_model_and_tokenizer(lora, DistEnv(), backend, use_cuda=True, bf16_supported=bf16, inputs=TEXT)
    assert seen["from_pretrained"]["dtype"] == getattr(torch, dtype)


def test_packing_is_turned_off_under_unsloth_with_one_warning(caplog):
    from praisonai_accel.models.loading import Backend
    from praisonai_accel.worker.inputs import packing_for

    config = parse_config({"model_name": "m", "dataset": "d", "packing": True})
    with caplog.at_level("WARNING", logger="praisonai_accel"):
        assert packing_for(config, Backend("transformers")) is True and not caplog.records
        assert packing_for(config, Backend("unsloth")) is False
    assert [r.getMessage() for r in caplog.records] == [
        "warning: packing: off under unsloth, which would let packed examples attend to each other; "
        "set use_unsloth: false to pack"]
    assert packing_for(parse_config({"model_name": "m", "dataset": "d"}), Backend("unsloth")) is False


def test_dependency_floors_cover_what_the_code_needs_and_what_is_tested():
    """from_pretrained(dtype=) needs transformers 4.56, packing's position-id detection 4.54, FSDP2 accelerate 1.6 and
    torch 2.6; the versions this suite runs with must satisfy every floor."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    requirements = {r.name: r for r in map(Requirement, pyproject["project"]["dependencies"])}
    floor = lambda name: min(Version(s.version) for s in requirements[name].specifier if s.operator == ">=")
    assert floor("transformers") >= Version("4.56") and floor("accelerate") >= Version("1.6")
    assert floor("torch") >= Version("2.6")
    for name, requirement in requirements.items():
        assert requirement.specifier.contains(version(name).split("+")[0], prereleases=True), (name, version(name))
