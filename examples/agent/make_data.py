"""Writes prompts.jsonl next to this file: "what do N items cost, if the shop has them?" with the expected total."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools import PRICES


def rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        item, wanted = rng.choice(sorted(PRICES)), rng.randint(1, 9)
        stock = {name: rng.randint(0, 9) for name in PRICES}
        total = round(PRICES[item] * min(wanted, stock[item]), 2)
        question = (f"I want {wanted} {item}. Buy as many as the shop has in stock, up to {wanted}. "
                    "What do I pay? End with the number.")
        out.append({"prompt": [{"role": "user", "content": question}], "answer": str(total), "stock": stock})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("prompts.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(2000)))
    print(f"wrote {path}")
