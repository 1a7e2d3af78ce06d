"""GGUF export, read back by real GGUF engines: llama.cpp (llama-cpp-python) and transformers' GGUF loader.

Models are tiny, with the real Phi-3 tokenizer, in two architectures, each with a LoRA adapter of non-zero weights;
and the demo's model, whose tokenizer was trained on the spot. llama.cpp itself only ever runs in child processes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PHI3, cli, cpu_env, write_config

ENGINE = importlib.util.find_spec("llama_cpp") is not None
needs_engine = pytest.mark.skipif(not ENGINE, reason="llama-cpp-python is not installed (pip install 'praisonai-accel[gguf]')")
ARCHITECTURES = ("llama", "qwen3")
# Measured on these models (README, "Export"), logits of standard deviation 0.8: f16 within 7e-3 of the float32
# logits, q8_0 within 0.14 (llama.cpp also rounds the activations to 8 bits in its q8_0 matrix products).
F16_TOLERANCE, Q8_TOLERANCE = 1.5e-2, 0.3
PROMPTS = ["reverse the words: ada bob cy", "add 3 and 4", "what colour does eve like?"]


@pytest.fixture(scope="module")
def converter():
    from praisonai_accel.publish.gguf_llamacpp import GGUFError, find_converter

    try:
        return find_converter(fetch=False)
    except GGUFError as exc:
        pytest.skip(f"llama.cpp's converter is not here ({exc}); set LLAMA_CPP_CONVERTER (.ci/run does)")


def make_phi3_model(directory: Path, architecture: str, seed: int = 0) -> Path:
    """A 2-layer random model of a real architecture around the real Phi-3 tokenizer."""
    import torch
    import transformers as tf

    if not PHI3.is_dir():
        pytest.skip("../shared/fixtures/phi-3-mini is absent")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(PHI3))
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id, initializer_range=0.1)
    torch.manual_seed(seed)
    if architecture == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    else:
        # head_dim 128 as in every Qwen3 checkpoint: transformers' GGUF loader ignores qwen3.attention.key_length
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=128))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def make_adapter(base: Path, directory: Path) -> Path:
    """A LoRA adapter whose A and B are both random, so merging changes every projection."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    peft_model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(directory)
    return Path(directory)


