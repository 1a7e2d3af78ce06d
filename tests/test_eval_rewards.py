"""`eval --reward-funcs module:function --prompts FILE.jsonl`: the mean reward of greedy (or sampled) completions,
base against tuned, as GRPO calls the functions; a trained reward model as `--reward-model`; bad input one line
before any model loads. No lm-eval needed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from praisonai_accel.cli import app

REWARDS_PY = '''
def length(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def matches(prompts, completions, answer):
    return [None if a is None else float((c if isinstance(c, str) else c[0]["content"]).startswith(a))
            for c, a in zip(completions, answer)]
'''

PROMPTS = [{"prompt": [{"role": "user", "content": "what colour does ada like"}], "answer": "ada"},
           {"prompt": [{"role": "user", "content": "repeat the words\n\nbob cy"}], "answer": None},
           {"prompt": "add 3 and 4", "answer": "3"},
           {"prompt": [{"role": "user", "content": "what colour does eve like"}], "answer": "eve"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    """A LoRA adapter with random weights on the tiny model (tuned and base answer differently), a rewards.py and
    the prompts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("rewards")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(3)
    tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"],
                                      init_lora_weights=False))
    tuned.save_pretrained(root / "adapter")
    tokenizer.save_pretrained(root / "adapter")
    (root / "rewards.py").write_text(REWARDS_PY)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def _invoke(root, monkeypatch, *args: str):
    monkeypatch.chdir(root)  # rewards.py is found beside where eval runs, as GRPO finds it beside its config
    return CliRunner().invoke(app, ["eval", *args])


