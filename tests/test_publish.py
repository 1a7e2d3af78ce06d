"""Hub pushes, Ollama, merge and generate, against local HTTP servers and real training runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from praisonai_accel.config import parse_config
from praisonai_accel.hub import HubPublisher, model_card
from praisonai_accel.ollama_publish import go_template, recipe_for, stop_tokens

from conftest import cli, cpu_env, load_adapter, read_summary, write_config
from fake_servers import FakeHub, FakeOllama

TOKEN = "hf_TESTsecretTOKEN0123456789"
TWO = ("--cpu", "--num-processes", "2")


def hub_env(hub: FakeHub, token: str | None = TOKEN, **extra) -> dict:
    env = cpu_env(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", **extra)
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return env


def files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, alpaca_file) -> Path:
    """A real adapter whose LoRA B weights are not zero."""
    directory = tmp_path_factory.mktemp("trained")
    config = write_config(directory, tiny_model, alpaca_file, max_steps=8, learning_rate=1e-2)
    result = cli("train", str(config))
    assert result.returncode == 0, result.stderr[-2000:]
    return directory / "out" / "lora_model"


def test_two_process_run_pushes_once_from_rank_0_and_creates_the_ollama_model(tmp_path, tiny_model, alpaca_file):
    with FakeHub() as hub, FakeOllama() as ollama:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, push_to_hub=True,
                              hub_model_id="me/tiny-lora", ollama_model="tiny-lora:test")
        result = cli("train", str(config), *TWO, env=hub_env(hub, OLLAMA_HOST=ollama.url))
        assert result.returncode == 0, result.stderr[-3000:]
        creates, commits = hub.of_kind("create"), hub.of_kind("commit")
        assert len(creates) == 1 and creates[0]["visibility"] == "private"
        assert len(commits) == 1 and commits[0]["repo"] == "me/tiny-lora"
        assert all("rank/0" in r["agent"] for r in creates + commits)
        assert commits[0]["auth"] == f"Bearer {TOKEN}"
        pushed = commits[0]["files"]
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= set(pushed)
        local = tmp_path / "out" / "lora_model"
        assert pushed["adapter_model.safetensors"] == (local / "adapter_model.safetensors").read_bytes()
        card = pushed["README.md"].decode()
        summary = read_summary(tmp_path / "out")
        assert f"base_model: {tiny_model}" in card and str(alpaca_file) in card
        assert "| learning_rate | 0.005 |" in card and f"| final training loss | {summary['final_loss']:.4f} |" in card
        assert len(ollama.creates()) == 1
        assert ollama.creates()[0]["model"] == "tiny-lora:test"
    assert TOKEN not in result.stdout + result.stderr
    assert files_containing(tmp_path, TOKEN) == []


def test_rejected_push_keeps_local_files_and_says_so(tmp_path, tiny_model, alpaca_file):
    with FakeHub(reject_with=401) as hub:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=3, push_to_hub=True, hub_model_id="me/x",
                              save_steps=3)
        result = cli("train", str(config), *TWO, env=hub_env(hub))
    assert result.returncode != 0
    assert "error: push to me/x failed (End of training)" in result.stderr and "401" in result.stderr
    assert "the trained model is safe in" in result.stderr
    adapter = load_adapter(tmp_path / "out" / "lora_model")
    assert adapter and (tmp_path / "out" / "checkpoint-3" / "COMPLETE").exists()
    assert TOKEN not in result.stdout + result.stderr and files_containing(tmp_path, TOKEN) == []


def test_missing_token_pushes_nothing_and_fails_after_training(tmp_path, tiny_model, alpaca_file):
    with FakeHub() as hub:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, push_to_hub=True, hub_model_id="me/x")
        result = cli("train", str(config), env=hub_env(hub, token=None))
        assert hub.of_kind("commit") == [] and hub.of_kind("create") == []
    assert result.returncode == 4
    assert "HF_TOKEN is not set in the environment; nothing was pushed" in result.stderr
    assert (tmp_path / "out" / "lora_model" / "adapter_model.safetensors").is_file()


def test_all_checkpoints_strategy_pushes_each_checkpoint_in_order(tmp_path, tiny_model, alpaca_file):
    with FakeHub() as hub:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2, save_total_limit=1,
                              push_to_hub=True, hub_model_id="me/x", hub_strategy="all_checkpoints")
        result = cli("train", str(config), *TWO, env=hub_env(hub))
        assert result.returncode == 0, result.stderr[-3000:]
        commits = hub.of_kind("commit")
    assert [c["summary"] for c in commits] == ["Checkpoint checkpoint-2", "Checkpoint checkpoint-4", "End of training"]
    # checkpoint-2 was rotated away locally right after it was saved, yet was pushed whole.
    assert "checkpoint-2/COMPLETE" in commits[0]["files"] and "checkpoint-2/optimizer.bin" in commits[0]["files"]
    assert not (tmp_path / "out" / "checkpoint-2").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".push-")]  # snapshots cleaned up


def test_checkpoint_strategy_keeps_one_last_checkpoint_folder(tmp_path, tiny_model, alpaca_file):
    with FakeHub() as hub:
        hub.files["last-checkpoint/stale-from-an-older-run.bin"] = 1
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2, push_to_hub=True,
                              hub_model_id="me/x", hub_strategy="checkpoint")
        result = cli("train", str(config), *TWO, env=hub_env(hub))
        assert result.returncode == 0, result.stderr[-3000:]
        commits, files = hub.of_kind("commit"), hub.files
    assert [c["summary"] for c in commits] == ["Checkpoint checkpoint-2", "Checkpoint checkpoint-4", "End of training"]
    # last-checkpoint/ is replaced whole: what the new checkpoint lacks is deleted, the rest overwritten
    assert commits[0]["deletes"] == ["last-checkpoint/stale-from-an-older-run.bin"]
    state = json.loads(commits[1]["files"]["last-checkpoint/praisonai_state.json"])
    assert state["global_step"] == 4
    assert "adapter_model.safetensors" in files and "last-checkpoint/COMPLETE" in files
    assert not any("stale" in path for path in files)


@pytest.mark.parametrize("strategy,expected", [
    ("end", []),
    ("every_save", [("adapter", "")]),
    ("checkpoint", [("checkpoint-6", "last-checkpoint")]),
    ("all_checkpoints", [("checkpoint-6", "checkpoint-6")]),
])
def test_hub_strategy_decides_what_each_save_pushes(tmp_path, monkeypatch, strategy, expected):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    config = parse_config({"model_name": "m", "dataset": "d", "push_to_hub": True, "hub_model_id": "me/x",
                           "hub_strategy": strategy, "output_dir": str(tmp_path / "out")})
    calls = []

    class Api:
        def create_repo(self, repo_id, private, exist_ok):
            calls.append(("create", repo_id, private))

        def upload_folder(self, repo_id, folder_path, path_in_repo, commit_message, ignore_patterns, delete_patterns):
            calls.append((Path(folder_path).name, path_in_repo or "", delete_patterns))

    checkpoint = tmp_path / "checkpoint-6"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "adapter" / "adapter_config.json").write_text("{}")
    (checkpoint / "COMPLETE").write_text("6")
    publisher = HubPublisher(config, api=Api())
    publisher.on_checkpoint(checkpoint)
    assert publisher.wait() == []
    uploads = [(name, where) for name, where, *_ in calls if name != "create"]
    assert uploads == expected
    # last-checkpoint/ is replaced whole: stale files of an older checkpoint go (patterns are relative to it)
    assert [c[2] for c in calls if c[0] != "create"] == (
        [["*"]] if strategy == "checkpoint" else [None] * len(expected))
    assert all(p.exists() for p in checkpoint.rglob("*"))  # pushing never touches the local folder


def test_model_card_records_the_run():
    config = parse_config({"model_name": "org/base", "dataset": [{"name": "yahma/alpaca-cleaned"}], "hub_model_id": "me/x",
                           "learning_rate": 1e-4, "lora_r": 8})
    card = model_card(config, {"final_loss": 1.23456, "global_step": 10, "num_processes": 2})
    assert card.startswith("---\nbase_model: org/base\nlibrary_name: peft\n")
    assert "datasets:\n- yahma/alpaca-cleaned" in card and "| final training loss | 1.2346 |" in card
    assert "| effective batch | 4 |" in card and "| lora_r | 8 |" in card


def test_modelfile_for_the_tiny_chatml_model(trained, tiny_model):
    recipe = recipe_for(trained)
    assert recipe.modelfile() == (
        f"FROM {tiny_model.resolve()}\n"
        f"ADAPTER {trained.resolve()}\n"
        'TEMPLATE """{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
        "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
        '<|im_start|>assistant\n{{ .Response }}<|im_end|>"""\n'
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "<|im_start|>"\n'
    )
    assert set(recipe.adapter_files) == {"adapter_model.safetensors", "adapter_config.json"}
    assert "model.safetensors" in recipe.files and "tokenizer.json" in recipe.files