def merged_reference(adapter: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()
    return model, AutoTokenizer.from_pretrained(str(adapter))


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


# llama.cpp is never loaded in the pytest process (its native build can crash on some CPUs, and a crash there would
# end the whole run): one child reads every file and writes what the tests compare.
READ_WITH_LLAMA_CPP = """
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
request = json.load(open(sys.argv[1]))
answers, logits = {}, {}
for method, path in request["files"].items():
    llm = Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)
    for i, (text, ids) in enumerate(zip(request["texts"], request["ids"])):
        llm.reset()
        llm.eval(ids)
        logits[f"{method}-{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
        answers[f"{method}-{i}-tokens"] = llm.tokenize(text.encode(), add_bos=False, special=True)
        produced = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            produced.append(token)
            if len(produced) == 8:
                break
        answers[f"{method}-{i}-generated"] = produced
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    answers[f"{method}-eog"] = [bool(llama_cpp.llama_vocab_is_eog(vocab, t)) for t in request["eog"]]
    answers[f"{method}-talk"] = llm.tokenize(request["talk"].encode(), add_bos=True, special=True)
np.savez(sys.argv[2], **logits)
json.dump(answers, open(sys.argv[3], "w"))
"""
TALK = [{"role": "system", "content": "Be brief.  Naïve café, 3.14 🦙"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "ada\nbob\tcy"}]


def read_with_llama_cpp(directory: Path, files: dict, tokenizer) -> tuple[dict, dict]:
    import numpy as np

    texts = [chat_prompt(tokenizer, prompt) for prompt in PROMPTS]
    request = {"files": {m: str(f) for m, f in files.items()}, "texts": texts,
               "ids": [tokenizer(t, add_special_tokens=False).input_ids for t in texts],
               "eog": [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id],
               "talk": tokenizer.apply_chat_template(TALK, tokenize=False, add_generation_prompt=True)}
    (directory / "request.json").write_text(json.dumps(request))
    done = subprocess.run([sys.executable, "-c", READ_WITH_LLAMA_CPP, str(directory / "request.json"),
                           str(directory / "logits.npz"), str(directory / "answers.json")], capture_output=True, text=True)
    assert done.returncode == 0, f"llama.cpp's reader exited with {done.returncode}: {done.stderr[-2000:]}"
    with np.load(directory / "logits.npz") as logits:
        return {k: logits[k].astype(np.float64) for k in logits.files}, json.loads((directory / "answers.json").read_text())


@pytest.fixture(scope="module", params=ARCHITECTURES)
def exported(request, tmp_path_factory, converter):
    """f16 and q8_0 of a merged adapter, written by `praisonai-accel export gguf`, and what llama.cpp reads in them."""
    if not ENGINE:
        pytest.skip("llama-cpp-python is not installed (pip install 'praisonai-accel[gguf]')")
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    base = make_phi3_model(root / "base", request.param)
    adapter = make_adapter(base, root / "lora_model")
    result = cli("export", "gguf", str(adapter), "-q", "f16", "-q", "q8_0", "--out", str(root / "gguf"),
                 env=cpu_env(LLAMA_CPP_CONVERTER=str(converter)))
    assert result.returncode == 0, result.stderr[-3000:]
    files = {m: root / "gguf" / f"lora_model-{m.upper()}.gguf" for m in ("f16", "q8_0")}
    assert all(f.is_file() for f in files.values()), result.stdout
    model, tokenizer = merged_reference(adapter)
    logits, answers = read_with_llama_cpp(root, files, tokenizer)
    return request.param, files, model, tokenizer, logits, answers


def torch_logits(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


@needs_engine
def test_llama_cpp_reads_f16_and_q8_0_with_the_merged_models_logits_and_tokens(exported):
    architecture, files, model, tokenizer, llama_logits, answers = exported
    for i, prompt in enumerate(PROMPTS):
        text = chat_prompt(tokenizer, prompt)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        expected = torch_logits(model, ids)
        for method, tolerance in (("f16", F16_TOLERANCE), ("q8_0", Q8_TOLERANCE)):
            logits = llama_logits[f"{method}-{i}"]
            # the GGUF's own tokenizer splits the chat-formatted prompt exactly as the Phi-3 tokenizer does
            assert answers[f"{method}-{i}-tokens"] == ids, (architecture, method, prompt)
            error = abs(logits - expected).max()
            assert error < tolerance, (architecture, method, prompt, error)
            top = expected[range(len(ids)), logits.argmax(-1)]  # the merged model's logit for llama.cpp's first choice
            assert (top >= expected.max(-1) - (0 if method == "f16" else tolerance)).all(), (architecture, method, prompt)


@needs_engine
def test_greedy_generation_gives_the_same_tokens_as_the_merged_model(exported):
    """f16: the same tokens. q8_0: each token llama.cpp picks is the merged model's first choice, or within the q8_0
    bound of it (a random-weight model has near-ties that 8-bit rounding may order either way)."""
    import numpy as np
    import torch

    architecture, files, model, tokenizer, _, answers = exported
    for method in ("f16", "q8_0"):
        for i, prompt in enumerate(PROMPTS):
            ids = tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False).input_ids
            produced = answers[f"{method}-{i}-generated"]
            assert len(produced) == 8, (architecture, method, prompt)
            if method == "f16":
                with torch.no_grad():
                    reference = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                               pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
                assert produced == reference, (architecture, prompt)
            else:
                logits = torch_logits(model, ids + produced)[len(ids) - 1: -1]
                chosen = logits[np.arange(len(produced)), produced]
                assert (chosen >= logits.max(-1) - Q8_TOLERANCE).all(), (architecture, prompt)


@needs_engine
def test_chat_template_stop_tokens_and_tokenizer_are_in_the_metadata(exported):
    architecture, files, _, tokenizer, _, answers = exported
    from gguf import GGUFReader

    reader = GGUFReader(str(files["f16"]))
    field = lambda key: reader.fields[key].contents()
    assert field("tokenizer.chat_template") == tokenizer.chat_template
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field("tokenizer.ggml.eot_token_id") == end  # where the template ends a reply, besides eos
    assert field("tokenizer.ggml.model") == "llama" and len(field("tokenizer.ggml.tokens")) == len(tokenizer)
    assert field("tokenizer.ggml.add_bos_token") is False and field("tokenizer.ggml.add_space_prefix") is False
    for method in ("f16", "q8_0"):
        assert answers[f"{method}-eog"] == [True, True]  # <|end|> and eos end llama.cpp's generation
        # bos as the tokenizer adds it (Phi-3: not at all); a system turn and two user turns split as in training
        text = tokenizer.apply_chat_template(TALK, tokenize=False, add_generation_prompt=True)
        assert answers[f"{method}-talk"] == tokenizer(text).input_ids


def test_transformers_gguf_loader_reads_the_f16_file_back(exported):
    import numpy as np
    from transformers import AutoModelForCausalLM

    architecture, files, model, tokenizer, _, _ = exported
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("gguf (gguf-py) is not installed")
    import torch

    again = AutoModelForCausalLM.from_pretrained(str(files["f16"].parent), gguf_file=files["f16"].name,
                                                 dtype=torch.float32).eval()
    ids = tokenizer(chat_prompt(tokenizer, PROMPTS[0]), add_special_tokens=False).input_ids
    error = np.abs(torch_logits(again, ids) - torch_logits(model, ids)).max()
    assert error < F16_TOLERANCE, (architecture, error)


@needs_engine
def test_k_quants_come_from_llama_cpps_quantizer(tmp_path, converter):
    from gguf import GGUFReader

    base = make_phi3_model(tmp_path / "base", "llama")
    result = cli("export", "gguf", str(base), "-q", "q4_k_m", "-q", "q5_0", "--out", str(tmp_path / "out"),
                 env=cpu_env(LLAMA_CPP_CONVERTER=str(converter)))
    assert result.returncode == 0, result.stderr[-3000:]
    for method, ftype in (("q4_k_m", 15), ("q5_0", 8)):
        reader = GGUFReader(str(tmp_path / "out" / f"base-{method.upper()}.gguf"))
        assert reader.fields["general.file_type"].contents() == ftype
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".praisonai-accel.json", "base-Q4_K_M.gguf",
                                                                     "base-Q5_0.gguf"]  # no 16-bit leftovers


