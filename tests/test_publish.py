"""Hub pushes, Ollama, merge and generate, against local HTTP servers and real training runs."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from praisonai_accel.config import parse_config
from praisonai_accel.data.vision_processor import ModelInputs
from praisonai_accel.publish.hub import HubPublisher, model_card
from praisonai_accel.publish.ollama import recipe_for

from conftest import cli, cpu_env, load_adapter, read_metrics, read_summary, write_config
from fake_servers import FakeHub, FakeOllama

TOKEN = "hf_TESTsecretTOKEN0123456789"
TWO = ("--cpu", "--num-processes", "2")


def hub_env(hub: FakeHub, token: str | None = TOKEN, **extra) -> dict:
    env = cpu_env(HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", **extra)  # binaries take the LFS path
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


def test_two_process_run_pushes_from_rank_0_alone_in_the_background_and_creates_the_ollama_model(tmp_path, tiny_model,
                                                                                                  alpaca_file):
    """every_save with a Hub whose commits take 3 s: one repo, one commit per save and one at the end, all from rank 0,
    none delaying a step or rank 1's exit; then the Ollama model, once."""
    with FakeHub(token=TOKEN, delay=3.0) as hub, FakeOllama() as ollama:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=6, save_steps=2, logging_steps=1,
                              push_to_hub=True, hub_model_id="me/tiny-lora", hub_strategy="every_save",
                              ollama_model="tiny-lora:test")
        result = cli("train", str(config), *TWO, env=hub_env(hub, OLLAMA_HOST=ollama.url))
        assert result.returncode == 0, result.stderr[-3000:]
        creates, commits = hub.of_kind("create"), hub.of_kind("commit")
        assert len(creates) == 1 and creates[0]["visibility"] == "private"
        assert len(commits) == 4 and all(c["repo"] == "me/tiny-lora" for c in commits)  # three saves and the end
        assert all("rank/0" in r["agent"] for r in creates + commits)
        assert all(c["auth"] == f"Bearer {TOKEN}" for c in commits)
        pushed = commits[-1]["files"]
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= set(pushed)
        local = tmp_path / "out" / "lora_model"
        assert pushed["adapter_model.safetensors"] == (local / "adapter_model.safetensors").read_bytes()
        card = pushed["README.md"].decode()
        summary = read_summary(tmp_path / "out")
        assert "base_model:" not in card and str(tiny_model) not in card  # a local model: no path of this machine
        assert f"| datasets | {alpaca_file.name} |" in card and str(alpaca_file) not in card
        assert "| learning_rate | 0.005 |" in card and f"| final training loss | {summary['final_loss']:.4f} |" in card
        assert len(ollama.creates()) == 1
        assert ollama.creates()[0]["model"] == "tiny-lora:test"
    steps = [m for m in read_metrics(tmp_path / "out") if "loss" in m]
    assert max(m["step_seconds"] for m in steps) < 2.0  # a synchronous push would add 3 s to steps 3, 5...
    assert steps[-1]["time"] < commits[1]["finished"]  # training was over before the second push had landed
    done = [line for line in (tmp_path / "out" / "logs" / "rank-1.log").read_text().splitlines() if "rank 1 done" in line]
    rank1_exit = datetime.strptime(done[-1][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert rank1_exit < commits[-1]["finished"] - 2  # rank 1 left long before rank 0's last push finished
    assert TOKEN not in result.stdout + result.stderr
    assert files_containing(tmp_path, TOKEN) == []


def test_a_login_token_is_used_and_a_rejected_push_and_failed_ollama_create_exit_4(tmp_path, tiny_model, alpaca_file):
    """No HF_TOKEN: the token saved by `hf auth login` (HF_TOKEN_PATH) is the one sent. The Hub then refuses the
    commit and Ollama is down: both are one line after training, exit code 4, and the local files are intact."""
    token_file = tmp_path / "hf-token"
    token_file.write_text(TOKEN)
    with FakeHub(token=TOKEN, reject_with=401) as hub:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=3, push_to_hub=True, hub_model_id="me/x",
                              save_steps=3, ollama_model="tiny:test")
        result = cli("train", str(config), env=hub_env(hub, token=None, HF_TOKEN_PATH=str(token_file),
                                                       OLLAMA_HOST="http://127.0.0.1:9"))
        rejected = [r for r in hub.requests if r.get("rejected") and "/commit/" in r.get("path", "")]
    assert result.returncode == 4, result.stderr[-2000:]
    assert rejected and all(r["auth"] == f"Bearer {TOKEN}" for r in rejected)
    assert "error: push to me/x failed (End of training)" in result.stderr and "401" in result.stderr
    assert "error: ollama: could not create tiny:test" in result.stderr and "the trained model is safe in" in result.stderr
    adapter = load_adapter(tmp_path / "out" / "lora_model")
    assert adapter and (tmp_path / "out" / "checkpoint-3" / "COMPLETE").exists()
    assert TOKEN not in result.stdout + result.stderr and files_containing(tmp_path / "out", TOKEN) == []
    assert json.loads((tmp_path / "out" / "progress.json").read_text())["exit_code"] == 4  # report says so


def test_no_token_or_a_public_repo_for_a_private_push_is_refused_before_launch(tmp_path, tiny_model, alpaca_file):
    with FakeHub(token=TOKEN, repos={"me/public": False, "me/private": True}) as hub:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, push_to_hub=True, hub_model_id="me/x")
        result = cli("train", str(config), env=hub_env(hub, token=None, HF_TOKEN_PATH=str(tmp_path / "none")))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
        assert "push_to_hub: no Hugging Face token; set HF_TOKEN or run `hf auth login`" in result.stderr
        public = write_config(tmp_path, tiny_model, alpaca_file, max_steps=2, push_to_hub=True, hub_model_id="me/public")
        result = cli("train", str(public), env=hub_env(hub))
        assert result.returncode == 2 and "me/public already exists and is public" in result.stderr
        assert hub.of_kind("commit") == [] and hub.of_kind("create") == []
    assert not (tmp_path / "out").exists()  # nothing launched, nothing written


