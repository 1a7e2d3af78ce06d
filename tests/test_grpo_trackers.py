"""GRPO's example completions reach the trackers that show a table (TensorBoard's text here; wandb's Table the same
way), besides output_dir/logs/completions.jsonl."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

RECORDS = [{"prompt": [{"role": "user", "content": "reverse: ada | bob"}], "completion": "bob\nada", "reward": 1.0,
            "rewards": {"exact_match": 1.0}},
           {"prompt": "reverse: cy dee", "completion": "cy", "reward": 0.0, "rewards": {"exact_match": 0.0}}]


def test_completions_go_to_tensorboard_as_a_table(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from praisonai_accel.worker.accelerator import log_table

    writer = SummaryWriter(str(tmp_path))
    trackers = {"tensorboard": writer}
    accelerator = SimpleNamespace(get_tracker=lambda name, unwrap=False: trackers[name])
    log_table(accelerator, ["tensorboard", "mlflow"], "completions", ["prompt", "completion", "reward"],
              [[r["prompt"], r["completion"], r["reward"]] for r in RECORDS], 3)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    (event,) = events.Tensors("completions/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3
    assert text.splitlines() == [
        "| prompt | completion | reward |", "|---|---|---|",
        "| [{'role': 'user', 'content': 'reverse: ada \\| bob'}] | bob ada | 1.0 |",
        "| reverse: cy dee | cy | 0.0 |"]