QLORA_CHECK = """
import json, sys, torch, bitsandbytes.functional as F
from gguf import GGUFReader
from safetensors.torch import load_file
base, adapter, gguf = sys.argv[1:]
W = load_file(base + "/model.safetensors")["model.layers.0.self_attn.v_proj.weight"].float()
lora = load_file(adapter + "/adapter_model.safetensors")
key = "base_model.model.model.layers.0.self_attn.v_proj.lora_{}.weight"
scale = json.load(open(adapter + "/adapter_config.json"))
delta = lora[key.format("B")].float() @ lora[key.format("A")].float() * scale["lora_alpha"] / scale["r"]
packed, state = F.quantize_4bit(W, quant_type="nf4", compress_statistics=True)
dequantized = F.dequantize_4bit(packed, state).float()
tensor = next(t for t in GGUFReader(gguf).tensors if t.name == "blk.0.attn_v.weight")
written = torch.tensor(tensor.data.astype("float32")).reshape(W.shape)
print(json.dumps({"dequantized": float((written - dequantized - delta).abs().max()),
                  "original": float((written - W - delta).abs().max())}))
"""


def test_a_qlora_adapter_is_merged_onto_the_dequantized_4bit_base_it_was_trained_on(tmp_path, converter):
    from conftest import BNB_DIR

    env = cpu_env(LLAMA_CPP_CONVERTER=str(converter), PYTHONPATH=os.pathsep.join([str(BNB_DIR), os.environ.get("PYTHONPATH", "")]))
    if subprocess.run([sys.executable, "-c", "import bitsandbytes"], env=env, capture_output=True).returncode != 0:
        pytest.skip("bitsandbytes is not installed (pip install --target .bnb bitsandbytes)")
    base = make_phi3_model(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "lora_model")
    result = cli("export", "gguf", str(adapter), "-q", "f16", "--dequantize-base", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    gguf = tmp_path / "lora_model-gguf" / "lora_model-F16.gguf"
    check = subprocess.run([sys.executable, "-c", QLORA_CHECK, str(base), str(adapter), str(gguf)], env=env,
                           capture_output=True, text=True)
    errors = json.loads(check.stdout)
    # f16 rounding only, against the NF4 weights QLoRA trained with; far from the original weights
    assert errors["dequantized"] < 2e-3 and errors["original"] > 10 * errors["dequantized"], errors


# ---------------------------------------------------------------- bad input: one line, before anything heavy


def test_unknown_quantization_method_is_one_line(tmp_path, tiny_model):
    result = cli("export", "gguf", str(tiny_model), "-q", "q4km", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: quantization_method: 'q4km' is not a GGUF quantization; use one of q4_k_m, "
                                     "q5_k_m, q8_0, q4_0, q4_1, q5_0, q5_1, q3_k_m, q6_k, q2_k, f16, bf16")
    assert not (tmp_path / "out").exists()


def test_a_missing_converter_is_one_line(tmp_path, tiny_model):
    result = cli("export", "gguf", str(tiny_model), "-q", "f16", env=cpu_env(LLAMA_CPP_CONVERTER=str(tmp_path)))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: LLAMA_CPP_CONVERTER={tmp_path}: holds no convert_hf_to_gguf.py with gguf-py/ "
                                     "beside it (point it at a llama.cpp checkout or a llama-cpp-python source .tar.gz)")


