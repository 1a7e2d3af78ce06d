"""Shared fixtures: a tiny random Llama built locally, small JSONL data, and helpers to run real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# No test may reach the Hub; a Hub id then fails at once instead of after ~48 s of retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HOME", str(Path(__file__).resolve().parent.parent / ".pytest_hf_home"))
# `pytest -n 2` runs two tests at once, most of them launching processes of their own: torch's default of one thread
# per core in every process oversubscribed the 2 cores, and OpenMP's spinning threads wasted about a third of the CPU
# (two agent demos side by side: 165 s, 110 s with one thread each). Set before torch is imported, here and in every
# process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from praisonai_accel.demo.text import demo_config, demo_records, make_tiny_model, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PHI3 = REPO.parent / "shared" / "fixtures" / "phi-3-mini"
BNB_DIR = REPO / ".bnb"  # bitsandbytes installed on its own (.ci/run), so only the tests that need it import it


@pytest.fixture(scope="session")
def phi3_tokenizer():
    if not PHI3.is_dir():
        pytest.skip("../shared/fixtures/phi-3-mini is absent")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PHI3))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def alpaca_file(tmp_path_factory) -> Path:
    return write_jsonl(demo_records(64), tmp_path_factory.mktemp("data") / "alpaca.jsonl")


_SHARED_PREPARED: list[Path] = []


def _logging_state(log):
    import logging

    return (list(log.handlers), log.propagate, log.level, log.disabled, logging.root.manager.disable)


@pytest.fixture(autouse=True)
def _restore_our_logger():
    """A command run in process (CliRunner) gives the praisonai_accel logger a stderr handler and stops it
    propagating (logs.show_progress_lines), and lm-eval gives its logger a handler on the stderr of the moment: put
    them back, or a later test's caplog sees nothing and a handler writes to a stream pytest has closed."""
    import logging

    logs = [logging.getLogger(name) for name in ("praisonai_accel", "lm_eval")]
    saved = [_logging_state(log) for log in logs]
    yield
    for log, state in zip(logs, saved):
        log.handlers[:], log.propagate, log.level, log.disabled = state[:4]
    logging.disable(saved[0][4])
    # any other logger a library pointed at a stream pytest has since closed: its next record would print
    # "--- Logging error ---" into a later test's output
    for log in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(log, logging.Logger):
            log.handlers[:] = [h for h in log.handlers if not (isinstance(h, logging.StreamHandler)
                                                               and getattr(h.stream, "closed", False))]


@pytest.fixture(scope="session", autouse=True)
def shared_preprocessing_cache(tmp_path_factory) -> Path:
    """One dataset_prepared_path for the session: runs that tokenize the same data the same way (most of them)
    read one cache entry instead of each importing `datasets` and tokenizing again."""
    _SHARED_PREPARED[:] = [tmp_path_factory.mktemp("prepared")]
    return _SHARED_PREPARED[0]


def write_config(directory: Path, model: Path, data: Path, **overrides) -> Path:
    """dataset_prepared_path=None keeps the default cache, inside output_dir. No loss plot unless asked for (its
    matplotlib import and drawing would add about a second to every run; the tracker test draws one)."""
    overrides.setdefault("plot_loss", False)
    overrides.setdefault("dataset_prepared_path", str(_SHARED_PREPARED[0]) if _SHARED_PREPARED else None)
    if overrides["dataset_prepared_path"] is None:
        del overrides["dataset_prepared_path"]
    raw = demo_config(model, data, directory / "out", **overrides)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def screen_of(text: str) -> list[str]:
    """The lines a terminal shows for `text`: a carriage return goes back to column 0 and overwrites, ESC[2K erases
    the line, a newline moves down."""
    lines, line, column = [], [], 0
    for token in re.findall(r"\x1b\[2K|\r|\n|[^\r\n\x1b]+", text):
        if token == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        elif token == "\r":
            column = 0
        elif token == "\x1b[2K":
            line = []
        else:
            line[column:column + len(token)] = list(token)
            column += len(token)
    return lines + (["".join(line).rstrip()] if line else [])


def cpu_env(**extra) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **extra}
    return env


FAULTS = Path(__file__).resolve().parent / "faults"  # a sitecustomize that injects crashes; tests only


def crash_env(where: str, env: dict | None = None) -> dict:
    """The environment of a run whose rank 0 dies inside a save (see tests/faults/sitecustomize.py)."""
    return fault_env(env, CRASH_IN_SAVE=where)


def fault_env(env: dict | None = None, **faults: str) -> dict:
    """The environment of a run with faults injected (PRAISONAI_ACCEL_TEST_<NAME>, see tests/faults/sitecustomize.py)."""
    env = dict(env or cpu_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH", "")) if p)
    env.update({f"PRAISONAI_ACCEL_TEST_{name}": value for name, value in faults.items()})
    return env


def run(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=kwargs.pop("env", cpu_env()), **kwargs)


def cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "praisonai_accel", *args], timeout=timeout, **kwargs)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "train_summary.json").read_text())


def load_adapter(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def make_architecture(directory: Path, kind: str) -> Path:
    """A tiny random-weight model of a real architecture, with the demo tokenizer: Qwen3-MoE, or Gemma 3 with its
    vision tower (multimodal; trained here on text only)."""
    import torch
    import transformers as tf

    from praisonai_accel.demo.text import _train_tokenizer

    texts = []
    for r in demo_records(512, 0):
        texts += [r["instruction"], r["input"] or "", r["output"], "user", "assistant", "system"]
    tokenizer = _train_tokenizer(texts, vocab_size=320)
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**text, moe_intermediate_size=32, num_experts=4,
                                                         num_experts_per_tok=2, decoder_sparse_step=1))
    else:
        config = tf.Gemma3Config(
            text_config=tf.Gemma3TextConfig(**text, sliding_window=16),
            vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_id=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        model = tf.Gemma3ForConditionalGeneration(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


# The modules with the most real training runs, slowest first. `pytest -n 2 --dist loadfile` hands whole modules
# to the two workers in collection order; starting with the longest ones lets both workers finish together.
SLOWEST_MODULES = ["test_grpo_tools.py", "test_gguf.py", "test_checkpoint.py", "test_grpo_runs.py", "test_reward_runs.py",
                   "test_preference_runs.py", "test_training.py", "test_multinode.py",
                   "test_sequence_parallel_runs.py", "test_fsdp.py", "test_run_failures.py",
                   "test_user_experience.py", "test_features.py", "test_serve.py", "test_launch.py", "test_qlora.py",
                   "test_publish.py", "test_eval.py", "test_data_rows.py", "test_vision_runs.py", "test_security.py",
                   "test_offload_embedding.py", "test_eval_training.py", "test_run_safety.py", "test_vision_demo.py",
                   "test_method_registry.py", "test_preference_ddp.py", "test_grpo.py", "test_vision_publish.py",
                   "test_eval_endpoint.py", "test_eval_rewards.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: position for position, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order