def test_go_template_for_a_llama3_style_template():
    class Tok:
        eos_token, pad_token, bos_token = "<|eot_id|>", None, "<|begin_of_text|>"
        all_special_tokens = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
        added_tokens_decoder = {}

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            from jinja2 import Template

            return Template(
                "{{ '<|begin_of_text|>' }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
            ).render(messages=messages, add_generation_prompt=add_generation_prompt)

    template = go_template(Tok())
    assert template == (
        "{{ if .System }}<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>"
        "{{ else }}<|begin_of_text|>{{ end }}"
        "{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>"
    )
    assert stop_tokens(Tok(), template) == ["<|eot_id|>", "<|end_header_id|>", "<|start_header_id|>"]


def test_publish_ollama_command_uploads_blobs_and_creates(trained, tiny_model):
    with FakeOllama() as ollama:
        result = cli("publish", "ollama", str(trained), "--name", "tiny:test", "--host", ollama.url)
        assert result.returncode == 0, result.stderr[-2000:]
        (create,) = ollama.creates()
    digest = lambda p: "sha256:" + hashlib.sha256(Path(p).read_bytes()).hexdigest()
    assert create["model"] == "tiny:test" and "from" not in create
    assert create["files"]["model.safetensors"] == digest(tiny_model / "model.safetensors")
    assert create["adapters"] == {"adapter_model.safetensors": digest(trained / "adapter_model.safetensors"),
                                  "adapter_config.json": digest(trained / "adapter_config.json")}
    assert create["parameters"]["stop"] == ["<|im_end|>", "<|im_start|>"]
    assert "{{ .Prompt }}" in create["template"]
    assert (trained / "Modelfile").read_text().startswith(f"FROM {tiny_model.resolve()}")