def test_all_checkpoints_strategy_pushes_each_checkpoint_in_order(tmp_path, tiny_model, alpaca_file):
    """The first commit is held until rotation has deleted checkpoint-2 locally: the push still carries it whole,
    from the hard-linked snapshot, with its binaries through LFS."""
    release = threading.Event()
    with FakeHub(token=TOKEN, hold=release) as hub:
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2, save_total_limit=1,
                              push_to_hub=True, hub_model_id="me/x", hub_strategy="all_checkpoints")
        proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config)],
                                env=hub_env(hub), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 180
        while not (tmp_path / "out" / "checkpoint-4" / "COMPLETE").exists() and time.time() < deadline:
            time.sleep(0.1)
        while (tmp_path / "out" / "checkpoint-2").exists() and time.time() < deadline:  # rotation follows COMPLETE
            time.sleep(0.1)
        assert not (tmp_path / "out" / "checkpoint-2").exists(), "rotation had not deleted checkpoint-2 yet"
        release.set()
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-3000:]
        commits = hub.of_kind("commit")
    assert [c["summary"] for c in commits] == ["Checkpoint checkpoint-2", "Checkpoint checkpoint-4", "End of training"]
    first = commits[0]["files"]
    assert "checkpoint-2/COMPLETE" in first and "checkpoint-2/optimizer.bin" in first
    assert json.loads(first["checkpoint-2/praisonai_state.json"])["global_step"] == 2
    assert {"checkpoint-2/model.safetensors", "checkpoint-2/optimizer.bin"} <= set(commits[0]["lfs"])  # binaries via LFS
    assert first["checkpoint-2/model.safetensors"][:8] != b"\0" * 8 and len(first["checkpoint-2/model.safetensors"]) > 1000
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".push-")]  # snapshots cleaned up


def test_the_fake_hub_refuses_a_missing_or_wrong_token_on_every_endpoint(tmp_path, monkeypatch):
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)

    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "model.safetensors").write_bytes(b"x" * 100)
    with FakeHub(token=TOKEN) as hub:
        for token in (None, "hf_wrong"):
            api = HfApi(endpoint=hub.url, token=token or False)
            for call in (lambda: api.create_repo("me/x", exist_ok=True),
                         lambda: api.upload_folder(repo_id="me/x", folder_path=str(tmp_path / "f")),
                         lambda: api.list_repo_files("me/x")):
                with pytest.raises(HfHubHTTPError) as error:
                    call()
                assert error.value.response.status_code == 401
        assert hub.of_kind("create") == hub.of_kind("commit") == [] and all(r.get("rejected") for r in hub.requests)


def test_checkpoint_strategy_keeps_one_last_checkpoint_folder(tmp_path, tiny_model, alpaca_file):
    with FakeHub(token=TOKEN) as hub:
        hub.files["last-checkpoint/stale-from-an-older-run.bin"] = 1
        config = write_config(tmp_path, tiny_model, alpaca_file, max_steps=4, save_steps=2, push_to_hub=True,
                              hub_model_id="me/x", hub_strategy="checkpoint")
        result = cli("train", str(config), env=hub_env(hub))
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
    card = model_card(config, {"final_loss": 1.23456, "global_step": 10, "num_processes": 2}, ModelInputs(False))
    assert card.startswith("---\nbase_model: org/base\nlibrary_name: peft\n")
    assert "datasets:\n- yahma/alpaca-cleaned" in card and "| final training loss | 1.2346 |" in card
    assert "| effective batch | 4 |" in card and "| lora_r | 8 |" in card


