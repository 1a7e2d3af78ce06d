"""Preference data: formats from columns, row checks in words, encoding with SFT's masking (prompt never trained),
prompt-first truncation with counts, and collation; on LLaMA-Factory's real demo files with Phi-3's tokenizer and
the tiny model's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from praisonai_accel.data.chat_masking import IGNORE_INDEX
from praisonai_accel.data import DataError, ensure_chat_template
from praisonai_accel.methods.preference import PreferenceMethod

FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "llamafactory"


def _config(method="dpo", max_prompt_length=512, max_seq_length=1024):
    return SimpleNamespace(method=method, max_prompt_length=max_prompt_length, max_seq_length=max_seq_length,
                           model_fields_set={"max_prompt_length"})


def _rows(name: str) -> list[dict]:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ensure_chat_template(tokenizer)
    return tokenizer


@pytest.fixture(params=["phi3", "tiny"])
def tokenizer(request, phi3_tokenizer_or_skip, tiny_tokenizer):
    return phi3_tokenizer_or_skip if request.param == "phi3" else tiny_tokenizer


@pytest.fixture(scope="module")
def phi3_tokenizer_or_skip():
    from tests.conftest import PHI3

    if not PHI3.is_dir():
        pytest.skip("../shared/fixtures/phi-3-mini is absent")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(PHI3))
    ensure_chat_template(tokenizer)
    return tokenizer


def _sample(rows: list[dict], tokenizer) -> list[dict]:
    """All 300 rows with Phi-3's tokenizer; every third with the tiny one, whose 320-token vocabulary makes each
    row several times longer (seconds, not half a minute)."""
    return rows if tokenizer.name_or_path.endswith("phi-3-mini") else rows[::3]


def _first_trained(labels) -> int:
    return next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)


def _trained_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])


def test_llamafactory_dpo_file(tokenizer):
    rows = _rows("dpo_en_demo.json")
    assert len(rows) == 300
    rows = _sample(rows, tokenizer)
    method, config = PreferenceMethod(_config()), _config()
    fmt = method.detect_format(list(rows[0]), SimpleNamespace(name="dpo_en_demo.json"))
    assert fmt == "sharegpt_paired"
    assert all(method.check_row(row, fmt) is None for row in rows)
    examples = [method.encode(row, fmt, tokenizer, config) for row in rows]
    dropped = [e for e in examples if isinstance(e, str)]
    kept = [e for e in examples if not isinstance(e, str)]
    assert all(reason.startswith("length:") for reason in dropped)
    assert len(kept) + len(dropped) == len(rows) and len(kept) >= 0.95 * len(rows)
    counts = method.cut_counts(kept)
    assert counts["prompt_cut"] > 0 and counts["completion_cut"] > 0  # real data longer than 512 / 1024 tokens
    multi_turn = 0
    for row, example in zip(rows, examples):
        if isinstance(example, str):
            continue
        starts = []
        for side in ("chosen", "rejected"):
            ids, labels = example[f"{side}_input_ids"], example[f"{side}_labels"]
            assert len(ids) == len(labels) <= 1024
            start = _first_trained(labels)
            starts.append(start)
            assert start <= 512  # the prompt kept at most max_prompt_length tokens
            if not example["prompt_cut"][0] and not example["completion_cut"][0] and tokenizer.name_or_path.endswith("phi-3-mini"):
                # exactly the completion and its end-of-turn token are trained, nothing of the prompt
                text = _trained_text(tokenizer, ids, labels)
                assert text.startswith(row[side]["value"].strip()[:40])
                assert text.rstrip().endswith("<|end|>") or text.rstrip().endswith("<|endoftext|>")
        # the prompt is the same tokens in both rows
        assert example["chosen_input_ids"][:starts[0]] == example["rejected_input_ids"][:starts[1]]
        earlier = next((t["value"] for t in row["conversations"] if t["from"] == "gpt"), None)
        if earlier is not None and not example["prompt_cut"][0]:
            multi_turn += 1
            # an earlier assistant turn is prompt: it lies before the one trained run, the final reply
            ids, labels = example["chosen_input_ids"], example["chosen_labels"]
            start = _first_trained(labels)
            assert " ".join(earlier.split()[:4]) in tokenizer.decode(ids[:start])
            trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
            assert trained == list(range(start, start + len(trained)))
    assert multi_turn > (10 if tokenizer.name_or_path.endswith("phi-3-mini") else 0)


def test_llamafactory_kto_file(tokenizer):
    rows = _rows("kto_en_demo.json")
    assert len(rows) == 300
    rows = _sample(rows, tokenizer)
    method, config = PreferenceMethod(_config("kto")), _config("kto")
    fmt = method.detect_format(list(rows[0]), SimpleNamespace(name="kto_en_demo.json"))
    assert fmt == "messages_label"
    assert all(method.check_row(row, fmt) is None for row in rows)
    examples = [method.encode(row, fmt, tokenizer, config) for row in rows]
    kept = [e for e in examples if not isinstance(e, str)]
    assert len(kept) >= 0.95 * len(rows)
    assert sum(e["label"][0] for e in kept) == sum(bool(r["label"]) for r, e in zip(rows, examples) if not isinstance(e, str))
    for row, example in zip(rows, examples):
        if isinstance(example, str) or example["prompt_cut"][0] or example["completion_cut"][0]:
            continue
        if tokenizer.name_or_path.endswith("phi-3-mini"):
            text = _trained_text(tokenizer, example["completion_input_ids"], example["completion_labels"])
            assert text.startswith(row["messages"][-1]["content"].strip()[:40])
            if len(row["messages"]) > 2:
                assert row["messages"][1]["content"].strip()[:30] not in text
    batch = method.collate(kept[:4], tokenizer.pad_token_id)
    assert method.units(batch) == 4 and batch["input_ids"].size(0) == 8 and int(batch["kl_rows"]) == 4
    # KL row i: example i's prompt with example i-1's completion (TRL's rotation by one)
    for i in range(4):
        j = (i - 1) % 4
        prompt = kept[i]["completion_input_ids"][:_first_trained(kept[i]["completion_labels"])]
        completion = kept[j]["completion_input_ids"][_first_trained(kept[j]["completion_labels"]):]
        n = len(prompt) + len(completion)
        assert batch["input_ids"][4 + i, :n].tolist() == prompt + completion
        assert (batch["labels"][4 + i, :len(prompt)] == IGNORE_INDEX).all()


def test_trl_formats_text_and_conversational(tiny_tokenizer):
    method, config = PreferenceMethod(_config()), _config(max_prompt_length=6, max_seq_length=12)
    spec = SimpleNamespace(name="d")
    user = lambda text: {"role": "user", "content": text}
    reply = lambda text: {"role": "assistant", "content": text}
    cases = [
        ({"prompt": "add 1 and 2", "chosen": " 3", "rejected": " 4"}, "paired"),
        ({"prompt": [user("add 1 and 2")], "chosen": [reply("3")], "rejected": [reply("4")]}, "paired"),
        ({"chosen": [user("add 1 and 2"), reply("3")], "rejected": [user("add 1 and 2"), reply("4")]}, "implicit"),
        ({"chosen": "add 1 and 2 is 3", "rejected": "add 1 and 2 is 4"}, "implicit"),
    ]
    encoded = []
    for row, expected in cases:
        fmt = method.detect_format(list(row), spec)
        assert fmt == expected
        assert method.check_row(row, fmt) is None
        encoded.append(method.encode(row, fmt, tiny_tokenizer, _config()))
    text, conv, implicit_conv, implicit_text = encoded
    assert conv == implicit_conv  # the implicit prompt is the common prefix of chosen and rejected
    assert _trained_text(tiny_tokenizer, text["chosen_input_ids"], text["chosen_labels"]).strip().startswith("3")
    assert text["chosen_input_ids"][-1] == tiny_tokenizer.eos_token_id
    assert _trained_text(tiny_tokenizer, conv["chosen_input_ids"], conv["chosen_labels"]).startswith("3<|im_end|>")
    # truncation: the prompt first, from the left (to max_prompt_length), then the completion from the right
    long = {"prompt": [user("add 1 and 2 and 3 and 4 and 5 and 6")], "chosen": [reply("3 3 3 3 3 3 3 3 3 3 3 3 3")],
            "rejected": [reply("4")]}
    cut = method.encode(long, "paired", tiny_tokenizer, config)
    full = method.encode(long, "paired", tiny_tokenizer, _config())
    assert cut["prompt_cut"] == [1] and cut["completion_cut"] == [1]
    assert _first_trained(cut["chosen_labels"]) == 6 and len(cut["chosen_input_ids"]) == 12
    k = _first_trained(full["chosen_labels"])
    assert cut["chosen_input_ids"][:6] == full["chosen_input_ids"][k - 6:k]  # the prompt's end is kept
    assert cut["rejected_input_ids"] == full["rejected_input_ids"][k - 6:]  # the short completion is whole
    unpaired = {"prompt": [user("add 1 and 2")], "completion": [reply("3")], "label": True}
    kto = PreferenceMethod(_config("kto"))
    assert kto.detect_format(list(unpaired), spec) == "unpaired"
    assert kto.encode(unpaired, "unpaired", tiny_tokenizer, _config("kto"))["label"] == [1]
    # a prompt that leaves no room: dropped, with the reason
    # a prompt limit that leaves no room (the config refuses one; a default too large for max_seq_length is halved)
    assert method.encode(long, "paired", tiny_tokenizer, _config(max_prompt_length=7, max_seq_length=7))["prompt_cut"] == [1]
    from praisonai_accel.methods.preference_data import encode_row

    reason = encode_row(long, "paired", tiny_tokenizer, method._plan(tiny_tokenizer), 7, 7)
    assert reason.startswith("length: the chosen completion keeps no token within max_seq_length 7")


def test_row_checks_and_columns_in_words():
    method, kto = PreferenceMethod(_config()), PreferenceMethod(_config("kto"))
    with pytest.raises(DataError, match=r"dataset d: columns \['instruction', 'output'\] are not preference data; "
                                        r"this method needs prompt / chosen / rejected"):
        method.detect_format(["instruction", "output"], SimpleNamespace(name="d"))
    with pytest.raises(DataError, match="prompt / completion / label"):
        kto.detect_format(["prompt", "chosen", "rejected"], SimpleNamespace(name="d"))
    check = method.check_row
    assert check({"prompt": "p", "chosen": None, "rejected": "r"}, "paired") == "'chosen' is missing or null"
    assert check({"prompt": "p", "rejected": "r"}, "paired") == "'chosen' is missing or null"
    assert check({"prompt": "p", "chosen": 3, "rejected": "r"}, "paired") == \
        "'chosen' is a int, not text or a list of messages with roles"
    assert check({"prompt": "p", "chosen": "same", "rejected": "same"}, "paired") == "chosen and rejected are the same"
    assert check({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "r"}, "paired") == \
        "prompt, chosen and rejected mix plain text and message lists"
    assert check({"chosen": "abc", "rejected": "abcd"}, "implicit").startswith("one of chosen and rejected begins the other")
    turn = {"from": "gpt", "value": "x"}
    assert check({"conversations": [], "chosen": turn, "rejected": turn}, "sharegpt_paired") == \
        "'conversations' is missing, null or empty"
    assert check({"conversations": [{"from": "human", "value": "q"}], "chosen": turn, "rejected": turn},
                 "sharegpt_paired") == "chosen and rejected are the same"
    assert check({"conversations": [{"from": "human", "value": "q"}], "chosen": None, "rejected": turn},
                 "sharegpt_paired") == "'chosen' is missing or null (a turn with from/value)"
    assert kto.check_row({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                          "label": "yes"}, "messages_label") == "'label' is 'yes'; it must be true or false"
    assert kto.check_row({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}],
                          "label": True}, "messages_label") == \
        "the last message of 'messages' is from 'user', not the assistant: there is no completion"


def test_pairs_collate_into_one_batch(tiny_tokenizer):
    method = PreferenceMethod(_config())
    rows = [{"prompt": f"add {i} and 2", "chosen": f" {i + 2}", "rejected": " no" * (i + 1)} for i in range(3)]
    examples = [method.encode(r, "paired", tiny_tokenizer, _config()) for r in rows]
    batch = method.collate(examples, tiny_tokenizer.pad_token_id)
    assert method.units(batch) == 3 and batch["input_ids"].size(0) == 6
    for i, e in enumerate(examples):
        for row, side in ((i, "chosen"), (3 + i, "rejected")):
            n = len(e[f"{side}_input_ids"])
            assert batch["input_ids"][row, :n].tolist() == e[f"{side}_input_ids"]
            assert batch["labels"][row, :n].tolist() == e[f"{side}_labels"]
            assert batch["attention_mask"][row].sum() == n and (batch["labels"][row, n:] == IGNORE_INDEX).all()
    assert "ref_chosen_logps" not in batch
    with_ref = [{**e, "ref_chosen_logps": -1.0 - i, "ref_rejected_logps": -2.0} for i, e in enumerate(examples)]
    assert method.collate(with_ref, 0)["ref_chosen_logps"].tolist() == [-1.0, -2.0, -3.0]
