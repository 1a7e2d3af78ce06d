"""Formats, prompt masking, truncation, local file types, concatenation and the preprocessing cache."""

from __future__ import annotations

import json

import pytest

from praisonai_accel.config import DatasetSpec, parse_config
from praisonai_accel.data import (
    IGNORE_INDEX, DataError, PadCollator, ensure_chat_template, load_or_build, to_messages, tokenize_example,
)
from praisonai_accel.demo import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ensure_chat_template(tok)
    return tok


def trained_text(example: dict, tokenizer) -> str:
    return tokenizer.decode([t for t, l in zip(example["input_ids"], example["labels"]) if l != IGNORE_INDEX])


def config_for(tmp_path, datasets, **kw):
    return parse_config({"model_name": "m", "dataset": datasets, "output_dir": str(tmp_path / "out"), **kw})


def test_alpaca_masks_the_prompt_and_trains_reply_plus_end_of_turn(tokenizer):
    spec = DatasetSpec(name="x", format="alpaca")
    for extra in ({"input": "ada bob"}, {"input": None}, {}):
        messages = to_messages({"instruction": "repeat the words", "output": "ada bob", **extra}, "alpaca", spec)
        example = tokenize_example(messages, tokenizer, 512, train_on_inputs=False)
        assert trained_text(example, tokenizer) == "ada bob<|im_end|>"
        assert len(example["input_ids"]) == len(example["labels"])
    assert messages[0]["content"] == "repeat the words"  # input None -> no empty "\n\n"


def test_sharegpt_multi_turn_trains_every_assistant_turn_only(tokenizer):
    row = {"conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "add 1 and 2"},
        {"from": "gpt", "value": "1 plus 2 is 3"}, {"from": "human", "value": "add 2 and 2"},
        {"from": "gpt", "value": "2 plus 2 is 4"},
    ]}
    messages = to_messages(row, "sharegpt", DatasetSpec(name="x"))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    example = tokenize_example(messages, tokenizer, 512, train_on_inputs=False)
    assert trained_text(example, tokenizer) == "1 plus 2 is 3<|im_end|>2 plus 2 is 4<|im_end|>"


def test_openai_messages_and_train_on_inputs(tokenizer):
    row = {"messages": [{"role": "user", "content": "what colour does ada like"}, {"role": "assistant", "content": "ada likes red"}]}
    messages = to_messages(row, "messages", DatasetSpec(name="x", system_prompt="you know colours"))
    assert messages[0] == {"role": "system", "content": "you know colours"}
    full = tokenize_example(messages, tokenizer, 512, train_on_inputs=True)
    assert full["labels"] == full["input_ids"]


def test_plain_text_trains_everything_and_ends_with_eos(tokenizer):
    example = tokenize_example("ada likes red", tokenizer, 512, train_on_inputs=False)
    assert example["input_ids"][-1] == tokenizer.eos_token_id and example["labels"] == example["input_ids"]


def test_truncation_to_max_seq_length(tokenizer):
    messages = [{"role": "user", "content": "repeat the words"}, {"role": "assistant", "content": " ".join(["ada"] * 200)}]
    example = tokenize_example(messages, tokenizer, 32, train_on_inputs=False)
    assert len(example["input_ids"]) == len(example["labels"]) == 32


def test_local_formats_are_concatenated_and_cached(tmp_path, tokenizer):
    import pandas as pd

    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 3, tmp_path / "a.jsonl")
    pd.DataFrame({"instruction": ["add 2 and 2"] * 2, "output": ["2 plus 2 is 4"] * 2}).to_csv(tmp_path / "b.csv", index=False)
    pd.DataFrame({"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ada"}]]}).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("ada likes red\nbob likes blue\n")
    (tmp_path / "e.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "bob"}]}]))
    specs = [{"name": str(tmp_path / n)} for n in ("a.jsonl", "b.csv", "c.parquet", "d.txt", "e.json")]
    config = config_for(tmp_path, specs)
    data, cached = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache")
    assert not cached and len(data) == 3 + 2 + 1 + 2 + 1
    assert trained_text(data[3], tokenizer) == "2 plus 2 is 4<|im_end|>"
    assert trained_text(data[6], tokenizer).startswith("ada likes red")
    again, cached = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache")
    assert cached and again["input_ids"] == data["input_ids"]
    # Editing a source file invalidates the cache.
    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 4, tmp_path / "a.jsonl")
    changed, cached = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache")
    assert not cached and len(changed) == 10


def test_num_samples_and_examples_without_targets_are_dropped(tmp_path, tokenizer):
    rows = [{"instruction": "repeat the words " * 40, "input": "", "output": "ada"}] + \
           [{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 5
    write_jsonl(rows, tmp_path / "a.jsonl")
    config = config_for(tmp_path, [{"name": str(tmp_path / "a.jsonl"), "num_samples": 4}], max_seq_length=24)
    data, _ = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache")
    assert len(data) == 3  # 4 sampled, the over-long prompt leaves no reply token within 24


@pytest.mark.parametrize(
    "content,spec,message",
    [
        ('{"question": "q", "answer": "a"}\n', {}, "cannot tell its format from columns ['answer', 'question']"),
        ('{"instruction": "q"}\n', {"format": "alpaca"}, "does not fit format 'alpaca'"),
        ("not json at all\n", {}, "could not be loaded"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, tokenizer, content, spec, message):
    (tmp_path / "bad.jsonl").write_text(content)
    config = config_for(tmp_path, [{"name": str(tmp_path / "bad.jsonl"), **spec}])
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_or_build(config.dataset, tokenizer, config, tmp_path / "cache")


def test_unsupported_file_type(tmp_path, tokenizer):
    (tmp_path / "data.xml").write_text("<a/>")
    config = config_for(tmp_path, [{"name": str(tmp_path / "data.xml")}])
    with pytest.raises(DataError, match="unsupported file type '.xml'"):
        load_or_build(config.dataset, tokenizer, config, tmp_path / "cache")


def test_collator_pads_right_and_masks_padding():
    batch = PadCollator(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_fallback_template_for_tokenizers_without_one(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    ensure_chat_template(bare)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ada"}]
    example = tokenize_example(messages, bare, 64, train_on_inputs=False)
    assert trained_text(example, bare).startswith("ada<|im_end|>")


def test_length_grouped_sampler_is_a_shuffle_sorted_within_windows():
    from praisonai_accel.data import LengthGroupedSampler

    lengths = [(i * 37) % 50 + 1 for i in range(100)]
    sampler = LengthGroupedSampler(lengths, window=16, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(100)) and len(sampler) == 100
    for start in range(0, 100, 16):
        window = [lengths[i] for i in order[start:start + 16]]
        assert window == sorted(window, reverse=True)
    assert list(sampler) == order  # deterministic for a seed and epoch
    sampler.set_epoch(1)
    assert list(sampler) != order