def test_model_card_names_no_local_path(tmp_path):
    private = tmp_path / "home" / "alice" / "private"
    private.mkdir(parents=True)
    (private / "chats.jsonl").write_text("{}\n")
    (private / "base-model").mkdir()
    config = parse_config({"model_name": str(private / "base-model"), "hub_model_id": "me/x",
                           "dataset": [{"name": str(private / "chats.jsonl")}, {"name": "yahma/alpaca-cleaned"}]})
    card = model_card(config, {"final_loss": 1.0, "global_step": 1, "num_processes": 1}, ModelInputs(False))
    assert "alice" not in card and str(tmp_path) not in card
    assert "base_model:" not in card and "datasets:\n- yahma/alpaca-cleaned\n---" in card
    assert "| datasets | chats.jsonl, yahma/alpaca-cleaned |" in card and "| base model | base-model |" in card


def test_modelfile_for_the_tiny_chatml_model(trained, tiny_model):
    recipe = recipe_for(trained)
    assert recipe.modelfile() == (
        f"FROM {tiny_model.resolve()}\n"
        f"ADAPTER {trained.resolve()}\n"
        'TEMPLATE """{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ else }}{{ end }}'
        '{{ range .Messages }}{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n<|im_start|>assistant\n'
        '{{ else if eq .Role "assistant" }}{{ .Content }}<|im_end|>\n{{ end }}{{ end }}"""\n'
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "<|im_start|>"\n'
    )
    assert set(recipe.adapter_files) == {"adapter_model.safetensors", "adapter_config.json"}
    assert "model.safetensors" in recipe.files and "tokenizer.json" in recipe.files


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
    assert create["template"] == recipe_for(trained).template and "{{ range .Messages }}" in create["template"]
    assert (trained / "Modelfile").read_text().startswith(f"FROM {tiny_model.resolve()}")


def test_publish_ollama_from_an_ollama_model_uploads_only_the_adapter(trained):
    with FakeOllama() as ollama:
        result = cli("publish", "ollama", str(trained), "--name", "me/t:1", "--from", "llama3.2:1b", "--push", "--host", ollama.url)
        assert result.returncode == 0, result.stderr[-2000:]
        (create,) = ollama.creates()
        assert create["from"] == "llama3.2:1b" and "files" not in create and len(create["adapters"]) == 2
        assert [r["model"] for r in ollama.requests if r.get("kind") == "push"] == ["me/t:1"]
        refused = cli("publish", "ollama", str(trained), "--name", "t:1", "--from", "llama3.2:1b", "--push", "--host", ollama.url)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert refused.returncode == 2 and len(errors) == 1 and "not authorized to push to this namespace" in errors[0]
        assert "Traceback" not in refused.stderr


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
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    refused = cli("merge", str(trained), "--to", str(users))
    assert refused.returncode == 2 and "praisonai-accel did not write" in refused.stderr and "--force" in refused.stderr
    assert [p.name for p in users.iterdir()] == ["notes.txt"]


def test_a_merge_interrupted_while_writing_leaves_no_partial_copy(trained, tmp_path, monkeypatch):
    """Ctrl-C after the merged weights are written but before the tokenizer: neither the target nor the hidden
    directory it was being written in is left (a merged model is the base's size)."""
    from transformers import PreTrainedTokenizerBase

    from praisonai_accel.publish.merge import merge_adapter

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge_adapter(trained, tmp_path / "merged")
    assert list(tmp_path.iterdir()) == []