def _greedy(model, tokenizer, prompt, max_new_tokens):
    """The completion as decoded one prompt at a time, with nothing of ours but the stop tokens."""
    import torch

    from praisonai_accel.models.inference import stop_token_ids

    text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(prompt, tokenize=False,
                                                                                add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_mean_rewards_of_greedy_completions_base_against_tuned(setup, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = setup / "r.json"
    result = _invoke(setup, monkeypatch, str(setup / "adapter"), "--reward-funcs", "rewards:length,rewards:matches",
                     "--prompts", "prompts.jsonl", "--base", "--max-new-tokens", "8", "--batch-size", "3",
                     "--output", str(out))
    assert result.exit_code == 0, result.output[-3000:]
    scored = json.loads(out.read_text())["rewards"]
    tokenizer = AutoTokenizer.from_pretrained(setup / "adapter")
    base_config = json.loads((setup / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_config), setup / "adapter").eval()
    expected = {}
    expected["tuned"] = [_greedy(model, tokenizer, p["prompt"], 8) for p in PROMPTS]
    with model.disable_adapter():
        expected["base"] = [_greedy(model, tokenizer, p["prompt"], 8) for p in PROMPTS]
    assert expected["tuned"] != expected["base"]
    for name in ("tuned", "base"):
        assert scored[name]["completions"] == expected[name]  # batched with left padding = one at a time
        lengths = [len(c) for c in expected[name]]
        assert scored[name]["length"]["mean"] == pytest.approx(sum(lengths) / len(lengths))
        matched = [float(c.startswith(p["answer"])) for c, p in zip(expected[name], PROMPTS) if p["answer"]]
        assert scored[name]["matches"]["mean"] == pytest.approx(sum(matched) / len(matched))  # None: left out
        assert len(scored[name]["matches"]["per_item"]) == 3
    table = {row["metric"]: row for row in json.loads(out.read_text())["comparison"]}
    assert set(table) == {"length (mean)", "matches (mean)", "total (mean)"}
    assert table["length (mean)"]["change"] == pytest.approx(scored["tuned"]["length"]["mean"]
                                                             - scored["base"]["length"]["mean"])
    assert table["length (mean)"]["paired_n"] == 4
    assert "length (mean)" in result.output and "rewards" in result.output


def test_base_of_a_full_fine_tune_is_the_model_it_was_trained_from(setup, monkeypatch, tiny_model, tmp_path):
    """A full fine-tune has no adapter to disable: --base loads the model it records it started from (the SFT demo's
    model is one; this was a traceback) and its completions are that model's own, with the run's tokenizer."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from praisonai_accel.run_dir.output_dirs import replace_with

    staged, run_dir = tmp_path / "staged", tmp_path / "run"
    AutoPeftModelForCausalLM.from_pretrained(setup / "adapter").merge_and_unload().save_pretrained(staged)
    AutoTokenizer.from_pretrained(setup / "adapter").save_pretrained(staged)
    run_dir.mkdir()
    replace_with(staged, run_dir / "model", "final_model_dir", kind="model", base_model=str(tiny_model))
    (run_dir / "train_summary.json").write_text(json.dumps({"global_step": 5, "final_model_dir": str(run_dir / "model")}))
    out = tmp_path / "full.json"
    result = _invoke(setup, monkeypatch, str(run_dir), "--reward-funcs", "rewards:length", "--prompts", "prompts.jsonl",
                     "--base", "--max-new-tokens", "8", "--output", str(out))
    assert result.exit_code == 0, result.output[-3000:]
    scored = json.loads(out.read_text())["rewards"]
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    for name, path in (("tuned", run_dir / "model"), ("base", tiny_model)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        assert scored[name]["completions"] == [_greedy(model, tokenizer, p["prompt"], 8) for p in PROMPTS], name
    assert scored["tuned"]["completions"] != scored["base"]["completions"]


def test_sampled_completions_are_seeded_and_scored_per_prompt(setup, monkeypatch):
    outs = []
    for n, seed in enumerate((1, 1, 2)):
        out = setup / f"s{n}.json"
        result = _invoke(setup, monkeypatch, str(setup / "adapter"), "--reward-funcs", "rewards:length", "--prompts",
                         "prompts.jsonl", "--num-samples", "3", "--max-new-tokens", "8", "--seed", str(seed),
                         "--output", str(out))
        assert result.exit_code == 0, result.output[-3000:]
        outs.append(json.loads(out.read_text())["rewards"]["tuned"])
    assert len(outs[0]["completions"]) == 12 and len(outs[0]["length"]["per_item"]) == 4
    assert outs[0]["completions"] == outs[1]["completions"] and outs[0]["completions"] != outs[2]["completions"]
    per_prompt = [sum(len(c) for c in outs[0]["completions"][3 * i:3 * i + 3]) / 3 for i in range(4)]
    assert list(outs[0]["length"]["per_item"].values()) == pytest.approx(per_prompt)


def test_a_trained_reward_model_is_a_metric(setup, monkeypatch, tiny_model):
    from test_reward import vowel_reward_model

    vowel_reward_model(tiny_model, setup / "rm")
    out = setup / "rm.json"
    result = _invoke(setup, monkeypatch, str(setup / "adapter"), "--reward-model", "rm", "--prompts", "prompts.jsonl",
                     "--max-new-tokens", "8", "--output", str(out))
    assert result.exit_code == 0, result.output[-3000:]
    scored = json.loads(out.read_text())["rewards"]["tuned"]
    assert scored["rm"]["mean"] is not None and len(scored["rm"]["per_item"]) == 4
    assert json.loads(out.read_text())["options"]["reward_funcs"] == ["model:rm"]


@pytest.fixture
def no_model_loads(monkeypatch):
    import praisonai_accel.evaluate.score as score

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(score, "load_model", refuse)


@pytest.mark.parametrize("args,line", [
    (["--reward-funcs", "rewards:length"], "--reward-funcs: needs --prompts FILE.jsonl"),
    (["--reward-model", "rm"], "--reward-model: needs --prompts FILE.jsonl"),  # the option given, not its long form
    (["--prompts", "prompts.jsonl"], "--prompts: needs --reward-funcs or --reward-model"),
    ([], "name what to score: --tasks"),
    (["--reward-funcs", "nomodule:length", "--prompts", "prompts.jsonl"], "no module named 'nomodule'"),
    (["--reward-funcs", "rewards:nothing", "--prompts", "prompts.jsonl"], "has no attribute 'nothing'"),
    (["--reward-funcs", "rewards:matches", "--prompts", "bare.jsonl"],
     "bare.jsonl: reward function rewards:matches reads column 'answer', which the dataset does not have"),
    (["--reward-funcs", "rewards:length", "--prompts", "broken.jsonl"], "broken.jsonl line 2: "),
    (["--reward-funcs", "rewards:length", "--prompts", "missing.jsonl"], "--prompts missing.jsonl: no such file"),
    (["--reward-model", "nowhere", "--prompts", "prompts.jsonl"], "model:nowhere"),
])
def test_bad_reward_inputs_are_one_line_before_any_model_loads(setup, monkeypatch, no_model_loads, args, line):
    (setup / "bare.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (setup / "broken.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    result = _invoke(setup, monkeypatch, str(setup / "adapter"), *args)
    assert result.exit_code == 2, result.output[-2000:]
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], result.output[-2000:]
