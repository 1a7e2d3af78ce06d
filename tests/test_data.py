"""Formats, prompt masking, truncation that keeps the response, local file types, the cache and its statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from praisonai_accel.config import DatasetSpec, parse_config
from praisonai_accel.methods import method_for
from praisonai_accel.data import (
    IGNORE_INDEX, INPUTS_INDEX, Conversation, DataError, PadCollator, cache_key, cached_for_inputs, encode_chat,
    encode_text, ensure_chat_template, load_datasets, load_or_build, plan_masking, to_conversation,
)
from praisonai_accel.demo.text import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ensure_chat_template(tok)
    return tok


def trained_text(example, tokenizer) -> str:
    ids, labels = (example.input_ids, example.labels) if hasattr(example, "input_ids") else (example["input_ids"], example["labels"])
    return tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX])


def encode(conversation, tokenizer, max_len=512, **kw):
    return encode_chat(conversation, tokenizer, plan_masking(tokenizer), max_len, **kw)


def config_for(tmp_path, datasets, **kw):
    return parse_config({"model_name": "m", "dataset": datasets, "output_dir": str(tmp_path / "out"), **kw})


def test_alpaca_masks_the_prompt_and_trains_reply_plus_end_of_turn(tokenizer):
    spec = DatasetSpec(name="x", format="alpaca")
    for extra in ({"input": "ada bob"}, {"input": None}, {}):
        item = to_conversation({"instruction": "repeat the words", "output": "ada bob", **extra}, "alpaca", spec)
        example = encode(item, tokenizer)
        assert trained_text(example, tokenizer) == "ada bob<|im_end|>"
        assert len(example.input_ids) == len(example.labels) and not example.truncated
    assert item.messages[0]["content"] == "repeat the words"  # input None -> no empty "\n\n"


def test_sharegpt_multi_turn_trains_every_assistant_turn_only(tokenizer):
    row = {"conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "add 1 and 2"},
        {"from": "gpt", "value": "1 plus 2 is 3"}, {"from": "human", "value": "add 2 and 2"},
        {"from": "gpt", "value": "2 plus 2 is 4"},
    ]}
    item = to_conversation(row, "sharegpt", DatasetSpec(name="x"))
    assert [m["role"] for m in item.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert trained_text(encode(item, tokenizer), tokenizer) == "1 plus 2 is 3<|im_end|>2 plus 2 is 4<|im_end|>"


def test_messages_rows_carry_reasoning_tools_and_tool_turns():
    row = {"messages": [
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": None, "thinking": "look it up",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "sunny", "reasoning_content": None}],
        "tools": json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])}
    item = to_conversation(row, "messages", DatasetSpec(name="x"))
    assert item.tools[0]["function"]["name"] == "get_weather"
    call = item.messages[1]
    assert call["thinking"] == "look it up" and "content" not in call  # None values are left out
    from praisonai_accel.data import normalize_message

    normalized = normalize_message(call)
    assert normalized["reasoning_content"] == normalized["thinking"] == "look it up"
    assert normalized["tool_calls"][0]["function"]["arguments"] == {"city": "paris"}  # JSON strings become mappings


def test_openai_messages_and_train_on_inputs(tokenizer):
    row = {"messages": [{"role": "user", "content": "what colour does ada like"}, {"role": "assistant", "content": "ada likes red"}]}
    item = to_conversation(row, "messages", DatasetSpec(name="x", system_prompt="you know colours"))
    assert item.messages[0] == {"role": "system", "content": "you know colours"}
    full = encode(item, tokenizer, train_on_inputs=True)
    assert full.labels == full.input_ids


def test_plain_text_trains_everything_and_ends_with_eos(tokenizer):
    example = encode_text("ada likes red", tokenizer, 512)
    assert example.input_ids[-1] == tokenizer.eos_token_id and example.labels == example.input_ids


def _long_conversation(turns: int, words: int) -> Conversation:
    messages = [{"role": "system", "content": "be brief"}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"question {turn} " + "ada bob " * words},
                     {"role": "assistant", "content": f"answer {turn} cy dee"}]
    return Conversation(messages)


def test_keep_response_drops_oldest_turns_then_cuts_the_user_turn_never_the_response(tokenizer):
    conversation = _long_conversation(turns=3, words=30)
    full = encode(conversation, tokenizer, 4096)
    assert not full.truncated and len(full.input_ids) > 120
    limit = len(full.input_ids) - 20  # one old exchange has to go
    cut = encode(conversation, tokenizer, limit)
    assert cut.truncated and len(cut.input_ids) <= limit
    text = tokenizer.decode(cut.input_ids)
    assert "question 0" not in text and "question 2" in text and "be brief" in text  # oldest first, system kept
    assert trained_text(cut, tokenizer).endswith("answer 2 cy dee<|im_end|>")
    tight = encode(conversation, tokenizer, 40)  # only the start of the last user turn can go
    text = tokenizer.decode(tight.input_ids)
    assert tight.truncated and len(tight.input_ids) <= 40 and "question 2" not in text and "bob" in text
    assert trained_text(tight, tokenizer) == "answer 2 cy dee<|im_end|>"
    dropped = encode(conversation, tokenizer, 8, excess_length_strategy="drop")  # even the response does not fit
    assert dropped.dropped
    cut = encode(conversation, tokenizer, 8)  # the default keeps it: the prompt's end and the response's start
    assert cut.truncated and cut.response_cut and not cut.dropped and len(cut.input_ids) == 8
    assert tokenizer.decode(cut.input_ids).endswith(trained_text(cut, tokenizer)) and trained_text(cut, tokenizer) == "answer"
    assert "<|im_end|>" not in trained_text(cut, tokenizer)  # the end of turn is cut off with the end of the response
    assert cut.labels[0] == IGNORE_INDEX  # some of the prompt is kept
    right = encode(conversation, tokenizer, 40, truncation="right")
    assert len(right.input_ids) == 40 and trained_text(right, tokenizer) == ""  # what plain right-truncation loses


def test_keep_response_with_the_real_phi3_tokenizer(phi3_tokenizer):
    conversation = Conversation([{"role": "user", "content": "Summarise: " + "the cat sat on the mat. " * 300},
                                 {"role": "assistant", "content": "A cat sat on a mat."}])
    example = encode(conversation, phi3_tokenizer, 256)
    assert example.truncated and len(example.input_ids) <= 256
    assert trained_text(example, phi3_tokenizer).strip() == "A cat sat on a mat.<|end|><|endoftext|>"
    assert phi3_tokenizer.decode(example.input_ids).startswith("<|user|>")


def long_records(count: int, seed: int = 2) -> list[dict]:
    """Alpaca rows with long inputs, most of each the prompt: 256 to 2,400 tokens with the demo tokenizer."""
    import random

    from praisonai_accel.demo.text import _NAMES

    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(_NAMES) for _ in range(n))
    return [{"instruction": "repeat the last words of the input", "input": words(rng.randint(60, 600)),
             "output": words(rng.randint(10, 80))} for _ in range(count)]


def test_long_rows_are_all_trained_by_default(tmp_path, tokenizer):
    """400 long rows at 128 tokens: with excess_length_strategy drop, 213 of them are dropped (their response alone
    is too long), where TRL and LLaMA-Factory train all 400. By default every row is trained."""
    write_jsonl(long_records(400), tmp_path / "long.jsonl")
    spec = [{"name": str(tmp_path / "long.jsonl")}]
    by_default = config_for(tmp_path, spec, max_seq_length=128)
    data, stats, _ = load_or_build(by_default.dataset, tokenizer, by_default, tmp_path / "cache", method_for(by_default).data(tokenizer))
    (d,) = stats.datasets
    assert (d.rows, d.examples, d.dropped) == (400, 400, 0) and len(data) == 400 and d.response_cut > 100
    assert max(len(data[i]["input_ids"]) for i in range(len(data))) <= 128
    drop = config_for(tmp_path, spec, max_seq_length=128, excess_length_strategy="drop")
    _, stats, _ = load_or_build(drop.dataset, tokenizer, drop, tmp_path / "cache", method_for(drop).data(tokenizer))
    assert stats.datasets[0].dropped == d.response_cut and any("dropped" in w for w in stats.warnings())


def test_local_formats_are_concatenated_cached_and_counted(tmp_path, tokenizer):
    import pandas as pd

    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 3, tmp_path / "a.jsonl")
    pd.DataFrame({"instruction": ["add 2 and 2"] * 2, "output": ["2 plus 2 is 4"] * 2}).to_csv(tmp_path / "b.csv", index=False)
    pd.DataFrame({"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ada"}]]}).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("ada likes red\nbob likes blue\n")
    (tmp_path / "e.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "bob"}]}]))
    specs = [{"name": str(tmp_path / n)} for n in ("a.jsonl", "b.csv", "c.parquet", "d.txt", "e.json")]
    config = config_for(tmp_path, specs)
    data, stats, cached = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache", method_for(config).data(tokenizer))
    assert not cached and len(data) == 3 + 2 + 1 + 2 + 1
    assert [d.examples for d in stats.datasets] == [3, 2, 1, 2, 1] and all(d.dropped == 0 for d in stats.datasets)
    assert trained_text(data[3], tokenizer) == "2 plus 2 is 4<|im_end|>"
    assert trained_text(data[6], tokenizer).startswith("ada likes red")
    again, stats_again, cached = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache", method_for(config).data(tokenizer))
    assert cached and [again[i]["input_ids"].tolist() for i in range(len(again))] == \
        [data[i]["input_ids"].tolist() for i in range(len(data))]
    assert stats_again == stats  # cached runs report the same statistics
    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 4, tmp_path / "a.jsonl")
    changed, _, cached = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache", method_for(config).data(tokenizer))
    assert not cached and len(changed) == 10  # editing a source file invalidates the cache


def test_cache_key_changes_with_tokenizer_and_max_seq_length(tmp_path, tokenizer):
    import copy

    config = config_for(tmp_path, [{"name": "x.jsonl"}])
    other_template = copy.deepcopy(tokenizer)
    other_template.chat_template = tokenizer.chat_template + " "
    keys = {cache_key(config.dataset, tokenizer, config), cache_key(config.dataset, other_template, config),
            cache_key(config.dataset, tokenizer, config_for(tmp_path, [{"name": "x.jsonl"}], max_seq_length=64)),
            cache_key(config.dataset, tokenizer, config_for(tmp_path, [{"name": "x.jsonl"}], truncation="right")),
            cache_key(config.dataset, tokenizer, config_for(tmp_path, [{"name": "x.jsonl"}], excess_length_strategy="drop"))}
    assert len(keys) == 5


def test_a_filled_cache_is_found_from_the_files_without_a_tokenizer(tmp_path, tiny_model):
    """The launcher's shortcut: an index from the files preprocessing reads to the cache entries. Any change to
    those files or to a setting that shapes the tokens misses it; an index naming anything else is not trusted."""
    import os
    import shutil

    from transformers import AutoTokenizer

    model = shutil.copytree(tiny_model, tmp_path / "model")
    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 3, tmp_path / "a.jsonl")
    write_jsonl([{"instruction": "add 2 and 2", "input": "", "output": "4"}] * 2, tmp_path / "e.jsonl")

    def config(**kw):
        return parse_config({"model_name": str(model), "dataset": [{"name": str(tmp_path / "a.jsonl")}],
                             "eval_dataset": [{"name": str(tmp_path / "e.jsonl")}], "output_dir": str(tmp_path / "out"), **kw})

    def fill(cfg):
        tok = AutoTokenizer.from_pretrained(str(model))
        ensure_chat_template(tok, cfg.chat_template)
        load_datasets(cfg, tok, method_for(cfg).data(tok))

    assert not cached_for_inputs(config())
    fill(config())
    assert cached_for_inputs(config())
    assert not cached_for_inputs(config(max_seq_length=64)) and not cached_for_inputs(config(truncation="right"))
    assert not cached_for_inputs(config(chat_template="{{ messages }}"))
    assert not cached_for_inputs(config(model_name="org/a-hub-model"))  # only known by loading its tokenizer
    index = next((tmp_path / "out" / ".cache" / "preprocessed" / INPUTS_INDEX).iterdir())
    entries = json.loads(index.read_text())["entries"]
    assert len(entries) == 2  # training and eval sets
    index.write_text(json.dumps({"entries": ["../../elsewhere", entries[1]]}))
    assert not cached_for_inputs(config())
    index.write_text("not json")
    assert not cached_for_inputs(config())
    fill(config())
    shutil.rmtree(tmp_path / "out" / ".cache" / "preprocessed" / entries[1])  # an entry gone: not filled
    assert not cached_for_inputs(config())
    fill(config())
    tokenizer_file = model / "tokenizer_config.json"
    os.utime(tokenizer_file, ns=(tokenizer_file.stat().st_atime_ns, tokenizer_file.stat().st_mtime_ns + 10**9))
    assert not cached_for_inputs(config())
    fill(config())
    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 4, tmp_path / "a.jsonl")
    assert not cached_for_inputs(config())


def test_dropped_and_truncated_examples_are_counted_and_warned(tmp_path, tokenizer):
    rows = [{"instruction": "repeat the words " * 40, "input": "", "output": "ada " * 8}] * 3 + \
           [{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 5
    write_jsonl(rows, tmp_path / "a.jsonl")
    config = config_for(tmp_path, [{"name": str(tmp_path / "a.jsonl"), "num_samples": 7}], max_seq_length=24,
                        excess_length_strategy="drop")
    data, stats, _ = load_or_build(config.dataset, tokenizer, config, tmp_path / "cache", method_for(config).data(tokenizer))
    (d,) = stats.datasets
    assert (d.rows, d.examples, d.dropped) == (7, 4, 3) and len(data) == 4  # the response alone exceeds 24 tokens
    assert any("3 of 7 examples (43%) dropped" in w for w in stats.warnings())
    by_default = config_for(tmp_path, [{"name": str(tmp_path / "a.jsonl"), "num_samples": 7}], max_seq_length=24)
    data, stats, _ = load_or_build(by_default.dataset, tokenizer, by_default, tmp_path / "cache", method_for(by_default).data(tokenizer))
    (d,) = stats.datasets
    assert (d.examples, d.truncated, d.response_cut, d.dropped) == (7, 3, 3, 0) and not stats.warnings()
    assert "3 truncated (3 with the response cut), 0 dropped" in d.line()
    keep = config_for(tmp_path, [{"name": str(tmp_path / "a.jsonl"), "num_samples": 7}], max_seq_length=48)
    _, stats, _ = load_or_build(keep.dataset, tokenizer, keep, tmp_path / "cache", method_for(keep).data(tokenizer))
    assert (stats.datasets[0].truncated, stats.datasets[0].dropped) == (3, 0)  # now the replies fit: prompts are cut


@pytest.mark.parametrize(
    "content,spec,message",
    [
        ('{"question": "q", "answer": "a"}\n', {}, "cannot tell its format from columns ['answer', 'question']"),
        ('{"instruction": "q"}\n', {"format": "alpaca"},
         "(format alpaca): line 1: field 'output' is missing (the row has: instruction) (1 invalid row in all;"),
        ("not json at all\n", {}, ": line 1: invalid JSON (Expecting value at column 1) (1 invalid row in all;"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, tokenizer, content, spec, message):
    (tmp_path / "bad.jsonl").write_text(content)
    config = config_for(tmp_path, [{"name": str(tmp_path / "bad.jsonl"), **spec}])
    with pytest.raises(DataError) as caught:
        load_or_build(config.dataset, tokenizer, config, tmp_path / "cache", method_for(config).data(tokenizer))
    assert message in str(caught.value)


def test_masking_problems_found_on_the_sample_are_reported(tmp_path, tokenizer):
    """A template that leaves the end-of-turn token out of the reply: the sample check names it."""
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    write_jsonl([{"instruction": "add 1 and 1", "input": "", "output": "1 plus 1 is 2"}] * 4, tmp_path / "a.jsonl")
    config = config_for(tmp_path, [{"name": str(tmp_path / "a.jsonl")}])
    _, stats, _ = load_or_build(config.dataset, bare, config, tmp_path / "cache", method_for(config).data(bare))
    assert stats.datasets[0].masking_problems.startswith("the end-of-turn token after an assistant reply is not trained")
    assert any("chat template custom (rendered spans)" in w for w in stats.warnings())


def test_collator_pads_right_and_masks_padding():
    batch = PadCollator(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    packed = PadCollator(0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 0, 1]},
                             {"input_ids": [8], "labels": [8], "position_ids": [0]}])
    assert packed["position_ids"].tolist() == [[0, 0, 1], [0, 0, 1]]  # padding forms a sequence of its own


def test_fallback_template_for_tokenizers_without_one(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    ensure_chat_template(bare)
    example = encode(Conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ada"}]), bare)
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


def test_tokenized_dataset_selects_and_splits_without_copying():
    from praisonai_accel.data import TokenizedDataset

    data = TokenizedDataset.from_columns({"input_ids": [[1, 2], [3], [4, 5, 6], [7]],
                                          "labels": [[-100, 2], [3], [-100, 5, 6], [7]]},
                                         [False, True, False, False], [0, 0, 1, 1])
    assert data.lengths == [2, 1, 3, 1] and data[2]["input_ids"].tolist() == [4, 5, 6]
    train, test = data.split(0.25, seed=0)
    assert len(test) == 1 and sorted(train.index.tolist() + test.index.tolist()) == [0, 1, 2, 3]
    assert data.select([3, 1]).lengths == [1, 1] and np.shares_memory(data.select([0]).input_ids, data.input_ids)


def test_the_fallback_template_writes_bos_where_the_tokenizer_would_add_it():
    """Base Llama, Mistral and Gemma tokenizers put bos in front of a text; texts are tokenized without special tokens
    (the template writes them), so the fallback template for a tokenizer without one must write bos itself."""
    from tokenizers import processors

    from praisonai_accel.data import ensure_chat_template

    from chat_families import tokenizer_for

    messages = [{"role": "user", "content": "add two and three"}, {"role": "assistant", "content": "five"}]
    with_bos = tokenizer_for("llama3", chat_template="")
    bos = with_bos.bos_token
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, with_bos.bos_token_id)])
    without_bos = tokenizer_for("qwen2_5", chat_template="")
    for tokenizer, expected in ((with_bos, True), (without_bos, False)):
        tokenizer.chat_template = None
        ensure_chat_template(tokenizer)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert text.startswith(bos) is expected and text.endswith("five" + tokenizer.eos_token + "\n\n")
    ids = with_bos(with_bos.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[0] == with_bos.bos_token_id and ids.count(with_bos.bos_token_id) == 1


def test_chat_template_may_be_a_file_and_anything_else_is_refused(tmp_path, tiny_model, alpaca_file):
    from praisonai_accel.data import DataError, resolve_chat_template

    from conftest import cli, write_config

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "mine.jinja"
    path.write_text(template)
    assert resolve_chat_template(str(path)) == template and resolve_chat_template(template) == template
    (tmp_path / "plain.txt").write_text("just words")
    for value, message in ((str(tmp_path / "missing.jinja"), "neither a Jinja template nor an existing file"),
                           ("chatml", "neither a Jinja template nor an existing file"),
                           (str(tmp_path / "plain.txt"), "holds no Jinja template")):
        with pytest.raises(DataError, match=message):
            resolve_chat_template(value)
    config = write_config(tmp_path, tiny_model, alpaca_file, chat_template=str(tmp_path / "missing.jinja"))
    result = cli("train", str(config), "--dry-run")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "chat_template:" in result.stderr and "missing.jinja" in result.stderr


def test_a_dataset_repository_layout_loads_by_subset_and_split(tmp_path):
    """What a Hub dataset is, offline: a folder with a dataset card whose configs name subsets and their split files
    (parquet for one subset, jsonl for the other). name/subset/split reach datasets.load_dataset as on the Hub."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from praisonai_accel.data import DataError, load_raw

    repo = tmp_path / "org-chat-data"
    (repo / "alpaca").mkdir(parents=True)
    (repo / "chat").mkdir()
    rows = lambda tag, n: [{"instruction": f"{tag} question {i}", "input": "", "output": f"{tag} answer {i}"} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows("train", 5)), repo / "alpaca" / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows("valid", 2)), repo / "alpaca" / "validation.parquet")
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"hello {i}"}]}
             for i in range(3)]
    pq.write_table(pa.Table.from_pylist(chats), repo / "chat" / "train.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: alpaca\n  data_files:\n  - split: train\n    path: alpaca/train.parquet\n"
        "  - split: validation\n    path: alpaca/validation.parquet\n"
        "- config_name: chat\n  data_files:\n  - split: train\n    path: chat/train.parquet\n---\n# org/chat-data\n")
    validation = load_raw(DatasetSpec(name=str(repo), subset="alpaca", split="validation"))
    assert [r["output"] for r in validation] == ["valid answer 0", "valid answer 1"]
    chat = load_raw(DatasetSpec(name=str(repo), subset="chat", split="train", num_samples=2))
    assert len(chat) == 2 and chat[1]["messages"][1]["content"] == "hello 1"
    with pytest.raises(DataError, match="could not be loaded"):
        load_raw(DatasetSpec(name=str(repo), subset="nope", split="train"))
    plain = tmp_path / "org-jsonl-data"  # no configs: splits from file names, as the Hub names them
    write_jsonl(rows("train", 4), plain / "data" / "train.jsonl")
    write_jsonl(rows("test", 3), plain / "data" / "test.jsonl")
    (plain / "README.md").write_text("# org/jsonl-data\n")
    assert [r["output"] for r in load_raw(DatasetSpec(name=str(plain), split="test"))] == [f"test answer {i}" for i in range(3)]