def test_generate_and_chat_answer_with_the_trained_model(trained):
    result = cli("generate", str(trained), "-p", "add 2 and 3", "-p", "repeat the words", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def greedy(model, tokenizer, prompt: str) -> str:
        """An independent decode: argmax token by token, no generate()."""
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        ids, new = torch.tensor([ids]), []
        with torch.no_grad():
            for _ in range(8):
                token = int(model(input_ids=ids).logits[0, -1].argmax())
                if token == tokenizer.eos_token_id:
                    break
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        return tokenizer.decode(new, skip_special_tokens=True).strip().replace("\n", " ")

    tokenizer = AutoTokenizer.from_pretrained(str(trained))
    base_name = json.loads((trained / "adapter_config.json").read_text())["base_model_name_or_path"]
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_name), str(trained)).eval()
    base = AutoModelForCausalLM.from_pretrained(base_name).eval()
    prompts = ("add 2 and 3", "repeat the words")
    expected = [greedy(tuned, tokenizer, p) for p in prompts]
    assert result.stdout.splitlines() == expected
    assert [greedy(base, tokenizer, p) for p in prompts] != expected  # the adapter is really applied
    chat = subprocess.run([sys.executable, "-m", "praisonai_accel", "chat", str(trained), "--max-new-tokens", "8"],
                          input="add 2 and 3\n\n", capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert chat.returncode == 0 and chat.stdout.splitlines() == expected[:1]
    missing = cli("generate", str(trained.parent / "nope"), "-p", "x")
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_chat_on_a_terminal_ctrl_c_drops_the_reply_under_way_and_ends_at_the_prompt(monkeypatch, capsys):
    """Ctrl-C during a reply: that message and reply are dropped (the next message follows the last whole exchange)
    and the chat goes on; Ctrl-C at the prompt ends it on a line of its own, exit 0, no traceback. Piped, Ctrl-C
    is left as it is (the process stops)."""
    from praisonai_accel.commands import chat
    from praisonai_accel.models import inference

    typed = iter(["first\n", "second\n", "third\n", KeyboardInterrupt])
    seen = []

    class Terminal:
        def isatty(self):
            return True

        def readline(self):
            line = next(typed)
            if line is KeyboardInterrupt:
                raise KeyboardInterrupt
            return line

    def generate(_model, _tokenizer, messages, *_args, **_kwargs):
        seen.append([m["content"] for m in messages])
        if messages[-1]["content"] == "second":
            raise KeyboardInterrupt
        return f"re: {messages[-1]['content']}"

    monkeypatch.setattr(chat, "_load", lambda *_args: (None, None, None))
    monkeypatch.setattr(inference, "generate", generate)
    monkeypatch.setattr(chat.sys, "stdin", Terminal())
    chat.chat_command(Path("run"), system=None, max_new_tokens=8, temperature=0.0, trust_remote_code=False,
                      image=None)
    assert seen == [["first"], ["first", "re: first", "second"], ["first", "re: first", "third"]]
    out = capsys.readouterr().out
    assert out == ("you> model> re: first\nyou> \n(stopped; that message is dropped)\nyou> model> re: third\n"
                   "you> \n")

    typed = iter(["first\n", "second\n"])
    monkeypatch.setattr(chat.sys, "stdin", type("Piped", (Terminal,), {"isatty": lambda self: False})())
    with pytest.raises(KeyboardInterrupt):
        chat.chat_command(Path("run"), system=None, max_new_tokens=8, temperature=0.0, trust_remote_code=False,
                          image=None)


def test_ollama_merges_first_for_architectures_its_converter_cannot_take(tmp_path, alpaca_file):
    """Ollama converts safetensors LoRA adapters only for Llama-family and Gemma 2 bases: a Qwen3-MoE adapter is merged
    and the model created from the merged weights, said in one line."""
    from conftest import make_architecture

    base = make_architecture(tmp_path / "qwen3-moe", "qwen3_moe")
    config = write_config(tmp_path, base, alpaca_file, max_steps=2)
    assert cli("train", str(config)).returncode == 0
    adapter = tmp_path / "out" / "lora_model"
    merged = tmp_path / "out" / "lora_model-merged"
    merged.mkdir()
    (merged / "notes.txt").write_text("mine")  # a folder of the user's where the merge would go: never replaced
    refused = cli("publish", "ollama", str(adapter), "--name", "qwen-moe:test", "--host", "http://127.0.0.1:9")
    assert refused.returncode == 2 and "praisonai-accel did not write" in refused.stderr
    assert [p.name for p in merged.iterdir()] == ["notes.txt"]
    shutil.rmtree(merged)
    with FakeOllama() as ollama:
        result = cli("publish", "ollama", str(adapter), "--name", "qwen-moe:test", "--host", ollama.url)
        assert result.returncode == 0, result.stderr[-2000:]
        (create,) = ollama.creates()
    assert "adapters" not in create and {"config.json", "tokenizer.json", "model.safetensors"} <= set(create["files"])
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    digest = "sha256:" + hashlib.sha256((merged / "model.safetensors").read_bytes()).hexdigest()
    assert create["files"]["model.safetensors"] == digest
    assert "merged the adapter into" in result.stderr and "not Qwen3MoeForCausalLM" in result.stderr
    assert (adapter / "Modelfile").read_text().startswith(f"FROM {merged.resolve()}\n")
