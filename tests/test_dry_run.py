"""--dry-run prints the keys that matter: those at their default that the method, the model or the settings leave
unread are left out; `train --help` names the extra --ray needs. In process (CliRunner), nothing launched."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from praisonai_accel.cli import app
from praisonai_accel.config.vision import VISION_KEYS
from praisonai_accel.methods.method_keys import DPOKeys, GRPOKeys

GRPO_KEYS = set(GRPOKeys.model_fields) - set(DPOKeys.model_fields)  # GRPO's own: no DPO run holds them


def _dry_run(tmp_path, model, **keys) -> dict:
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "answer": "a", "rejected": "b"}\n')
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model_name": str(model), "dataset": str(data), "output_dir": str(tmp_path / "o"),
                                    **keys}))
    result = CliRunner().invoke(app, ["train", str(path), "--cpu", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "o").exists()
    text = result.output.split("# resolved config")[1].split("\n", 1)[1].split("\n# processes")[0]
    return yaml.safe_load(text)


def test_a_dpo_dry_run_leaves_out_grpo_vision_and_unread_keys(tmp_path, tiny_model):
    shown = _dry_run(tmp_path, tiny_model, method="dpo")
    assert shown["method"] == "dpo" and shown["beta"] == 0.1 and shown["loss_type"] == "sigmoid"
    assert not GRPO_KEYS & set(shown), sorted(GRPO_KEYS & set(shown))
    assert not set(VISION_KEYS) & set(shown)  # the tiny model takes no images
    for unread in ("simpo_gamma", "label_smoothing", "desirable_weight", "save_steps", "eval_steps", "hub_strategy",
                   "quantization_method", "tiled_mlp_shards"):
        assert unread not in shown, unread
    assert {"learning_rate", "lora_r", "max_seq_length", "save_strategy", "output_dir"} <= set(shown)


def test_a_key_written_or_read_is_always_shown(tmp_path, tiny_model):
    shown = _dry_run(tmp_path, tiny_model, method="grpo", reward_funcs=["exact_match"], save_steps=5,
                     num_generations=2, max_completion_length=32, finetune_type="full")
    assert shown["num_generations"] == 2 and shown["reward_funcs"] == ["exact_match"] and "temperature" in shown
    assert shown["save_steps"] == 5 and "save_total_limit" in shown
    assert "lora_r" not in shown and "simpo_gamma" not in shown


def test_the_ray_flag_names_its_extra():
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    assert "pip install 'praisonai-accel[ray]'" in result.output, result.output
