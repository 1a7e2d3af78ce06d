"""Assistant-only labels and the Ollama TEMPLATE on every verbatim chat template the installed trl ships,
and on the real Phi-3 tokenizer. In process, no model needed."""

from __future__ import annotations

import pytest
from trl.chat_template_utils import get_training_chat_template, supports_tool_calling

from praisonai_accel.data.chat_masking import (
    IGNORE_INDEX, METHOD_MARKERS, METHOD_SPANS, METHOD_TWIN, encode_conversation, plan_masking, render,
)
from praisonai_accel.data.masking_check import MaskingReport, check_masking
from praisonai_accel.publish.ollama_template import derive

from chat_families import original_templates, template_text, tokenizer_for, twin_of
from conftest import PHI3
from go_template import render_ollama


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
user = lambda text: {"role": "user", "content": text}
reply = lambda text, **extra: {"role": "assistant", "content": text, **extra}
CONVERSATIONS = {
    "single": [user("what is the weather"), reply("it is sunny and warm")],
    "multi": [user("add two and three"), reply("five it is"), user("what is the weather"), reply("sunny in paris"),
              user("the quick fox"), reply("jumps over the lazy dog")],
    "system": [{"role": "system", "content": "answer with care"}, user("what is the weather"), reply("it is warm"),
               user("add two and three"), reply("five it is")],
    "reasoning": [user("add two and three"), reply("five it is", reasoning_content="two plus three makes five"),
                  user("what is the weather"), reply("sunny in paris", reasoning_content="the sky is clear")],
    "tools": [user("what is the weather in paris"),
              reply("", tool_calls=[{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]),
              {"role": "tool", "name": "get_weather", "content": "clear sky, 24 degrees"},
              reply("it is sunny and warm in paris")],
}
# The verbatim template itself ends a final reply with no end-of-turn token (GLM-4 stops on the next <|user|>,
# which trl's twin appends); only the twin, which production uses, can train it.
SPANS_CANNOT_TRAIN_FINAL_TERMINATOR = {"glm4moe"}
# DeepSeek's twins train the <｜Assistant｜> role token the generation prompt writes; the span method leaves it to the
# prompt, like every other family's role header.
TWIN_TRAINS_ROLE_TOKEN = {"deepseek_r1_distill", "deepseekv3"}


def supports(tokenizer, case: str) -> bool:
    if case == "tools":
        return supports_tool_calling(tokenizer)
    if case == "system":
        try:
            render(tokenizer, tokenizer.chat_template, [{"role": "system", "content": "s"}, user("u")])
        except Exception:
            return False
    return True


def cases_for(name: str):
    tokenizer = tokenizer_for(name)
    return [(case, messages) for case, messages in CONVERSATIONS.items() if supports(tokenizer, case)]


def masked(tokenizer, plan, case):
    messages = plan.prepare(CONVERSATIONS[case])
    tools = TOOLS if case == "tools" else None
    ids, labels = encode_conversation(tokenizer, plan, messages, tools)
    report = MaskingReport()
    check_masking(tokenizer, plan, messages, tools, labels, ids, report)
    return messages, tools, ids, labels, report


def local_copy(template: str) -> str:
    """The same template as a fine-tune's repo or a re-upload ships it: other whitespace inside the Jinja code
    (outside what it prints) and a trailing comment, so the text differs and the rendering does not."""
    return template.replace("{%- ", "{%-  ").replace("{{ ", "{{  ").replace(" }}", "  }}") + "\n{#- a local copy #}"


@pytest.mark.parametrize("copy", ["verbatim", "local copy"])
@pytest.mark.parametrize("name", original_templates())
def test_every_reply_and_its_end_of_turn_are_trained_and_nothing_else(name, copy):
    """Every template trl ships, verbatim and as a local copy: a local copy is recognised by what it renders and
    trained with the twin, exactly as the verbatim template is."""
    template = template_text(name) if copy == "verbatim" else local_copy(template_text(name))
    tokenizer = tokenizer_for(name, template)
    plan = plan_masking(tokenizer)
    twin = twin_of(name)
    assert plan.method == (METHOD_TWIN if twin else plan.method)
    if twin:
        assert plan.recognised_by == ("text" if copy == "verbatim" else "rendering")
        assert plan.name == name or twin_of(plan.name) is not None
    cases = cases_for(name)
    assert {"single", "multi", "reasoning"} <= {case for case, _ in cases}
    for case, conversation in cases:
        messages, tools, ids, labels, report = masked(tokenizer, plan, case)
        assert report.checked == 1 and report.ok, f"{name}/{case}: {report.summary()}"
        trained = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
        assert trained, f"{name}/{case}: nothing trained"
        if copy != "verbatim":
            as_read = plan_masking(tokenizer, spans_only=True).prepare(conversation)
            assert render(tokenizer, template, as_read, tools) == render(tokenizer, template_text(name), as_read, tools)
        if twin:  # the production labels are the twin's assistant-token mask, computed independently here
            out = tokenizer.apply_chat_template(messages, tools=tools, chat_template=twin, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            expected = [t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], out["assistant_masks"])]
            if plan.name == name:
                assert labels == expected
            else:  # another of trl's templates rendering the same probes (phi3 and phi3_5): whitespace aside
                assert _non_blank(tokenizer, ids, labels) == _non_blank(tokenizer, out["input_ids"], expected)


