"""Every row checked against its format before training, named by its number (file and line, or row index), each
fault with its own reason; skip_invalid_rows trains on the rest and lists every skipped row; a chat template that
would drop part of a conversation is refused. Real files; the CLI rows run the real `praisonai-accel` process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from praisonai_accel.config import parse_config
from praisonai_accel.methods import method_for
from praisonai_accel.data import (
    SKIPPED_FILE, DataError, TokenizedDataset, cache_key, ensure_chat_template, load_datasets, load_or_build,
)
from praisonai_accel.demo.text import demo_config

from conftest import PHI3, cli

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"


def good(i: int) -> dict:
    return {"instruction": f"add {i} and 1", "input": "", "output": f"{i} plus 1 is {i + 1}"}


def jsonl(path: Path, rows: list, raw: dict[int, bytes] | None = None) -> Path:
    """rows as JSON lines; raw: 1-based line number -> bytes written as that line instead."""
    lines = [json.dumps(row).encode() for row in rows]
    for number, data in (raw or {}).items():
        lines[number - 1] = data
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def glaive_rows() -> list[dict]:
    """Rows shaped as LLaMA-Factory's glaive_toolcall_en_demo.json: sharegpt turns with function_call and
    observation, and the tools as a JSON string."""
    tools = json.dumps([{"name": "get_news_headlines", "description": "Get the latest news headlines",
                         "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                                        "required": ["country"]}}])
    call = json.dumps({"name": "get_news_headlines", "arguments": {"country": "United States"}})
    result = json.dumps({"headlines": ["Biden announces new vaccine mandates", "Hurricane Ida hits Louisiana"]})
    with_tools = {"conversations": [
        {"from": "human", "value": "Can you get me the latest news headlines for the United States?"},
        {"from": "function_call", "value": call}, {"from": "observation", "value": result},
        {"from": "gpt", "value": "Here are the headlines: Biden announces new vaccine mandates."}], "tools": tools}
    plain = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello! How can I help?"}],
             "tools": tools}
    return [plain, with_tools, with_tools]


def write_glaive(path: Path) -> Path:
    path.write_text(json.dumps(glaive_rows(), indent=2, ensure_ascii=False))  # LLaMA-Factory's layout: one array
    return path


# (file name, writer, expected in the error line, dataset overrides): the table, one row each
CASES = {
    "broken_line": ("a.jsonl", lambda p: jsonl(p, [good(i) for i in range(9)], {7: b'{"instruction": "q", "output": '}),
                    "line 7: invalid JSON (Expecting value at column 32) (1 invalid row in all", {}),
    "null_output": ("a.jsonl", lambda p: jsonl(p, [good(0), good(1), {**good(2), "output": None}]),
                    "line 3: field 'output' is null (1 invalid row in all", {}),
    "foreign_row": ("a.jsonl", lambda p: jsonl(p, [good(0), {"prompt_text": "q", "answer_text": "a"}, good(1)]),
                    "line 2: field 'instruction' is missing (the row has: answer_text, prompt_text)", {}),
    "not_utf8": ("a.jsonl", lambda p: jsonl(p, [good(0), good(1)], {2: b'{"instruction": "caf\xe9", "output": "x"}'}),
                 "line 2: bytes that are not UTF-8 (0xe9 at column 21)", {}),
    "conversations": ("m.jsonl", lambda p: jsonl(p, [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}]),
        "line 2: the conversation is empty; line 3: the conversation has no assistant turn to train; line 4: turn 1 "
        "has the unknown role 'robot' (known: human, user, gpt, assistant, bot, model, function_call, system, tool, "
        "observation, function, ipython, developer) (4 invalid rows in all", {"format": "messages"}),
    "csv_missing_output": ("a.csv", lambda p: p.write_text(
        "instruction,input,output\nadd 1 and 1,,2\n\"add 2\nand 2\",,4\nadd 3 and 3,,\nadd 4 and 4\n"),
        "line 5: field 'output' is empty; line 6: field 'output' is empty (2 invalid rows in all", {"format": "auto"}),
}


def config_file(tmp_path: Path, model: Path, data: Path, **overrides) -> Path:
    spec = {"name": str(data), "format": "alpaca", **overrides.pop("spec", {})}
    raw = demo_config(model, data, tmp_path / "out", dataset=[spec], plot_loss=False, max_steps=2,
                      dataset_prepared_path=str(tmp_path / "prepared"), **overrides)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def one_error_line(result) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.parametrize("case", list(CASES))
def test_preprocess_names_each_bad_row_with_its_number_and_reason(tmp_path, tiny_model, case):
    name, write, expected, spec = CASES[case]
    data = tmp_path / name
    write(data)
    line = one_error_line(cli("preprocess", str(config_file(tmp_path, tiny_model, data, spec=spec))))
    assert expected in line, line
    assert "does not fit in max_seq_length" not in line
    assert not (tmp_path / "prepared").exists() or not any((tmp_path / "prepared").glob("*/columns.json"))


def test_a_dataset_without_rows_is_one_line_before_launch(tmp_path, tiny_model):
    """An empty file (or blank lines, an empty JSON array, a CSV header alone) is said as such before anything is
    launched, not by a worker as 'no example has any response token left to train on'."""
    from praisonai_accel.config import DatasetSpec
    from praisonai_accel.data import DataError
    from praisonai_accel.data.sources import read_rows

    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    result = cli("train", str(config_file(tmp_path, tiny_model, data)), "--cpu")
    assert one_error_line(result) == f"error: dataset {data}: holds no rows"
    assert not (tmp_path / "out").exists()
    for name, text in (("e.json", "[]"), ("h.csv", "instruction,output\n"), ("z.jsonl", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=f"^dataset {tmp_path / name}: holds no rows$"):
            read_rows(DatasetSpec(name=str(tmp_path / name)))


@pytest.mark.skipif(not PHI3.is_dir(), reason="../shared/fixtures/phi-3-mini is absent")
def test_tool_calls_on_a_template_without_tools_are_refused_and_render_with_one_that_has_them(tmp_path, tiny_model):
    """Phi-3's own template has no place for a function call or a tool result: refused in one line naming the template
    and what it drops (not an emptied assistant turn trained). Qwen 3's template writes both: the same rows train,
    with the call and the result in the text and only the replies trained."""
    data = write_glaive(tmp_path / "glaive_toolcall_en_demo.json")
    config = config_file(tmp_path, tiny_model, data, tokenizer_name=str(PHI3), spec={"format": "sharegpt"})
    line = one_error_line(cli("preprocess", str(config)))
    assert "line 15: the chat template 'phi3' drops tool calls (turn 2) and the tool role (turn 3)" in line, line
    assert "(2 invalid rows in all; use a chat_template that writes them" in line
    qwen = config_file(tmp_path, tiny_model, data, tokenizer_name=str(PHI3), spec={"format": "sharegpt"},
                       chat_template=str(TRL_TEMPLATES / "qwen3.jinja"), max_seq_length=1024)
    result = cli("preprocess", str(qwen))
    assert result.returncode == 0, result.stderr
    assert "3 of 3 examples, 0 truncated" in result.stdout
    from transformers import AutoTokenizer

    cfg = parse_config(yaml.safe_load(qwen.read_text()))
    tokenizer = AutoTokenizer.from_pretrained(str(PHI3))
    ensure_chat_template(tokenizer, cfg.chat_template)
    train = load_datasets(cfg, tokenizer, method_for(cfg).data(tokenizer))[0]
    text = tokenizer.decode(train[1]["input_ids"])
    trained = tokenizer.decode([t for t, l in zip(train[1]["input_ids"], train[1]["labels"]) if l != -100])
    assert "get_news_headlines" in text and "Hurricane Ida hits Louisiana" in text
    assert "get_news_headlines" in trained and "Hurricane Ida" not in trained  # the call is trained, the result not


def test_skip_invalid_rows_trains_on_the_rest_and_lists_every_skipped_row(tmp_path, tiny_model):
    """The real `train`: refused by the launcher before any worker starts, with nothing written to output_dir (no
    accelerate_config.yaml, no logs/) nor to the cache; with skip_invalid_rows one warning line with the counts
    by reason, training on the rest, and every skipped row in logs/skipped_rows.jsonl. `preview` says the same."""
    rows = [good(i) for i in range(12)]
    rows[2]["output"] = None
    rows[5] = {"instruction": "q", "input": "", "output": 5}
    data = jsonl(tmp_path / "a.jsonl", rows, {9: b"{not json"})
    config = config_file(tmp_path, tiny_model, data)
    refused = cli("train", str(config), "--cpu", "--num-processes", "2")
    line = one_error_line(refused)
    assert refused.returncode == 2
    assert "line 3: field 'output' is null; line 6: field 'output' is a number, not text; line 9: invalid JSON" in line
    assert refused.stderr.strip() == line and not refused.stdout.strip()  # no "launching", no worker's line
    out = tmp_path / "out"
    assert not out.exists() and not (tmp_path / "prepared").exists()
    assert one_error_line(cli("preview", str(config))) == line

    skip = config_file(tmp_path, tiny_model, data, skip_invalid_rows=True)
    result = cli("train", str(skip))
    assert result.returncode == 0, result.stderr
    warnings = [l for l in (result.stdout + result.stderr).splitlines() if l.startswith("warning: skipped")]
    assert warnings == [f"warning: skipped 3 invalid rows (skip_invalid_rows: true): 1 null field, 1 wrongly typed "
                        f"field, 1 invalid JSON; each with its number and reason in {out / 'logs' / SKIPPED_FILE}"]
    assert "9 of 12 examples" in result.stdout + result.stderr
    records = [json.loads(l) for l in (out / "logs" / SKIPPED_FILE).read_text().splitlines()]
    assert [(r["line"], r["kind"]) for r in records] == [(3, "null field"), (6, "wrongly typed field"), (9, "invalid JSON")]
    assert (out / "metrics.jsonl").exists()
    preview = cli("preview", str(skip), "-n", "0")
    assert preview.returncode == 0 and "warning: skipped 3 invalid rows" in preview.stderr
    assert "examples 9 of 12 |" in preview.stdout and "| invalid skipped 3" in preview.stdout


def test_json_arrays_are_numbered_by_line_and_tables_by_row_index(tmp_path, tokenizer_config):
    tokenizer, config_for = tokenizer_config
    rows = [good(0), {**good(1), "output": ""}, good(2)]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    with pytest.raises(DataError, match=r"line 7: field 'output' is empty \(1 invalid row in all"):
        load_or_build(*config_for(tmp_path, "a.json"))
    broken = json.dumps(rows, indent=2).replace('"add 2 and 1",', '"add 2 and 1"')
    (tmp_path / "b.json").write_text(broken)
    with pytest.raises(DataError, match=r"invalid JSON at line 14, column 5: Expecting ',' delimiter; nothing after"):
        load_or_build(*config_for(tmp_path, "b.json"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"row index 1: field 'output' is empty"):
        load_or_build(*config_for(tmp_path, "c.parquet"))


def test_only_length_is_called_length_and_dropped_rows_are_listed(tmp_path, tokenizer_config):
    tokenizer, config_for = tokenizer_config
    rows = [good(0), {"instruction": "q", "input": "", "output": "ada " * 60}, good(1)]
    jsonl(tmp_path / "a.jsonl", rows)
    specs, _, cfg, cache, _ = config_for(tmp_path, "a.jsonl", max_seq_length=24, excess_length_strategy="drop")
    moved = cfg.model_copy(update={"dataset_prepared_path": str(cache)})
    out = load_datasets(moved, tokenizer, method_for(moved).data(tokenizer))
    assert out[1].datasets[0].dropped == 1 and not out[1].skipped  # dropped for length is no invalid row
    (record,) = [json.loads(l) for l in (cfg.output_path() / "logs" / SKIPPED_FILE).read_text().splitlines()]
    assert record["line"] == 2 and record["kind"] == "does not fit in max_seq_length"


def test_skip_invalid_rows_and_the_check_version_key_the_cache(tmp_path, tokenizer_config):
    """A cache built while skipping rows must never serve a run that refuses them, and a change of the checks
    (PREPROCESS_VERSION) invalidates every entry."""
    import praisonai_accel.data.cache as cache_module

    tokenizer, config_for = tokenizer_config
    jsonl(tmp_path / "a.jsonl", [good(0), good(1)])
    specs, _, cfg, _, _ = config_for(tmp_path, "a.jsonl")
    keys = {cache_key(specs, tokenizer, cfg), cache_key(specs, tokenizer, cfg.model_copy(update={"skip_invalid_rows": True}))}
    original = cache_module.PREPROCESS_VERSION
    try:
        cache_module.PREPROCESS_VERSION = original + "x"
        keys.add(cache_key(specs, tokenizer, cfg))
    finally:
        cache_module.PREPROCESS_VERSION = original
    assert len(keys) == 3


def test_each_fault_of_a_conversation_has_its_own_reason():
    from praisonai_accel.config import DatasetSpec
    from praisonai_accel.data import check_row

    spec, user = DatasetSpec(name="x"), {"role": "user", "content": "hi"}
    reasons = {
        "the conversation is empty": {"messages": []},
        "field 'messages' is null": {"messages": None},
        "field 'messages' is text, not a list": {"messages": "hi"},
        "the conversation has no assistant turn to train": {"messages": [user]},
        "turn 1 has the unknown role 'robot'": {"messages": [{"role": "robot", "content": "x"}]},
        "turn 2 (assistant) has no content": {"messages": [user, {"role": "assistant", "content": ""}]},
        "turn 2 (assistant)'s content is a number, not text": {"messages": [user, {"role": "assistant", "content": 3}]},
        "turn 2 (gpt) has no content": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
        "turn 2 (function_call) is not a JSON call with a name": {
            "conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "get it"}]},
        "field 'tools' is not valid JSON": {"messages": [user, {"role": "assistant", "content": "x"}], "tools": "[{"},
    }
    for reason, row in reasons.items():
        fmt = "sharegpt" if "conversations" in row else "messages"
        assert check_row(row, fmt, spec).startswith(reason), (reason, check_row(row, fmt, spec))
    fine = {"messages": [{"role": "system", "content": ""}, user,
                         {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]}
    assert check_row(fine, "messages", spec) is None  # a call needs no content; an empty system prompt says nothing


def test_tokenized_dataset_holds_any_named_columns(tmp_path):
    """What a preference method stores: two ragged pairs per example, its own length, saved and read back."""
    columns = {"chosen_input_ids": [[1, 2, 3], [4]], "chosen_labels": [[-100, 2, 3], [4]],
               "rejected_input_ids": [[1, 2], [5, 6, 7, 8]], "rejected_labels": [[-100, 2], [-100, 6, 7, 8]]}
    data = TokenizedDataset.from_columns(columns, [False, True], [0, 0], lengths=[5, 5])
    data.save(tmp_path / "entry")
    assert TokenizedDataset.exists(tmp_path / "entry")
    loaded = TokenizedDataset.load(tmp_path / "entry")
    assert loaded.lengths == [5, 5] and loaded[1]["rejected_input_ids"].tolist() == [5, 6, 7, 8]
    assert sorted(loaded[0]) == sorted(columns) and loaded.select([1])[0]["chosen_labels"].tolist() == [4]
    assert np.shares_memory(loaded.select([0]).chosen_input_ids, loaded.chosen_input_ids)
    train, test = loaded.split(0.5, seed=0)
    assert len(train) == len(test) == 1


@pytest.fixture
def tokenizer_config(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ensure_chat_template(tokenizer)

    def config_for(directory: Path, name: str, **kw):
        cfg = parse_config({"model_name": str(tiny_model), "dataset": [{"name": str(directory / name)}],
                            "output_dir": str(directory / "out"), **kw})
        return cfg.dataset, tokenizer, cfg, directory / "cache", method_for(cfg).data(tokenizer)

    return tokenizer, config_for
