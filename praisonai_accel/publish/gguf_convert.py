"""Running llama.cpp's converter (convert_hf_to_gguf.py) and gguf-py's metadata rewriter as child processes, each
failure one line (used by publish/gguf.py only)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .gguf_llamacpp import GGUFError
from .gguf_vocab import byte_level_pre_tokenizer


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if re.search(r"error|exception|not supported", line, re.IGNORECASE)]
        raise GGUFError(f"{what} failed: {(errors or lines or ['exit code %d' % done.returncode])[-1].strip()}")


# The converter run as itself, except that a pre-tokenizer it does not recognise by hash is named by us (a byte-level
# BPE trained on the spot with GPT-2's pre-tokenizer); the tokenizer check after the export holds it to that.
_CONVERT = """
import runpy, sys
from pathlib import Path
script, pre = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
sys.path[:0] = [str(Path(script).parent), str(Path(script).parent / "gguf-py")]  # its conversion/ and its own gguf-py
if pre:
    from conversion import base
    recognised = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            return pre
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(script, run_name="__main__")
"""


def convert(converter: Path, model_dir: Path, outfile: Path, outtype: str, name: str) -> Path:
    pre = byte_level_pre_tokenizer(model_dir / "tokenizer.json") or ""
    try:
        _run([sys.executable, "-c", _CONVERT, str(converter), pre, str(model_dir), "--outfile", str(outfile),
              "--outtype", outtype, "--model-name", name], f"llama.cpp's converter ({outtype})")
    except GGUFError as exc:
        if "BPE pre-tokenizer was not recognized" in str(exc):
            raise GGUFError(f"llama.cpp's converter ({outtype}) does not recognise this tokenizer's BPE pre-tokenizer "
                            "(it knows them by the hash of a fixed text's tokens: a tokenizer trained on the spot, or "
                            "newer than this llama.cpp, has none it knows)") from None
        raise
    return outfile


# gguf-py's own gguf_new_metadata.copy_with_new_metadata, run beside the converter: a copy of the file with some keys set.
_SET_METADATA = """
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root / "gguf-py"), str(root / "gguf-py" / "gguf" / "scripts")]
import gguf
from gguf_new_metadata import MetadataDetails, copy_with_new_metadata, get_field_data
source, target, values = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
reader = gguf.GGUFReader(source, "r")
writer = gguf.GGUFWriter(target, arch=get_field_data(reader, gguf.Keys.General.ARCHITECTURE), endianess=reader.endianess)
alignment = get_field_data(reader, gguf.Keys.General.ALIGNMENT)
if alignment is not None:
    writer.data_alignment = alignment
copy_with_new_metadata(reader, writer, {key: MetadataDetails(getattr(gguf.GGUFValueType, kind), value)
                                        for key, (kind, value) in values.items()}, [])
"""


def set_metadata(converter: Path, gguf_file: Path, values: dict[str, tuple[str, object]]) -> None:
    rewritten = gguf_file.with_name(gguf_file.name + ".meta")
    _run([sys.executable, "-c", _SET_METADATA, str(converter.parent), str(gguf_file), str(rewritten), json.dumps(values)],
         "writing the tokenizer's metadata")
    os.replace(rewritten, gguf_file)
