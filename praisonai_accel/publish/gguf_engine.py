"""llama.cpp (llama-cpp-python) in a child process: a GGUF's own tokenizer, its quantizer, generation from it.

llama.cpp's native build can crash (a segmentation fault: on some Intel CPUs its native build uses AMX and
AVX-512), and a crash in our process would take a training run, an export or a test suite down with it. Every call
into llama.cpp therefore runs in a child (`serve`), given its request as JSON on stdin; the parent reads the answer
as JSON, and a child killed by a signal is one line naming the likely cause and the portable build that avoids it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from .gguf_llamacpp import GGUFError, engine_version

_CHILD = "from praisonai_accel.publish.gguf_engine import serve; serve()"


def portable_build_hint() -> str:
    version = engine_version()
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    return (f"CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install --force-reinstall --no-deps --no-cache-dir "
            f"--no-binary llama-cpp-python '{spec}'")


def crash_line(what: str, signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return (f"llama.cpp crashed ({name}) while {what}; the likely cause is its native build, which uses AMX / "
            f"AVX-512 on some Intel CPUs: rebuild it portable with {portable_build_hint()}")


def call(request: dict, what: str, timeout: float | None = None) -> dict:
    """Run one request in a child; its answer, or GGUFError with one line (a crash, or the child's last error)."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(request), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GGUFError(f"llama.cpp did not finish {what} within {timeout:.0f} s") from None
    if done.returncode < 0:
        raise GGUFError(crash_line(what, -done.returncode))
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        raise GGUFError(f"llama.cpp failed {what}: "
                        f"{(errors or lines or [f'exit code {done.returncode}'])[-1].removeprefix('error: ')}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tokenize(files: list, texts: list[str]) -> dict[str, list[list[int]]]:
    """Each file's own tokenizer (its vocabulary alone is loaded) on each text, bos / eos added as the file says
    and special tokens parsed: {file: [ids per text]}."""
    answer = call({"op": "tokenize", "files": [str(f) for f in files], "texts": texts},
                  f"reading the tokenizer of {', '.join(os.path.basename(str(f)) for f in files)}")
    return answer["ids"]


def quantize(source, outfile, method: str) -> None:
    call({"op": "quantize", "source": str(source), "outfile": str(outfile), "method": method},
         f"quantizing to {method.upper()}")


def generate(gguf_file, conversations: list[list[dict]], max_new_tokens: int = 128, temperature: float = 0.0,
             n_ctx: int = 2048) -> list[str]:
    """The reply to each conversation, the prompt rendered with the file's own chat template and tokenizer."""
    answer = call({"op": "generate", "file": str(gguf_file), "conversations": conversations,
                   "max_new_tokens": max_new_tokens, "temperature": temperature, "n_ctx": n_ctx},
                  f"generating from {os.path.basename(str(gguf_file))}")
    return answer["replies"]


# ---------------------------------------------------------------- the child's side


def _tokenize(request: dict) -> dict:
    from llama_cpp import Llama

    ids = {}
    for path in request["files"]:
        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        ids[path] = [llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) for text in request["texts"]]
    return {"ids": ids}


def _quantize(request: dict) -> dict:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{request['method'].upper()}")
    code = llama_cpp.llama_model_quantize(request["source"].encode(), request["outfile"].encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
    return {}


def _generate(request: dict) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = Llama(model_path=request["file"], n_ctx=request["n_ctx"], verbose=False, seed=0,
                n_threads=max(1, min(8, os.cpu_count() or 1)))
    metadata = llm.metadata
    template = metadata.get("tokenizer.chat_template")
    if not template:
        raise RuntimeError(f"{request['file']}: holds no chat template (tokenizer.chat_template)")

    def token(key: str) -> str:
        index = metadata.get(key)
        return llm.detokenize([int(index)], special=True).decode("utf-8", "replace") if index is not None else ""

    formatter = Jinja2ChatFormatter(template, eos_token=token("tokenizer.ggml.eos_token_id"),
                                    bos_token=token("tokenizer.ggml.bos_token_id"))
    replies = []
    for messages in request["conversations"]:
        prompt = formatter(messages=messages).prompt
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)  # as inference.generate: the template's own
        out = llm.create_completion(ids, max_tokens=request["max_new_tokens"], temperature=request["temperature"],
                                    top_k=0 if request["temperature"] else 1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                    seed=0)
        replies.append(out["choices"][0]["text"].strip())
    return {"replies": replies}


OPS = {"tokenize": _tokenize, "quantize": _quantize, "generate": _generate}


def serve() -> None:
    """The child: one JSON request on stdin, one JSON answer as the last line of stdout; llama.cpp's own output
    goes to stderr, so it cannot corrupt the answer."""
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    request = json.loads(sys.stdin.read())
    try:
        answer = OPS[request["op"]](request)
    except Exception as exc:  # the parent turns it into one line
        text = str(exc).strip().splitlines()
        print(f"error: {type(exc).__name__}: {text[0] if text else ''}", file=sys.stderr)
        sys.exit(1)
    with os.fdopen(answer_fd, "w") as out:
        out.write(json.dumps(answer) + "\n")
