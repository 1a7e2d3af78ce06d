"""llama.cpp's converter and engine, found before anything heavy starts (used by publish/gguf.py only), and what our
GGUF / Ollama path cannot take: a vision-language model (publish/ollama.py asks too).

The converter (convert_hf_to_gguf.py with its conversion/ package and gguf-py) ships in llama-cpp-python's source
distribution, not in its wheel. It is found, in order: at $LLAMA_CPP_CONVERTER (a llama.cpp checkout, its
convert_hf_to_gguf.py, or a llama-cpp-python sdist .tar.gz, unpacked once into the cache); in the cache
(~/.cache/praisonai-accel/llama.cpp/<version>) for the installed llama-cpp-python version; else that exact version's
sdist is fetched once with pip and its converter kept in the cache, so converter and engine always match.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

log = logging.getLogger("praisonai_accel")

CONVERTER_ENV = "LLAMA_CPP_CONVERTER"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
INSTALL_HINT = "pip install 'praisonai-accel[gguf]'"


class GGUFError(Exception):
    """A GGUF export problem, phrased as one line for the user."""


def engine_version() -> str | None:
    """The installed llama-cpp-python's version, read from its metadata (the library is not loaded)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "praisonai-accel" / "llama.cpp"


def find_converter(fetch: bool = True) -> Path:
    """convert_hf_to_gguf.py, with its conversion/ and gguf-py/ beside it; GGUFError when there is none."""
    configured = os.environ.get(CONVERTER_ENV)
    if configured:
        path = Path(configured).expanduser()
        if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
            return _from_sdist(path, cache_root() / path.name.split(".tar")[0].split(".tgz")[0])
        script = path / "convert_hf_to_gguf.py" if path.is_dir() else path
        if script.is_file() and (script.parent / "gguf-py").is_dir():
            return script
        raise GGUFError(f"{CONVERTER_ENV}={configured}: holds no convert_hf_to_gguf.py with gguf-py/ beside it "
                        "(point it at a llama.cpp checkout or a llama-cpp-python source .tar.gz)")
    version = engine_version()
    if version is None:
        raise GGUFError(f"GGUF export needs llama.cpp (llama-cpp-python), which is not installed; {INSTALL_HINT}")
    cached = cache_root() / version / "convert_hf_to_gguf.py"
    if cached.is_file():
        return cached
    if not fetch:
        raise GGUFError(f"llama.cpp's converter for llama-cpp-python {version} is not in {cached.parent}")
    return _fetch_converter(version, cached.parent)


def _fetch_converter(version: str, target: Path) -> Path:
    """The converter ships in llama-cpp-python's sdist only: fetch that exact version with pip, keep the converter."""
    log.info("gguf: fetching llama.cpp's converter (the llama-cpp-python %s source) once, into %s", version, target)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                               "--dest", tmp, f"llama-cpp-python=={version}"], capture_output=True, text=True)
        tarballs = sorted(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not tarballs:
            raise GGUFError(f"llama.cpp's converter is not on this machine and pip could not fetch the llama-cpp-python "
                            f"{version} source; set {CONVERTER_ENV} to a llama.cpp checkout or that source .tar.gz")
        return _from_sdist(tarballs[0], target)


def _from_sdist(tarball: Path, target: Path) -> Path:
    """Unpack only the converter, its conversion/ package and gguf-py/ from an sdist (or a llama.cpp tarball)."""
    script = target / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tarfile.open(tarball) as archive:
            members = []
            for member in archive.getmembers():
                at = member.name.find("convert_hf_to_gguf.py")
                root = member.name[:at] if at >= 0 and member.name.endswith("convert_hf_to_gguf.py") else None
                if root is not None and "/examples/" not in root:
                    members = [m for m in archive.getmembers() if m.name.startswith(root) and
                               m.name[len(root):].startswith(CONVERTER_PARTS)]
                    for m in members:
                        m.name = m.name[len(root):]
                    break
            if not members:
                raise GGUFError(f"{tarball}: holds no convert_hf_to_gguf.py")
            archive.extractall(tmp, members=members, filter="data")
    except (OSError, tarfile.TarError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GGUFError(f"{tarball}: cannot unpack llama.cpp's converter: {exc}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another export unpacked it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return script


def converter_architectures(script: Path) -> set[str]:
    """The Hugging Face architectures this converter knows, read from its source (nothing is imported)."""
    package = script.parent / "conversion" / "__init__.py"
    if package.is_file():
        for node in ast.walk(ast.parse(package.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", None) == "TEXT_MODEL_MAP" for t in targets):
                    return set(ast.literal_eval(node.value))
    sources = [script] + sorted((script.parent / "conversion").glob("*.py"))  # older llama.cpp: one file
    names: set[str] = set()
    for source in sources:
        for call in re.findall(r"@ModelBase\.register\(([^)]*)\)", source.read_text()):
            names.update(re.findall(r"\"([A-Za-z0-9_]+)\"", call))
    return names


def check_engine() -> None:
    """llama-cpp-python must import: it quantizes, checks every exported file's tokenizer, and generates from it."""
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True)
    if probe.returncode < 0:
        from .gguf_engine import crash_line

        raise GGUFError(crash_line("loading", -probe.returncode))
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["not installed"])[-1]
        raise GGUFError(f"llama-cpp-python, which quantizes, checks and runs GGUF files, cannot be imported ({tail}); "
                        f"{INSTALL_HINT}")


TEXT_ONLY = ("our GGUF / Ollama path is text-only: it converts the language model alone, without the vision tower "
             "and projector (llama.cpp and Ollama keep those in a projector file of their own, which it does not "
             "write), so images could not reach the model")


def vision_refusal(what: str, model_type: str) -> str:
    """The one line refusing to publish a vision-language model (one saved with its image processor: a multimodal
    checkpoint trained on text alone is a text model here) through the text-only GGUF / Ollama path."""
    return (f"{what}: this is a vision-language model ({model_type}), and {TEXT_ONLY}; use its safetensors with "
            "transformers (praisonai-accel chat --image) or a vision-aware converter")