@pytest.mark.parametrize("name", original_templates())
def test_the_twin_read_from_trls_files_is_the_one_its_get_training_chat_template_returns(name):
    """plan_masking finds the twin without importing trl.chat_template_utils (which costs the CLI all of
    transformers' modeling code): for every verbatim template, the template it trains with is trl's own answer."""
    tokenizer = tokenizer_for(name)
    plan = plan_masking(tokenizer)
    try:
        theirs = get_training_chat_template(tokenizer)
    except ValueError:  # trl cannot patch it
        assert plan.method == METHOD_SPANS and plan.template == template_text(name)
        return
    if theirs is None:  # already prefix-preserving with generation markers
        assert plan.method == METHOD_MARKERS
    else:
        assert plan.method == METHOD_TWIN and plan.template == theirs


def _non_blank(tokenizer, ids, labels):
    return [(t, label != IGNORE_INDEX) for t, label in zip(ids, labels) if tokenizer.decode([t]).strip()]


def _generation_prompts(tokenizer, template: str, messages: list[dict]) -> str:
    """What the template appends to ask for each reply of this conversation (joined), e.g. <|start|>assistant."""
    prompts = []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            bare = render(tokenizer, template, messages[:index])
            prompted = render(tokenizer, template, messages[:index], generation_prompt=True)
            common = next((i for i, (a, b) in enumerate(zip(bare, prompted)) if a != b), min(len(bare), len(prompted)))
            prompts.append(prompted[common:])
    return "\n".join(prompts)


@pytest.mark.parametrize("name", original_templates())
def test_hand_written_spans_agree_with_trl_twins_and_keep_the_guarantee(name):
    """The span method on the verbatim template: the guarantee holds (or is reported where the template makes it
    impossible), and where trl's twin renders the same tokens, both train the same tokens apart from whitespace:
    GPT-OSS's <|start|>assistant header and the <think> a generation prompt opens (Nemotron 3, Qwen3.5) included."""
    tokenizer = tokenizer_for(name)
    spans = plan_masking(tokenizer, spans_only=True)
    assert spans.method == METHOD_SPANS
    twin, production = twin_of(name), plan_masking(tokenizer)
    compared = 0
    for case, _ in cases_for(name):
        _, _, ids, labels, report = masked(tokenizer, spans, case)
        if name in SPANS_CANNOT_TRAIN_FINAL_TERMINATOR:
            assert set(report.problems) <= {"the end-of-turn token after an assistant reply is not trained"}
            assert report.problems, "the check must report what the template leaves untrained"
        else:
            assert report.ok, f"{name}/{case}: {report.summary()}"
        if not twin or case == "tools":  # around tool turns templates differ on who owns the control tokens
            continue
        header = _generation_prompts(tokenizer, tokenizer.chat_template, spans.prepare(CONVERSATIONS[case]))
        _, _, twin_ids, twin_labels, _ = masked(tokenizer, production, case)
        if twin_ids != ids:
            continue  # the twin renders differently (prefix-preserving reasoning, say): nothing to compare
        compared += 1
        for token, ours, theirs in zip(ids, labels, twin_labels):
            if (ours == IGNORE_INDEX) != (theirs == IGNORE_INDEX):
                text = tokenizer.decode([token])
                assert not text.strip() or (name in TWIN_TRAINS_ROLE_TOKEN and text in header), (
                    f"{name}/{case}: '{text}' trained by {'spans' if theirs == IGNORE_INDEX else 'the twin'} only")
    if twin and name not in ("qwen3", "glm4moe", "gemma", "gemma3", "idefics3", "smolvlm", "llava_next"):
        assert compared, f"{name}: the twin never renders like the verbatim template"


@pytest.mark.parametrize("name, part", [("gptoss", "header"), ("nemotron_3_nano", "reasoning_opening"),
                                        ("qwen3_5_think", "reasoning_opening")])
def test_the_check_reports_an_untrained_header_or_reasoning_opening(name, part):
    """The span method without its rule for what the generation prompt writes for the model leaves GPT-OSS's
    <|start|>assistant or Nemotron's <think> untrained; the guarantee check says so."""
    import dataclasses

    tokenizer = tokenizer_for(name)
    plan = plan_masking(tokenizer, spans_only=True)
    assert getattr(plan, part), f"{name}: no {part} found"
    messages = plan.prepare(CONVERSATIONS["multi"])
    ids, labels = encode_conversation(tokenizer, dataclasses.replace(plan, **{part: ""}), messages)
    report = MaskingReport()
    check_masking(tokenizer, plan, messages, None, labels, ids, report)
    assert any(what.startswith(("the header", "the reasoning opening")) for what in report.problems), report.summary()
    ids, labels = encode_conversation(tokenizer, plan, messages)
    report = MaskingReport()
    check_masking(tokenizer, plan, messages, None, labels, ids, report)
    assert report.ok, report.summary()