def test_an_architecture_the_converter_does_not_know_is_one_line(tmp_path, tiny_model, converter):
    import shutil

    model = tmp_path / "odd"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = cli("export", "gguf", str(model), "-q", "f16", env=cpu_env(LLAMA_CPP_CONVERTER=str(converter)))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: MadeUpForCausalLM: llama.cpp's converter (")
    assert result.stderr.strip().endswith("does not know this architecture; it cannot be exported to GGUF")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "odd-gguf").exists()


@needs_engine
def test_an_export_whose_tokenizer_is_not_the_models_fails_in_one_line_and_leaves_nothing(tmp_path, converter):
    """Issue 45: without protobuf, tokenizer.model cannot be rebuilt for the Phi-3 vocabulary and the converter falls
    back to one that splits words differently; the file's own tokenizer, read back by llama.cpp, gives it away."""
    from conftest import fault_env

    base = make_phi3_model(tmp_path / "base", "llama")
    result = cli("export", "gguf", str(base), "-q", "f16", "-q", "q4_k_m",
                 env=fault_env(cpu_env(LLAMA_CPP_CONVERTER=str(converter)), HIDE_MODULE="google.protobuf"))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if not line.startswith("gguf: ")]
    assert line.startswith("error: base-F16.gguf: llama.cpp's tokenizer in the GGUF does not encode '<|"), line
    assert "as the model's tokenizer does (" in line and line.endswith(
        "nothing was written (missing: protobuf; pip install 'praisonai-accel[gguf]')"), line
    assert not (tmp_path / "base-gguf").exists()  # not even the folder the export made


