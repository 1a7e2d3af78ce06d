"""The images of a row: where they are, whether they open, how many placeholders ask for them, and their decoding.

A row's `images` (a list, or one value) holds paths, relative to the dataset file's folder (a dataset folder: that
folder; a Hub dataset: the working directory) or absolute. URLs are refused (training runs offline). Placeholders
are TRL's `{"type": "image"}` content parts or LLaMA-Factory's `<image>` in the text; their count must be the
number of images. Preprocessing reads each image's header (its size, for the number of image tokens) and decodes
it cheaply to be sure it is whole (a JPEG at 1/8 scale); the pixels are decoded for training only in the collator.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import DatasetSpec
from ..errors import first_line
from .formats import DataError, RowProblem

PLACEHOLDER = "<image>"  # LLaMA-Factory's, in the text of a turn
IMAGES_COLUMN = "images"
IMAGE_COLUMNS = (IMAGES_COLUMN, "image")  # TRL's `images`, or one `image` as some Hub datasets have
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def image_values(row: dict) -> list:
    """The row's images, as a list (one value alone, or none)."""
    value = next((row[name] for name in IMAGE_COLUMNS if name in row), None)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def base_folder(spec: DatasetSpec) -> Path:
    """What relative image paths are relative to: the dataset file's folder, a dataset folder itself, else here."""
    path = Path(spec.name).expanduser()
    if path.is_file():
        return path.resolve().parent
    if path.is_dir():
        return path.resolve()
    return Path.cwd()


def keep_encoded(table):
    """A datasets table whose Image columns (or lists of them) give the files' bytes and paths, not decoded
    pixels: preprocessing keeps references, and the collator decodes."""
    import datasets

    def undecoded(feature):
        if isinstance(feature, datasets.Image):
            return datasets.Image(decode=False)
        if isinstance(feature, (datasets.Sequence, datasets.List)):
            inner = undecoded(feature.feature)
            return None if inner is None else type(feature)(inner)
        return None

    for name, feature in table.features.items():
        cast = undecoded(feature)
        if cast is not None:
            table = table.cast_column(name, cast)
    return table


def stored_image(data: bytes, store: Path) -> Path:
    """An image embedded in a dataset (a Hub dataset's Image feature), written once under `store` by its content's
    hash: the cache then holds its path like any other."""
    import hashlib
    import os

    path = store / hashlib.sha256(data).hexdigest()[:32]
    if not path.is_file():
        store.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def image_path(value, number: int, base: Path, store: Path | None = None) -> Path | RowProblem:
    """Image `number` (1-based) of a row as a file path, or why it is not one. A datasets Image feature's value
    ({"bytes", "path"}): its bytes, written under `store`, or its path."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if isinstance(value.get("bytes"), bytes) and value["bytes"] and store is not None:
            return stored_image(value["bytes"], store)
        value = value.get("path")
    if not isinstance(value, str) or not value.strip():
        kind = "an empty path" if isinstance(value, str) else type(value).__name__
        return RowProblem("invalid image", f"image {number} is {kind}, not the path of an image file")
    if _URL.match(value):
        return RowProblem("image is a URL", f"image {number} is a URL ({value}); training reads images offline: "
                                            "download it and give its path")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def open_image(path: Path, where: str, check: bool = False, decode: bool = False):
    """The image file, opened: decoded as RGB (`decode`), checked whole at reduced scale (`check`: a JPEG at 1/8),
    or only its header read; a RowProblem naming `where` (`image 2 (path)`) and why it cannot be read. A
    decompression bomb (more pixels than PIL allows) is one of those reasons."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        return RowProblem("missing image", f"{where} does not exist")
    try:
        with Image.open(path) as image:
            if decode:
                return image.convert("RGB")
            size = image.size
            if check:
                image.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
                image.load()
            return size
    except UnidentifiedImageError:
        return RowProblem("unreadable image", f"{where} is not an image file PIL can read")
    except Image.DecompressionBombError as exc:  # an Exception, not an OSError
        return RowProblem("unreadable image", f"{where} is refused: {first_line(exc, 'too many pixels')}")
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        return RowProblem("unreadable image", f"{where} cannot be read: {first_line(exc, type(exc).__name__)}")