@pytest.mark.skipif(not PHI3.is_dir(), reason="../shared/fixtures/phi-3-mini is absent")
def test_real_phi3_tokenizer_trains_every_end_token_in_multi_turn():
    """The regression: Phi-3 appends eos when not generating, so the first replies' <|end|> went untrained."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(PHI3))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    for plan in (plan_masking(tokenizer), plan_masking(tokenizer, spans_only=True)):
        for case in ("multi", "system", "single"):
            messages, tools, ids, labels, report = masked(tokenizer, plan, case)
            assert report.ok, f"{plan.method}/{case}: {report.summary()}"
            replies = sum(1 for m in messages if m["role"] == "assistant")
            ends_trained = [i for i, (t, label) in enumerate(zip(ids, labels)) if t == end and label != IGNORE_INDEX]
            assert len(ends_trained) == replies, (plan.method, case, tokenizer.decode(ids))
            trained_text = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
            assert "add two" not in trained_text and "weather" not in trained_text.replace("in paris", "")


# ---------------------------------------------------------------- the Ollama TEMPLATE

OLLAMA_CASES = ["single", "multi", "system"]


def _ollama_check(tokenizer, name: str) -> bool:
    derived = derive(tokenizer)
    if derived is None:
        return False
    go = derived.go()
    for case in OLLAMA_CASES:
        if case == "system" and derived.system_open is None:
            continue
        messages = CONVERSATIONS[case]
        for cut in range(1, len(messages) + 1):  # every prefix that ends with a user turn, as Ollama is asked
            conversation = messages[:cut]
            if conversation[-1]["role"] != "user":
                continue
            expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            assert render_ollama(go, conversation) == expected, f"{name}/{case}/{cut}"
    return True


@pytest.mark.parametrize("name", original_templates())
def test_ollama_template_renders_exactly_like_the_chat_template_or_is_left_out(name):
    _ollama_check(tokenizer_for(name), name)


def test_ollama_template_is_derived_for_the_common_families():
    derived = {name for name in original_templates() if derive(tokenizer_for(name)) is not None}
    assert {"llama3", "qwen2_5", "qwen3", "phi3", "phi3_5", "gemma", "gemma3", "cohere", "lfm2"} <= derived
    # a template that prints today's date (Llama 3.1/3.2) or rewrites turns by position has no faithful TEMPLATE
    assert {"llama3_1", "llama3_2", "gptoss"}.isdisjoint(derived)


@pytest.mark.skipif(not PHI3.is_dir(), reason="../shared/fixtures/phi-3-mini is absent")
def test_ollama_template_for_the_real_phi3_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(PHI3))
    assert _ollama_check(tokenizer, "phi-3-mini")
    go = derive(tokenizer).go()
    assert "<|endoftext|>" not in go and '{{ if eq .Role "user" }}<|user|>\n{{ .Content }}<|end|>\n<|assistant|>\n' in go


def test_go_renderer_on_ollama_documented_template():
    """The test renderer itself, on the Llama 3 TEMPLATE from Ollama's docs (trim markers included)."""
    template = ("{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>\n{{- end }}\n"
                "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
                "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n")
    out = render_ollama(template, [{"role": "system", "content": "S"}, user("hi"), user("again")])
    assert out == ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>system<|end_header_id|>"
                   "\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi\n\nagain<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


# ---------------------------------------------------------------- where chat and generate stop

@pytest.mark.parametrize("family, eos, turn_end", [("qwen2_5", "<|endoftext|>", "<|im_end|>"),
                                                   ("llama3", "<|eom_id|>", "<|eot_id|>"),
                                                   ("phi3", "<|endoftext|>", "<|end|>")])
def test_generation_stops_at_the_templates_end_of_turn_when_eos_is_another_token(family, eos, turn_end):
    """Checkpoints whose tokenizer eos is not the token that ends an assistant turn (Qwen2.5 base: <|endoftext|>):
    generation must stop on the end-of-turn token too, and on the model's own generation_config eos ids."""
    import types

    from praisonai_accel.models.inference import stop_token_ids

    tokenizer = tokenizer_for(family)
    tokenizer.eos_token = eos
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[7, tokenizer.eos_token_id]))
    stops = stop_token_ids(model, tokenizer)
    assert tokenizer.convert_tokens_to_ids(turn_end) in stops and tokenizer.eos_token_id in stops and 7 in stops
    assert len(stops) == len(set(stops))


def test_the_real_phi3_tokenizer_stops_at_end(phi3_tokenizer):
    import types

    from praisonai_accel.models.inference import stop_token_ids

    stops = stop_token_ids(types.SimpleNamespace(generation_config=None), phi3_tokenizer)
    assert phi3_tokenizer.convert_tokens_to_ids("<|end|>") in stops and phi3_tokenizer.eos_token_id in stops