@needs_engine
def test_export_gguf_of_a_run_checks_the_tokenizer_on_the_runs_own_rows(tmp_path, converter):
    """`export gguf` of a trained adapter finds its run's config (progress.json names the config file)
    and renders the chat template on the first rows of its data, as the export after training does; those texts come
    first. With protobuf hidden, the converter's fallback vocabulary splits 'reverse' differently, so the text named
    is the run's row, not the built-in conversation (which a bare model's export names)."""
    from conftest import fault_env

    base = make_phi3_model(tmp_path / "base", "llama")
    rows = [{"instruction": "reverse the words", "input": "quokka zephyr", "output": "zephyr quokka"}] * 8
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = write_config(tmp_path, base, data, max_steps=1, per_device_train_batch_size=2, logging_steps=1)
    trained = cli("train", str(config), "--cpu", "--num-processes", "1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = cli("export", "gguf", str(tmp_path / "out" / "lora_model"), "-q", "f16",
                 env=fault_env(cpu_env(LLAMA_CPP_CONVERTER=str(converter)), HIDE_MODULE="google.protobuf"))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if not line.startswith("gguf: ")]
    assert line.startswith("error: lora_model-F16.gguf: llama.cpp's tokenizer in the GGUF does not encode "
                           "'<|user|>\\nreverse the words\\n\\nquokka zephyr<|end|>"), line
    assert not (tmp_path / "out" / "lora_model-gguf").exists()


