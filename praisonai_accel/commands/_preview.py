"""What training will see: examples with their trained tokens marked, and per-dataset statistics.

Reads the same cache training reads (tokenizing first if needed), so what is shown is what is trained.
"""

from __future__ import annotations

from ..data import IGNORE_INDEX

OPEN, CLOSE = "[[", "]]"  # trained spans when the output is not a terminal


def marked_text(tokenizer, input_ids, labels, colour: bool, images=()) -> str:
    """The example's text with trained runs in green (terminal) or between [[ and ]] (piped); `images`: (start,
    end, text) spans shown as their text (`<image 1: 448x448 -> 256 tokens>`, never trained)."""
    pieces, run, trained = [], [], None
    starts = {start: (end, text) for start, end, text in images}
    skip_to = 0
    for position, (token, label) in enumerate(zip(input_ids, labels)):
        if position < skip_to:
            continue
        if position in starts:
            if run:
                pieces.append((trained, tokenizer.decode(run)))
            skip_to, text = starts[position]
            pieces.append((False, text))
            run, trained = [], None
            continue
        is_trained = label != IGNORE_INDEX
        if trained is not None and is_trained != trained:
            pieces.append((trained, tokenizer.decode(run)))
            run = []
        run.append(int(token))
        trained = is_trained
    if run:
        pieces.append((trained, tokenizer.decode(run)))
    if colour:
        from rich.markup import escape

        return "".join(f"[bold green]{escape(text)}[/bold green]" if on else f"[dim]{escape(text)}[/dim]" for on, text in pieces)
    return "".join(f"{OPEN}{text}{CLOSE}" if on else text for on, text in pieces)


def image_marks(tokenizer, row) -> list[tuple[int, int, str]]:
    """Where each image of an example with images goes (methods/vision_rows.image_spans); none for text."""
    from ..data.vision_processor import processor_of

    processor = processor_of(tokenizer)
    if processor is None or "images" not in row:
        return []
    from ..data.images import decode_references
    from ..methods.vision_rows import image_spans

    return image_spans(processor, [int(i) for i in row["input_ids"]], decode_references(row["images"]))


def example_parts(config, row) -> list[tuple[str, list[int], list[int]]]:
    """The parts of one encoded example to show, as (title, input_ids, labels), as the training method splits it
    (methods/base.TrainingMethod.preview_parts). A part's trained tokens are those whose label is not IGNORE_INDEX."""
    return type(config).training_method.preview_parts(row)


def histogram(lengths: list[int], max_length: int, buckets: int = 8, width: int = 40) -> list[str]:
    """Text bars of example lengths in `buckets` equal ranges up to max_length."""
    size = max(1, -(-max_length // buckets))
    counts = [0] * buckets
    for length in lengths:
        counts[min((length - 1) // size, buckets - 1)] += 1
    top = max(counts) or 1
    return [f"{i * size + 1:>6}-{min((i + 1) * size, max_length):<6} {'#' * round(width * c / top):<{width}} {c}"
            for i, c in enumerate(counts)]


def dataset_rows(data, stats) -> list[dict]:
    """Per dataset: examples, tokens, trained fraction, truncated, dropped, and the lengths kept."""
    sources = data.source[data.index]
    rows = []
    for index, d in enumerate(stats.datasets):
        lengths = [length for length, source in zip(data.lengths, sources) if source == index]
        rows.append({"name": d.name, "rows": d.rows, "examples": d.examples, "tokens": d.tokens,
                     "trained_fraction": d.target_tokens / max(d.tokens, 1), "truncated": d.truncated,
                     "response_cut": d.response_cut, "dropped": d.dropped, "invalid": d.invalid, "masking": d.masking,
                     "lengths": lengths})
    return rows
