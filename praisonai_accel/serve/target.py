"""What `serve TARGET` points at (a .gguf file, a run with GGUF exports, a run, checkpoint or model directory), the
name it is served under, and the engine that serves it."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..evaluate.targets import resolve_target as resolve_eval_target
from ..models.inference import ModelDirError, resolve_model_dir, reward_model_refusal
from ..run_dir.checkpoints import step_of

ENGINES = ("auto", "transformers", "llama-cpp", "vllm")
# best first: what `auto` picks among a run's GGUF exports
GGUF_PREFERENCE = ("f32", "bf16", "f16", "q8_0", "q6_k", "q5_k_m", "q5_1", "q5_0", "q4_k_m", "q4_1", "q4_0", "q3_k_m",
                   "q2_k")
# the module each engine runs, and the extra that installs it
ENGINE_MODULES = {"transformers": ("fastapi", "uvicorn", "openai"), "llama-cpp": ("llama_cpp", "sse_starlette",
                                                                                  "starlette_context", "fastapi"),
                  "vllm": ("vllm",)}
ENGINE_EXTRAS = {"transformers": "pip install 'praisonai-accel[serve]'",
                 "llama-cpp": "pip install 'praisonai-accel[gguf,serve]'",
                 "vllm": "pip install vllm (Linux with a GPU)"}


class ServeError(ConfigError):
    """Bad input to serve, or an engine that cannot start: one line for the user."""


@dataclass
class Target:
    engine: str  # transformers | llama-cpp | vllm
    name: str  # what requests call the model
    gguf: Path | None = None  # the file llama.cpp serves
    model_dir: Path | None = None  # an adapter or a full model directory (transformers, vLLM)

    @property
    def adapter(self) -> bool:
        return self.model_dir is not None and (self.model_dir / "adapter_config.json").is_file()


def _is_run(directory: Path) -> bool:
    return (directory / "train_summary.json").is_file()


def default_name(path: Path) -> str:
    """The run's name: its output_dir's, for the run itself, its final model or checkpoints, or its GGUF exports."""
    path = path.resolve()
    for candidate in (path, path.parent, path.parent.parent):
        if candidate.is_dir() and _is_run(candidate):
            return candidate.name
    return path.stem if path.is_file() else path.name


def check_name(name: str) -> str:
    if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@:+-]*(/[A-Za-z0-9][A-Za-z0-9._@:+-]*)?", name) \
            or ".." in name:
        raise ServeError(f"--name '{name}': use letters, digits and . _ - @ : + (one '/' at most, as in org/model)")
    return name


def gguf_method(file: Path) -> str | None:
    """The quantization a `<stem>-<METHOD>.gguf` export names (publish/gguf.ExportPlan.target), lower-cased."""
    stem = file.name[:-len(".gguf")]
    method = stem.rsplit("-", 1)[-1].lower() if "-" in stem else ""
    return method if method in GGUF_PREFERENCE else None


def gguf_exports(directory: Path) -> list[Path]:
    """The .gguf files of a run (output_dir/gguf/ from save_gguf, <model>-gguf/ from `export gguf`) or of an export
    folder, best quantization first."""
    folders = [directory / "gguf", directory, *sorted(directory.glob("*-gguf"))]
    files = [f for folder in folders if folder.is_dir() for f in sorted(folder.glob("*.gguf")) if f.is_file()]
    rank = {m: i for i, m in enumerate(GGUF_PREFERENCE)}
    return sorted(files, key=lambda f: rank.get(gguf_method(f) or "", len(rank)))


def check_gguf_file(path: Path) -> Path:
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ServeError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if magic != b"GGUF":
        raise ServeError(f"{path}: is not a GGUF file (no GGUF header)")
    return path


def engine_installed(engine: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in ENGINE_MODULES[engine])


def require_engine(engine: str) -> None:
    if not engine_installed(engine):
        missing = [m for m in ENGINE_MODULES[engine] if importlib.util.find_spec(m) is None]
        raise ServeError(f"--engine {engine}: not installed (no {', '.join(missing)}); {ENGINE_EXTRAS[engine]}")


def checkpoint_model(path: Path, trust_remote_code: bool = False) -> tuple[Path, str]:
    """A checkpoint-<step> directory: (the model it holds, its adapter/, as `eval` finds it, its base checked to be at
    hand; the name of the run it belongs to, finished or still training)."""
    found = resolve_eval_target(str(path), trust_remote_code)
    return Path(found.model), Path(found.output_dir or path.parent).resolve().name


def resolve_target(path: Path, engine: str = "auto", name: str | None = None, quantization: str | None = None,
                   trust_remote_code: bool = False) -> Target:
    """The model to serve and its engine, every refusal one line; nothing is loaded."""
    if engine not in ENGINES:
        raise ServeError(f"--engine '{engine}': use one of {', '.join(ENGINES)}")
    path = Path(path)
    if not path.exists():
        raise ServeError(f"{path}: no such file or directory")
    checkpoint, run_name = None, None
    if path.is_dir() and step_of(path) >= 0 and engine != "llama-cpp":
        checkpoint, run_name = checkpoint_model(path, trust_remote_code)
    name = check_name(name if name is not None else run_name or default_name(path))
    if quantization and engine in ("transformers", "vllm"):
        raise ServeError(f"--quantization picks one of a run's GGUF exports, which --engine llama-cpp serves, not "
                         f"--engine {engine}")
    gguf = None
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ServeError(f"{path}: is neither a .gguf file nor a model directory")
        gguf = check_gguf_file(path)
    elif engine in ("auto", "llama-cpp"):
        exports = gguf_exports(path)
        if quantization:
            exports = [f for f in exports if gguf_method(f) == quantization.lower()]
            if not exports:
                raise ServeError(f"--quantization {quantization}: {path} holds no such GGUF export "
                                 f"(have: {', '.join(sorted(filter(None, map(gguf_method, gguf_exports(path))))) or 'none'})")
        if exports:
            gguf = check_gguf_file(exports[0])
    if gguf is not None:
        if engine not in ("auto", "llama-cpp"):
            raise ServeError(f"--engine {engine}: {gguf.name} is a GGUF file, which --engine llama-cpp serves; serve "
                             "the run or model directory with this engine")
        try:
            require_engine("llama-cpp")
        except ServeError as exc:
            if path.is_dir() and engine == "auto":  # the run's model itself can still be served
                raise ServeError(f"{exc}; or serve {path}'s model with --engine transformers") from None
            raise
        return Target("llama-cpp", name, gguf=gguf.resolve())
    if engine == "llama-cpp":
        raise ServeError(f"--engine llama-cpp: {path} holds no .gguf file; export one first "
                         f"(praisonai-accel export gguf {path} -q q8_0) or serve it with --engine transformers")
    try:
        model_dir = checkpoint or resolve_model_dir(path)
    except ModelDirError as exc:
        raise ServeError(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:  # an unreadable train_summary.json
        raise ServeError(f"{path}: holds no readable model ({type(exc).__name__}: {exc})") from None
    _check_model_dir(model_dir)
    refusal = reward_model_refusal(model_dir, "serve")
    if refusal:
        raise ServeError(refusal)
    chosen = "transformers" if engine == "auto" else engine
    require_engine(chosen)
    return Target(chosen, name, model_dir=model_dir.resolve())


def _check_model_dir(model_dir: Path) -> None:
    """A directory with config.json or adapter_config.json must also hold the weights an engine loads."""
    weights = list(model_dir.glob("*.safetensors")) + list(model_dir.glob("*.bin"))
    if not weights:
        raise ServeError(f"{model_dir}: holds no weights (*.safetensors); is the run still training?")
    if (model_dir / "adapter_config.json").is_file():
        try:
            json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        except (OSError, ValueError, KeyError):
            raise ServeError(f"{model_dir}/adapter_config.json: names no base_model_name_or_path") from None