@needs_engine
def test_a_crash_inside_llama_cpp_is_one_line_and_the_export_process_lives(tmp_path, tiny_model, converter):
    """llama.cpp runs in a child: a segmentation fault there (tests/faults) is one line naming the likely cause and
    the portable build, the CLI exits 2 itself, and no folder is left."""
    from conftest import fault_env

    out = tmp_path / "deep" / "out"
    result = cli("export", "gguf", str(tiny_model), "-q", "f16", "--out", str(out),
                 env=fault_env(cpu_env(LLAMA_CPP_CONVERTER=str(converter)), LLAMA_CPP_CRASH="tokenize"))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if not line.startswith("gguf: ")]
    assert line.startswith("error: llama.cpp crashed (SIGSEGV) while reading the tokenizer of tiny-llama-F16.gguf; "
                           "the likely cause is its native build, which uses AMX / AVX-512 on some Intel CPUs: "
                           "rebuild it portable with CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install --force-reinstall"), line
    assert not (tmp_path / "deep").exists()
    gguf = tmp_path / "any.gguf"
    gguf.write_bytes(b"GGUF")
    result = cli("generate", str(gguf), "-p", "hi", env=fault_env(cpu_env(), LLAMA_CPP_CRASH="generate"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: llama.cpp crashed (SIGSEGV) while generating from any.gguf; ")
    assert len(result.stderr.strip().splitlines()) == 1


@needs_engine
def test_demo_then_export_gguf_then_generate_from_it_offline(tmp_path, converter):
    """The demo's tokenizer (trained on the spot, GPT-2's byte-level pre-tokenizer, a hash llama.cpp's converter cannot
    know) is named to the converter: the trained demo model exports, its GGUF's tokenizer checks out, and llama.cpp's
    greedy answers are the safetensors model's."""
    from praisonai_accel.demo.text import task_records

    env = cpu_env(LLAMA_CPP_CONVERTER=str(converter))
    demo = cli("demo", "--dir", str(tmp_path / "demo"), "--num-processes", "1", "--steps", "120", env=env, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    model = tmp_path / "demo" / "outputs" / "model"
    result = cli("export", "gguf", str(model), "-q", "f16", "-q", "q8_0", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    gguf = tmp_path / "demo" / "outputs" / "model-gguf" / "model-F16.gguf"
    assert f"wrote {gguf}" in result.stdout
    prompts = [f"{r['instruction']}\n\n{r['input']}" for r in task_records(4, seed=7)]
    args = [arg for prompt in prompts for arg in ("-p", prompt)]
    from_gguf = cli("generate", str(gguf), *args, "--max-new-tokens", "12", env=env)
    from_safetensors = cli("generate", str(model), *args, "--max-new-tokens", "12", env=env)
    assert from_gguf.returncode == 0 and from_safetensors.returncode == 0, from_gguf.stderr[-2000:]
    answers = from_gguf.stdout.splitlines()
    assert len(answers) == 4 and answers == from_safetensors.stdout.splitlines(), (answers, from_safetensors.stdout)
    assert any(answer == r["output"] for answer, r in zip(answers, task_records(4, seed=7))), answers


def test_an_output_folder_of_the_users_is_never_written_into(tmp_path, tiny_model, converter):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = cli("export", "gguf", str(tiny_model), "-q", "f16", "--out", str(out),
                 env=cpu_env(LLAMA_CPP_CONVERTER=str(converter)))
    assert result.returncode == 2 and "already holds files that praisonai-accel did not write" in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_config_keys_are_praisonai_trains(tmp_path):
    from praisonai_accel.config import ConfigError, load_config

    def config(**keys):
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps({"model_name": "m", "dataset": [{"name": "d"}], **keys}))
        return load_config(path)

    assert config().quantization_method == ["q4_k_m"]
    assert config(quantization_method="Q8_0").quantization_method == ["q8_0"]
    assert config(quantization_method=["q4_k_m", "q8_0", "q4_k_m"]).quantization_method == ["q4_k_m", "q8_0"]
    with pytest.raises(ConfigError, match="quantization_method: 'q4km' is not a GGUF quantization"):
        config(quantization_method="q4km", save_gguf=True)
    with pytest.raises(ConfigError, match="hub_model_id: required when huggingface_save_gguf is true"):
        config(huggingface_save_gguf=True)
    with pytest.raises(ConfigError, match="ollama_save: needs ollama_model"):
        config(ollama_save=True)
    assert config(hf_model_name="me/m", huggingface_save_gguf=True).hub_model_id == "me/m"
    # changing what is exported after training does not make a resumed run another run
    assert config(save_gguf=True, quantization_method="q8_0").run_fingerprint() == config().run_fingerprint()


def test_train_refuses_save_gguf_without_a_converter_before_launch(tmp_path, tiny_model, alpaca_file):
    path = write_config(tmp_path, tiny_model, alpaca_file, save_gguf=True, quantization_method="q8_0")
    result = cli("train", str(path), "--cpu", env=cpu_env(LLAMA_CPP_CONVERTER=str(tmp_path / "nowhere")))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: LLAMA_CPP_CONVERTER={tmp_path / 'nowhere'}: holds no convert_hf_to_gguf.py with gguf-py/ beside it "
        "(point it at a llama.cpp checkout or a llama-cpp-python source .tar.gz)"]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- at the end of training, and to Ollama


@needs_engine
def test_training_ends_with_a_gguf_and_an_ollama_model_from_it(tmp_path, alpaca_file, converter):
    from fake_servers import FakeOllama

    base = make_phi3_model(tmp_path / "base", "qwen3")
    path = write_config(tmp_path, base, alpaca_file, max_steps=2, save_gguf=True, quantization_method=["q8_0"],
                        ollama_save=True, ollama_model="tiny-qwen3:q8")
    with FakeOllama() as ollama:
        result = cli("train", str(path), "--cpu", env=cpu_env(LLAMA_CPP_CONVERTER=str(converter), OLLAMA_HOST=ollama.url))
        assert result.returncode == 0, result.stderr[-3000:]
        gguf = tmp_path / "out" / "gguf" / "lora_model-Q8_0.gguf"
        assert gguf.is_file()
        modelfile = (gguf.parent / "Modelfile").read_text()
        assert modelfile.startswith(f"FROM {gguf}\n")
        assert 'PARAMETER stop "<|end|>"' in modelfile and "TEMPLATE" in modelfile
        (create,) = ollama.creates()
        assert create["model"] == "tiny-qwen3:q8" and list(create["files"]) == ["lora_model-Q8_0.gguf"]
        assert create["files"]["lora_model-Q8_0.gguf"] == "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
        assert "<|end|>" in create["parameters"]["stop"] and "<|assistant|>" in create["template"]
    assert f"wrote {gguf}" in result.stderr and "created Ollama model tiny-qwen3:q8 from lora_model-Q8_0.gguf" in result.stderr