def test_publish_ollama_from_an_ollama_model_uploads_only_the_adapter(trained):
    with FakeOllama() as ollama:
        result = cli("publish", "ollama", str(trained), "--name", "t:1", "--from", "llama3.2:1b", "--push", "--host", ollama.url)
        assert result.returncode == 0, result.stderr[-2000:]
        (create,) = ollama.creates()
        assert create["from"] == "llama3.2:1b" and "files" not in create and len(create["adapters"]) == 2
        assert [r["model"] for r in ollama.requests if r.get("kind") == "push"] == ["t:1"]


def test_ollama_down_is_one_line(trained):
    result = cli("publish", "ollama", str(trained), "--name", "t:1", "--host", "http://127.0.0.1:9")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: ollama:") and "Traceback" not in result.stderr


def test_merge_gives_the_same_logits_as_base_plus_adapter(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert any(v.abs().max() > 0 for k, v in load_adapter(trained).items() if "lora_B" in k)
    result = cli("merge", str(trained.parent), "--to", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()
    config = json.loads((trained / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with_adapter = PeftModel.from_pretrained(base, str(trained)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (expected - got).abs().max().item() <= 1e-5
    again = cli("merge", str(trained), "--to", str(tmp_path / "merged"))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_generate_and_chat_answer_with_the_trained_model(trained):
    from praisonai_accel.inference import generate, load_for_inference

    result = cli("generate", str(trained), "-p", "add 2 and 3", "-p", "repeat the words", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    model, tokenizer = load_for_inference(trained, device="cpu")
    expected = [generate(model, tokenizer, [{"role": "user", "content": p}], 8).replace("\n", " ")
                for p in ("add 2 and 3", "repeat the words")]
    assert result.stdout.splitlines() == expected
    chat = subprocess.run([sys.executable, "-m", "praisonai_accel", "chat", str(trained), "--max-new-tokens", "8"],
                          input="add 2 and 3\n\n", capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert chat.returncode == 0 and chat.stdout.splitlines() == expected[:1]
    missing = cli("generate", str(trained.parent / "nope"), "-p", "x")
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_go_template_keeps_a_default_system_prompt_when_none_is_given():
    from jinja2 import Template

    class Tok:
        eos_token, pad_token, bos_token = "<|im_end|>", None, None
        all_special_tokens, added_tokens_decoder = ["<|im_end|>", "<|im_start|>"], {}

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return Template(
                "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            ).render(messages=messages, add_generation_prompt=add_generation_prompt)

    assert go_template(Tok()) == (
        "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n"
        "{{ else }}<|im_start|>system\nYou are helpful.<|im_end|>\n{{ end }}"
        "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
        "<|im_start|>assistant\n{{ .Response }}<|im_end|>"
    )
