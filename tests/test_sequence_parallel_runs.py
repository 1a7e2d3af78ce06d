"""Sequence parallelism and tiled MLP in real runs of `praisonai-accel train`: 2 processes sharing every row give
1 process's loss trajectory, eval losses and adapter (packing on and off; DDP, and FSDP2 with --fsdp), a rank
killed mid-run resumes exactly, tiled MLP leaves the loss as it is, and what cannot be split is refused before
launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import cli, cpu_env, read_metrics, read_summary, write_config
from test_checkpoint import assert_same_run, wait_for_step
from test_multinode import _environ
from test_training import _workers_of, workers_left

TWO = ("--cpu", "--num-processes", "2")
# fp32 on CPU, no dropout (a rank draws masks for its slice only), loss every step, an evaluation every 4 steps
# (split over the group too); the tiny Llama's 4 query heads over 2 KV heads split over 2 ranks.
RUN = dict(max_steps=8, per_device_train_batch_size=2, logging_steps=1, max_seq_length=64, lora_dropout=0.0,
           warmup_steps=2, val_split_ratio=0.1, eval_strategy="steps", eval_steps=4)


def eval_losses(output_dir) -> list[tuple[int, float]]:
    return [(m["step"], m["eval_loss"]) for m in read_metrics(output_dir) if "eval_loss" in m]


def train(directory, tiny_model, alpaca_file, *flags, **overrides):
    config = write_config(directory, tiny_model, alpaca_file, **{**RUN, **overrides})
    result = cli("train", str(config), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "out", result


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, alpaca_file):
    """runs(packing) -> (1 process on whole rows, 2 processes with sequence_parallel_size 2), each run once."""
    found = {}

    def pair(packing: bool):
        if packing not in found:
            one, _ = train(tmp_path_factory.mktemp("one"), tiny_model, alpaca_file, packing=packing)
            two, result = train(tmp_path_factory.mktemp("sp"), tiny_model, alpaca_file, *TWO, packing=packing,
                                sequence_parallel_size=2)
            assert "effective batch 2 x 1 x 1 = 2" in result.stderr  # one group of 2 ranks reads one stream of rows
            found[packing] = one, two
        return found[packing]

    return pair


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_ranks_sharing_every_row_train_like_one_process(runs, packing):
    one, two = runs(packing)
    assert_same_run(two, one, tol=1e-5)
    evals = eval_losses(one), eval_losses(two)
    assert [s for s, _ in evals[0]] == [s for s, _ in evals[1]] == [4, 8]
    assert max(abs(a - b) for (_, a), (_, b) in zip(*evals)) <= 1e-5
    rank1 = (two / "logs" / "rank-1.log").read_text()
    assert "this rank holds slice 2 of 2" in rank1


def test_fsdp_shards_the_model_over_the_ranks_that_share_every_row(tmp_path, tiny_model, alpaca_file, runs):
    """--fsdp: both ranks hold half the parameters and half of every row; still 1 process's run."""
    out, _ = train(tmp_path, tiny_model, alpaca_file, *TWO, "--fsdp", packing=True, sequence_parallel_size=2)
    one = runs(True)[0]
    assert_same_run(out, one, tol=1e-5)
    summary = read_summary(out)
    assert summary["distributed_type"] == "FSDP" and summary["weights_in_sync"]
    assert [m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m] == pytest.approx(
        [m["eval_loss"] for m in read_metrics(one) if "eval_loss" in m], abs=1e-5)


def test_a_killed_rank_resumes_exactly(tmp_path, tiny_model, alpaca_file, runs):
    """Rank 1 of the sequence-parallel group is SIGKILLed after step 4 (checkpoints every step); the same command
    again resumes and ends with the uninterrupted run's losses and adapter."""
    config = write_config(tmp_path, tiny_model, alpaca_file, **RUN, packing=True, sequence_parallel_size=2,
                          save_steps=1)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "praisonai_accel", "train", str(config), *TWO], env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out, 4, proc)
        rank1 = [pid for pid in _workers_of(config) if "\0RANK=1\0" in _environ(pid)]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "rank 1 was killed (SIGKILL)" in stderr, stderr[-3000:]
    assert not (out / "train_summary.json").exists() and not workers_left(config)
    result = cli("train", str(config), *TWO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert_same_run(out, runs(True)[1], tol=0)


def test_tiled_mlp_trains_like_the_plain_mlp(tmp_path, tiny_model, alpaca_file, runs):
    """Tiles of 16 tokens (a 2 x 64-token batch: 8 tiles), one process."""
    tiled, result = train(tmp_path, tiny_model, alpaca_file, packing=False, tiled_mlp=True, tiled_mlp_shards=8)
    assert "tiled MLP: 2 decoder MLP(s) over 8 tiles" in result.stderr + (tiled / "logs" / "rank-0.log").read_text()
    assert_same_run(tiled, runs(False)[0], tol=1e-5)


@pytest.mark.parametrize("size, processes, says", [
    (3, 3, "sequence_parallel_size: 3 does not divide the model's 4 attention heads; use one of 1, 2, 4"),
    (2, 3, "sequence_parallel_size: 2 does not divide the 3 processes"),
], ids=["heads", "processes"])
def test_what_cannot_be_split_is_refused_before_launch(tmp_path, tiny_model, alpaca_file, size, processes, says):
    config = write_config(tmp_path, tiny_model, alpaca_file, sequence_parallel_size=size)
    result = cli("train", str(config), "--cpu", "--num-processes", str(processes))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: {says}"), result.stderr
    assert "launching" not in result.stderr and not (tmp_path / "out" / "logs").exists()


def test_a_preference_method_is_refused_before_launch(tmp_path, tiny_model):
    import json

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}) + "\n")
    config = write_config(tmp_path, tiny_model, data, method="dpo", sequence_parallel_size=2,
                          dataset=[{"name": str(data)}])
    result = cli("train", str(config), *TWO)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: sequence_parallel_size: method: dpo does not split its rows over ranks; "
                                     "use sequence_parallel_size: 1 (or method: sft)"), result.stderr