def image_size(path: Path, number: int, check: bool = False) -> tuple[int, int] | RowProblem:
    """(width, height) from the file's header; `check`: also decode it (a JPEG at reduced scale) to be sure it is
    whole."""
    return open_image(path, f"image {number} ({path})", check=check)


def split_placeholders(text: str) -> list[dict]:
    """LLaMA-Factory's text with <image> placeholders as TRL's content parts, in order."""
    parts: list[dict] = []
    for index, piece in enumerate(text.split(PLACEHOLDER)):
        if index:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def with_image_parts(messages: list[dict]) -> list[dict]:
    """Messages whose text holds <image> placeholders, as content parts; image parts keep only their type (the
    processor is given the images themselves)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and PLACEHOLDER in content:
            content = split_placeholders(content)
        elif isinstance(content, list):  # Arrow-typed rows give every part every field, None where unset
            content = [part for block in content for part in
                       ([{"type": "image"}] if block.get("type") == "image" else
                        split_placeholders(block["text"]) if isinstance(block.get("text"), str) else
                        [{k: v for k, v in block.items() if v is not None}])]
        out.append({**message, "content": content})
    return out


def placeholder_count(messages: list) -> int:
    """Images a conversation asks for: image content parts and <image> placeholders in its text."""
    count = 0
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        content = message.get("content", message.get("value"))
        if isinstance(content, str):
            count += content.count(PLACEHOLDER)
        elif isinstance(content, list):
            for block in content:
                if isinstance(block, dict):
                    count += block.get("type") == "image"
                    count += str(block.get("text") or "").count(PLACEHOLDER)
    return count


def check_images(row: dict, messages: list, base: Path, store: Path | None = None) -> RowProblem | None:
    """Why the row's images cannot be trained (missing, unreadable, a URL, not as many as its placeholders)."""
    values = image_values(row)
    wanted = placeholder_count(messages)
    if wanted != len(values):
        plural = "s" if len(values) != 1 else ""
        return RowProblem("image count mismatch",
                          f"{wanted} image placeholder{'s' if wanted != 1 else ''} ({{\"type\": \"image\"}} parts or "
                          f"{PLACEHOLDER}) but {len(values)} image{plural} in '{IMAGES_COLUMN}'")
    for number, value in enumerate(values, 1):
        path = image_path(value, number, base, store)
        if isinstance(path, RowProblem):
            return path
        size = image_size(path, number, check=True)
        if isinstance(size, RowProblem):
            return size
    return None


def encode_references(paths: list[Path], sizes: list[tuple[int, int]]) -> list[int]:
    """Image paths and the sizes preprocessing read (their image tokens depend on them) as an int column of the
    preprocessing cache: the UTF-8 bytes of a JSON list of [path, width, height]; [] for a row without images."""
    if not paths:
        return []
    return list(json.dumps([[str(p), int(w), int(h)] for p, (w, h) in zip(paths, sizes)]).encode())


def image_references(column) -> list[tuple[str, int, int] | tuple[str, None, None]]:
    """(path, width, height) of each image of a cached example; an older entry's bare path has no size."""
    values = json.loads(bytes(int(b) for b in column).decode()) if len(column) else []
    return [tuple(v) if isinstance(v, list) else (v, None, None) for v in values]


def decode_references(column) -> list[str]:
    return [path for path, _, _ in image_references(column)]


def open_images(references) -> list:
    """The images, decoded as RGB: what the collator hands the image processor. An image that is gone, unreadable or
    no longer the size the cache counted its tokens for is one line (a DataError)."""
    images = []
    for path, width, height in references:
        image = open_image(path, f"image {path}", decode=True)
        if isinstance(image, RowProblem):
            raise DataError(f"{image}; it was read when the dataset was preprocessed: the preprocessing cache is "
                            "stale (delete it, or restore the image)")
        if width is not None and image.size != (width, height):
            raise DataError(f"image {path} is {image.size[0]}x{image.size[1]} but was {width}x{height} when the "
                            "dataset was preprocessed (the image changed): the preprocessing cache is stale; "
                            "delete it to preprocess again")
        images.append(image)
    return images
