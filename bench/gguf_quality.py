"""What each GGUF quantization costs, in size and in quality, measured with llama.cpp on a trained model.

    python bench/gguf_quality.py [--steps 250] [--dir /tmp/gguf-bench] [--out bench/results/gguf.json]

A 4-layer Llama (hidden 256: every row a multiple of 256, so the k-quants apply as on a real model) around the
real Phi-3 tokenizer (../shared/fixtures/phi-3-mini) is trained fully on the demo's task (reverse 2 or 3 names),
exported with `praisonai-accel export gguf` to every method, and each file is read by llama.cpp
(llama-cpp-python): its perplexity on the answers of 100 held-out prompts (teacher-forced, the answer and its
<|end|>), and its exact-match accuracy answering them greedily. The float32 PyTorch model is the reference row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from praisonai_accel.config import TrainConfig  # noqa: E402
from praisonai_accel.demo.text import demo_config, demo_prompt, exact_match, task_records, write_jsonl  # noqa: E402

PHI3 = REPO.parent / "shared" / "fixtures" / "phi-3-mini"


def build_model(directory: Path) -> Path:
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(str(PHI3))
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def texts(tokenizer, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids ending with the end-of-turn token) per record."""
    rows = []
    for record in records:
        prompt = tokenizer.apply_chat_template(demo_prompt(record), tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(demo_prompt(record) + [{"role": "assistant", "content": record["output"]}],
                                             tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        full_ids = tokenizer(full, add_special_tokens=False).input_ids
        answer = full_ids[len(prompt_ids):]
        end = tokenizer.convert_tokens_to_ids("<|end|>")
        rows.append((prompt_ids, answer[: answer.index(end) + 1]))
    return rows


def score_gguf(path: Path, rows, tokenizer, records) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)
    nll, count, answers = 0.0, 0, []
    for prompt, answer in rows:
        llm.reset()
        llm.eval(prompt + answer)
        scores = np.array(llm.scores[: len(prompt) + len(answer)], dtype=np.float64)
        for position, target in enumerate(answer):
            row = scores[len(prompt) + position - 1]
            nll -= row[target] - row.max() - np.log(np.exp(row - row.max()).sum())
            count += 1
        llm.reset()
        produced = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if llm.token_eos() == token or len(produced) >= 12 or _is_eog(llm, token):
                break
            produced.append(token)
        answers.append(tokenizer.decode(produced, skip_special_tokens=True).strip())
    return {"perplexity": math.exp(nll / count), "exact_match": exact_match(answers, records)}


def _is_eog(llm, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token))


def score_torch(model_dir: Path, rows, tokenizer, records) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from praisonai_accel.demo.text import held_out_answers

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for prompt, answer in rows:
            logits = model(torch.tensor([prompt + answer])).logits[0].double().log_softmax(-1)
            for position, target in enumerate(answer):
                nll -= float(logits[len(prompt) + position - 1, target])
                count += 1
    answers = held_out_answers(model, tokenizer, records)
    return {"perplexity": math.exp(nll / count), "exact_match": exact_match(answers, records),
            "bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/gguf-bench"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gguf.json")
    parser.add_argument("--train-only", action="store_true", help="stop after training")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    work = args.dir
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    train_rows = task_records(900, seed=0)
    held_out = task_records(100, seed=1, exclude={r["input"] for r in train_rows})
    data = write_jsonl(train_rows, work / "data.jsonl")
    final = work / "outputs" / "model"
    if not final.exists():
        raw = demo_config(model_dir.resolve(), data.resolve(), (work / "outputs").resolve(), max_steps=args.steps,
                          finetune_type="full", final_model_dir="model", max_seq_length=48,
                          per_device_train_batch_size=16, learning_rate=3e-3, warmup_steps=10, logging_steps=50)
        (work / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        subprocess.run([sys.executable, "-m", "praisonai_accel", "train", str(work / "config.yaml"), "--cpu"], env=env,
                       check=True)
    if args.train_only:
        return
    methods = list(TrainConfig.GGUF_METHODS)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "praisonai_accel", "export", "gguf", str(final), "--out", str(work / "gguf"),
                    *[arg for m in methods for arg in ("-q", m)]], env=env, check=True)
    export_seconds = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    rows = texts(tokenizer, held_out)
    results = {"float32 (PyTorch)": score_torch(final, rows, tokenizer, held_out)}
    for method in methods:
        path = work / "gguf" / f"model-{method.upper()}.gguf"
        results[method] = {**score_gguf(path, rows, tokenizer, held_out), "bytes": path.stat().st_size}
    print(f"export of {len(methods)} methods: {export_seconds:.0f} s")
    print("| method | file size | held-out perplexity | held-out exact match |\n|---|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['bytes'] / 2**20:.1f} MiB | {row['perplexity']:.4f} | {row['exact_match']:.0%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"export_seconds": export_seconds, "results": results}, indent=2))


if __name__ == "__main__":
    main()
