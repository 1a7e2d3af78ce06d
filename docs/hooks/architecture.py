"""mkdocs hook: the site's Architecture page is ../ARCHITECTURE.md itself, kept at the repository root where an
engineer looks first, so the site never carries a copy that goes stale."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ARCHITECTURE = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"


def on_files(files, config):
    files.append(File.generated(config, "architecture.md", abs_src_path=str(ARCHITECTURE)))
    return files
