"""Multi-turn tool rollouts on token ids (methods/tool_rollout.py, methods/tools.py), in process: per chat-template
family (TRL's verbatim templates), a trajectory's ids and trained mask equal what the template renders for the final
conversation; the model's tokens are kept as sampled; tools that raise, hang, print or answer at length."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from praisonai_accel.demo.text import make_tiny_model
from praisonai_accel.methods.tool_rollout import TemplateTools, padded, run_tool_rollouts
from praisonai_accel.methods.tools import ToolSet, call_tool, schema_of

trl = pytest.importorskip("trl")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"
# family: (TRL's template, the special tokens it uses, its end-of-turn token, the template a trajectory is compared
# with: Qwen3's own drops earlier turns' thinking, so TRL trains Qwen3 with its prefix-preserving training template)
FAMILIES = {
    "qwen2_5": ("qwen2_5", ["<tool_call>", "</tool_call>"], "<|im_end|>", "qwen2_5"),
    "qwen3": ("qwen3", ["<tool_call>", "</tool_call>", "<think>", "</think>"], "<|im_end|>", "qwen3_training"),
    "llama3_1": ("llama3_1", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|python_tag|>", "<|eom_id|>"], "<|eot_id|>", "llama3_1"),
}


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def broken(text: str) -> str:
    """Always fails.

    Args:
        text: Anything.
    """
    raise RuntimeError("the service is down")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def chatty(text: str) -> dict:
    """Prints, and answers at length.

    Args:
        text: What to repeat.
    """
    print("a tool's own output")
    return {"echo": text * 100}


def no_docstring(a: int) -> int:
    return a


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tools") / "tiny")


def family_tokenizer(tiny_dir, family: str):
    from transformers import AutoTokenizer

    template, specials, end, _ = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = end
    return tokenizer


def tool_set(*functions, timeout: float = 5.0, max_length: int = 4096) -> ToolSet:
    schemas = [schema_of(f, f.__name__) for f in functions]
    return ToolSet({f.__name__: f for f in functions}, {}, {None: schemas}, timeout, max_length)


class Scripted:
    """A 'model' whose turn t is the next stretch, up to its end-of-turn token, of `script` (the template's
    rendering of the conversation it should produce): what a model that learnt the template would sample."""

    def __init__(self, script: list[int], stop_id: int):
        self.script, self.stop_id, self.calls = script, stop_id, []

    def __call__(self, inputs, budgets, generators):
        out = []
        for ids, budget in zip(inputs, budgets):
            assert self.script[:len(ids)] == ids, "the rollout's sequence so far is not the template's"
            rest = self.script[len(ids):]
            turn = rest[:rest.index(self.stop_id) + 1]
            out.append((turn[:budget], len(turn) <= budget))
            self.calls.append(len(ids))
        return out


def rendered(tokenizer, messages, schemas, template: str, **kwargs):
    template_text = (TEMPLATES / f"{template}.jinja").read_text()
    text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, chat_template=template_text, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_trajectory_is_the_templates_rendering_of_its_conversation_and_trains_only_the_models_tokens(tiny_dir, family):
    tokenizer = family_tokenizer(tiny_dir, family)
    stop = tokenizer.eos_token_id
    template = TemplateTools(tokenizer, [stop])
    tools = tool_set(add)
    schemas = tools.schemas[None]
    prompt = [{"role": "user", "content": "add 3 and 4, then add 5 to it"}]
    call = lambda a, b: {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}
    conversation = prompt + [call(3, 4), {"role": "tool", "name": "add", "content": "7"}, call(7, 5),
                             {"role": "tool", "name": "add", "content": "12"},
                             {"role": "assistant", "content": "the answer is 12"}]
    compared = FAMILIES[family][3]
    script = rendered(tokenizer, conversation, schemas, compared)
    model = Scripted(script, stop)
    [trajectory] = run_tool_rollouts(model, template, tools, [prompt], [schemas], [None], lambda i, t: None,
                                     max_prompt_length=4096, max_completion_length=4096, max_iterations=None)
    sequence = trajectory.prompt_ids + trajectory.completion
    assert trajectory.ended and trajectory.turns == 3 and trajectory.calls == 2 and trajectory.failures == 0
    # the whole conversation, token for token, up to the last turn's end (templates may add a newline after it)
    assert sequence == script[:len(sequence)] and tokenizer.decode(script[len(sequence):]).strip() == ""
    # trained: exactly each assistant turn as the template renders it after its generation prompt, end token included
    expected = [0] * len(script)
    for k, message in enumerate(conversation):
        if message["role"] == "assistant":
            start = len(rendered(tokenizer, conversation[:k], schemas, compared, add_generation_prompt=True))
            end = script.index(stop, start)
            expected[start:end + 1] = [1] * (end + 1 - start)
    assert [0] * len(trajectory.prompt_ids) + trajectory.trained == expected[:len(sequence)]
    # what the reward functions see: the turns as messages, tool calls parsed with their typed arguments
    assert [m["role"] for m in trajectory.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert trajectory.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 3, "b": 4}}
    assert trajectory.messages[3]["content"] == "12" and trajectory.messages[4]["content"].endswith("the answer is 12")
    tensors = padded([trajectory], tokenizer.pad_token_id, "cpu")
    assert tensors["trained"].sum() == sum(trajectory.trained) and tensors["keep"].sum() == len(trajectory.completion)


def _add_once(tiny_dir):
    """Qwen 2.5's template with the add tool: (tokenizer, stop, template, tools, schemas, the prompt, a turn that
    calls add(1, 2))."""
    tokenizer = family_tokenizer(tiny_dir, "qwen2_5")
    stop = tokenizer.eos_token_id
    template, tools = TemplateTools(tokenizer, [stop]), tool_set(add)
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    return tokenizer, stop, template, tools, tools.schemas[None], [{"role": "user", "content": "add"}], turn


def test_max_tool_calling_iterations_and_the_completion_budget_end_a_rollout(tiny_dir):
    tokenizer, stop, template, tools, schemas, prompt, turn = _add_once(tiny_dir)
    conversation = prompt + [turn, {"role": "tool", "name": "add", "content": "3"}] * 3 + [turn]
    script = rendered(tokenizer, conversation, schemas, "qwen2_5")
    run = lambda **kw: run_tool_rollouts(Scripted(script, stop), template, tools, [prompt], [schemas], [None],
                                         lambda i, t: None, max_prompt_length=4096, **kw)[0]
    once = run(max_completion_length=4096, max_iterations=1)
    assert (once.turns, once.calls, once.iterations) == (2, 1, 1) and once.ended
    none = run(max_completion_length=4096, max_iterations=0)
    assert (none.turns, none.calls) == (1, 0)
    first_turn = len(run(max_completion_length=4096, max_iterations=0).completion)
    # room for the first turn and its result, none for an answer: the result is dropped, as TRL drops overlong ones
    tight = run(max_completion_length=first_turn + 5, max_iterations=None)
    assert tight.turns == 1 and tight.calls == 1 and len(tight.completion) == first_turn
    assert [m["role"] for m in tight.messages] == ["assistant"]


def test_under_fsdp_a_rank_whose_rollouts_ended_keeps_up_with_the_others_turns_and_tokens(tiny_dir):
    from praisonai_accel.methods.generation import sample_completions

    tokenizer, stop, template, tools, schemas, prompt, turn = _add_once(tiny_dir)
    script = rendered(tokenizer, prompt + [turn, {"role": "tool", "name": "add", "content": "3"},
                                            {"role": "assistant", "content": "3"}], schemas, "qwen2_5")

    class SyncedScripted(Scripted):  # the other rank's rollouts go on for two turns after this rank's have ended
        def __init__(self, *args):
            super().__init__(*args)
            self.other_turns, self.kept_up = 4, 0

        def all_done(self, finished: bool) -> bool:
            self.other_turns -= 1
            return finished and self.other_turns < 0

        def keep_up(self):
            self.kept_up += 1

    synced = SyncedScripted(script, stop)
    [alone] = run_tool_rollouts(Scripted(script, stop), template, tools, [prompt], [schemas], [None],
                                lambda i, t: None, max_prompt_length=4096, max_completion_length=4096,
                                max_iterations=None)
    [kept] = run_tool_rollouts(synced, template, tools, [prompt], [schemas], [None], lambda i, t: None,
                               max_prompt_length=4096, max_completion_length=4096, max_iterations=None)
    assert synced.kept_up == 2 and (kept.completion, kept.trained) == (alone.completion, alone.trained)

    # within a turn: a rank whose budget (3 tokens) is spent runs forwards until the other rank's rows are done
    forwards, others = [], iter([False] * 5 + [True])

    def forward(ids, mask, positions, past):
        forwards.append(ids.shape)
        return torch.zeros(ids.size(0), 10), None

    tokens, keep, ended = sample_completions(
        forward, torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), max_new_tokens=3,
        temperature=1.0, top_p=1.0, stop_ids=[99], pad_id=0, generators=[torch.Generator().manual_seed(0)] * 2,
        all_done=lambda finished: finished and next(others))
    assert tokens.shape == (2, 3) and keep.all() and not ended.any()
    assert len(forwards) == 1 + 2 + 5  # the prompt, its own next two tokens, then one a token until the other is done


def test_the_kv_cache_carried_across_turns_samples_what_prefilling_each_turn_again_samples(tiny_dir):
    from transformers import AutoModelForCausalLM

    from grpo_reference import model_forward
    from praisonai_accel.methods.tool_rollout import PolicySampler

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    pad, stop = 0, 5

    widths = []

    def forward(ids, mask, positions, past):
        widths.append(ids.shape[1])
        return model_forward(model)(ids, mask, positions, past)

    def sampler():
        return PolicySampler(forward, temperature=1.0, top_p=1.0, stop_ids=[stop], pad_id=pad,
                             device=torch.device("cpu"))

    def generators(seed):
        return [torch.Generator().manual_seed(seed + i) for i in range(3)]

    carried = sampler()
    prompts = [[7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    first = carried(prompts, [6, 6, 6], generators(0))
    assert carried.carried is not None
    # rows leave between turns (the second ended), the others go on with their turn and a tool result after it
    inputs = [prompts[i] + first[i][0] + suffix for i, suffix in ((0, [20, 21, 22]), (2, [23]))]
    widths.clear()
    again = carried(inputs, [8, 8], generators(100)[:2])
    prefilled = widths[0]
    fresh = sampler()(inputs, [8, 8], generators(100)[:2])
    assert again == fresh
    # only what is new was prefilled: the last sampled token and the tool result, not the conversation again
    assert prefilled <= 1 + 3 < min(len(ids) for ids in inputs)
    # what the cache holds is what each row's ids were, up to the last token it was fed
    held = carried.carried.rows()
    assert all(inputs[i] + again[i][0][:len(held[i]) - len(inputs[i])] == held[i] for i in range(2))
    # an input that extends no cached row starts over (FSDP2's throwaway turn, a new batch)
    assert carried([[30, 31]], [2], generators(5)[:1]) == sampler()([[30, 31]], [2], generators(5)[:1])


def test_a_tool_that_raises_hangs_prints_or_answers_at_length_reads_as_its_result_and_is_counted(capsys, caplog):
    functions = {f.__name__: f for f in (add, broken, slow, chatty)}
    call = lambda name, **arguments: {"type": "function", "function": {"name": name, "arguments": arguments}}
    assert call_tool(functions, call("add", a=2, b=3), 5, 100) == ("add", "5", False)
    assert call_tool(functions, call("broken", text="x"), 5, 100) == ("broken", "{'error': 'the service is down'}", True)
    started = time.monotonic()
    name, text, failed = call_tool(functions, call("slow", seconds=30), 0.3, 100)
    assert failed and "did not answer within 0.3 seconds" in text and time.monotonic() - started < 5
    assert call_tool(functions, call("missing"), 5, 100) == ("missing", "{'error': 'Tool missing not found.'}", True)
    name, text, failed = call_tool(functions, call("add", a=1), 5, 100)  # a required argument left out
    assert failed and "error" in text
    from praisonai_accel.methods.tools import route_tool_output

    route_tool_output()
    name, text, failed = call_tool(functions, call("chatty", text="abc"), 5, 40)
    assert not failed and text.startswith('{"echo": "abcabc') and "cut at max_tool_result_length: 40" in text
    assert len(text.split("...")[0]) == 40
    assert "a tool's own output" not in capsys.readouterr().out


def test_bad_tool_definitions_are_one_line_before_launch(tmp_path):
    from praisonai_accel.config import ConfigError
    from praisonai_accel.methods.tools import load_tools

    (tmp_path / "agent_tools.py").write_text(
        "def untyped(a):\n    '''Doc.\n\n    Args:\n        a: x\n    '''\n    return a\n\n"
        "def nodoc(a: int) -> int:\n    return a\n\n"
        "def add(a: int) -> int:\n    '''Add.\n\n    Args:\n        a: x\n    '''\n    return a\n\n"
        "class Env:\n    def reset(self, **row):\n        return None\n\n    def add(self, a: int) -> int:\n        '''Add.\n\n        Args:\n            a: x\n        '''\n"
        "        return a\n\nclass NoReset:\n    pass\n")

    class Config:
        tools, environment_factory, tool_timeout, max_tool_result_length = None, None, 5.0, 100

    def error(**keys) -> str:
        config = Config()
        for key, value in keys.items():
            setattr(config, key, value)
        with pytest.raises(ConfigError) as caught:
            load_tools(config, tmp_path)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "tools[0]: agent_tools:untyped" in error(tools=["agent_tools:untyped"])
    assert "docstring" in error(tools=["agent_tools:nodoc"]).lower()
    assert "listed already" in error(tools=["agent_tools:add", "agent_tools:add"])
    assert "has the name of a tool" in error(tools=["agent_tools:add"], environment_factory="agent_tools:Env")
    assert "no reset()" in error(environment_factory="agent_tools:NoReset")
    assert "no module named 'nowhere'" in error(tools=["nowhere:add"])


def test_the_agent_example_loads_its_tools_environment_and_rewards_and_its_rows_play_out(tmp_path, monkeypatch):
    """examples/agent as a user runs it, short of the 0.5B model: its config, tools (a plain function and an
    environment's methods), reward functions (one reads the environments) and generated rows work together."""
    import importlib.util
    import sys

    from praisonai_accel.config import load_config
    from praisonai_accel.methods.rewards import load_reward_functions, score
    from praisonai_accel.methods.tool_rollout import Environments
    from praisonai_accel.methods.tools import load_tools, tool_functions

    example = Path(__file__).resolve().parents[1] / "examples" / "agent"
    for name in ("tools", "rewards"):  # another test's rewards.py, imported in this process, is not the example's
        monkeypatch.delitem(sys.modules, name, raising=False)
    config = load_config(example / "config.yaml")
    tools = load_tools(config)
    assert [s["function"]["name"] for s in tools.schemas[None]] == ["multiply", "in_stock", "price"]
    functions = load_reward_functions(config)
    sys.path.insert(0, str(example))
    try:
        spec = importlib.util.spec_from_file_location("make_data", example / "make_data.py")
        make_data = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(make_data)
        rows = make_data.rows(4, seed=1)
    finally:
        sys.path.remove(str(example))
    environments, observations = Environments(tools).reset(rows)
    assert observations == [None] * 4 and len({id(e) for e in environments}) == 4
    row, shop = rows[0], environments[0]
    words = row["prompt"][0]["content"].split()  # "I want N item. ..."
    wanted, item = int(words[2]), words[3].rstrip(".")
    call = lambda name, **arguments: {"type": "function", "function": {"name": name, "arguments": arguments}}
    present = tool_functions(tools, shop)
    _, count, failed = call_tool(present, call("in_stock", item=item), 5, 100)
    assert not failed and int(count) == row["stock"][item]
    _, price, _ = call_tool(present, call("price", item=item), 5, 100)
    _, total, _ = call_tool(present, call("multiply", a=float(price), b=min(int(count), wanted)), 5, 100)
    assert abs(float(total) - float(row["answer"])) < 0.01
    trajectory = [{"role": "assistant", "content": f"You pay {total}"}]
    rewards = score(functions, [r["prompt"] for r in rows], [trajectory] * 4, [[1]] * 4,
                    {"answer": [r["answer"] for r in rows]}, [0, 1, 2, 3], None, {"environments": environments})
    assert rewards[0].tolist() == [1.0, 1.0] and rewards[1, 1] == 0.0  # only the first shop was asked


class Counter:
    def reset(self, start: int = 0, **row):
        self.value = start
        return f" (the counter shows {start})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.value += by
        return self.value


class Echo:
    def reset(self, **row):
        return None

    def echo(self, text: str) -> str:
        """Say it back.

        Args:
            text: What to say.
        """
        return text


def test_environments_are_picked_per_row_reset_with_it_and_offer_only_their_own_tools(tiny_dir):
    from praisonai_accel.methods.tool_rollout import Environments, with_observation

    tokenizer = family_tokenizer(tiny_dir, "qwen2_5")
    stop = tokenizer.eos_token_id
    counter, echo = schema_of(Counter.increment, "increment"), schema_of(Echo.echo, "echo")
    tools = ToolSet({}, {"counter": Counter, "echo": Echo}, {"counter": [counter], "echo": [echo]}, 5.0, 100)
    rows = [{"prompt": [{"role": "user", "content": "count"}], "environment": "counter", "start": 5},
            {"prompt": [{"role": "user", "content": "say hi"}], "environment": "echo"}]
    pool = Environments(tools)
    environments, observations = pool.reset(rows)
    assert [type(e) for e in environments] == [Counter, Echo] and observations == [" (the counter shows 5)", None]
    assert pool.reset(rows)[0][0] is environments[0]  # made once, reset often
    prompts = [with_observation(r["prompt"], o) for r, o in zip(rows, observations)]
    assert prompts[0][0]["content"] == "count (the counter shows 5)" and rows[0]["prompt"][0]["content"] == "count"
    schemas = [tools.schemas[pool.name_of(r)] for r in rows]
    call = lambda name, **arguments: {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}
    conversations = [prompts[0] + [call("increment", by=2), {"role": "tool", "name": "increment", "content": "7"},
                                   {"role": "assistant", "content": "7"}],
                     prompts[1] + [call("increment", by=1), {"role": "tool", "name": "increment",
                                                             "content": "{'error': 'Tool increment not found.'}"},
                                   {"role": "assistant", "content": "sorry"}]]
    scripts = [rendered(tokenizer, c, s, "qwen2_5") for c, s in zip(conversations, schemas)]

    class TwoScripts:
        def __call__(self, inputs, budgets, generators):
            out = []
            for ids in inputs:
                script = next(s for s in scripts if s[:len(ids)] == ids)
                rest = script[len(ids):]
                out.append((rest[:rest.index(stop) + 1], True))
            return out

    trajectories = run_tool_rollouts(TwoScripts(), TemplateTools(tokenizer, [stop]), tools, prompts, schemas,
                                     environments, lambda i, t: None, max_prompt_length=4096,
                                     max_completion_length=4096, max_iterations=None)
    assert environments[0].value == 7  # the counter's own method ran, on that rollout's counter
    assert [(t.calls, t.failures) for t in trajectories] == [(1, 0), (1, 1)]  # echo's row cannot call increment
    assert "increment" in tokenizer.decode(trajectories[0].prompt_ids)
    assert "increment" not in tokenizer.decode(trajectories[1].prompt_ids)
