"""The example agent's rewards: completions are trajectories (the assistant turns with their tool calls, and the tool
results); environments are the rollouts' Shop objects."""

from __future__ import annotations

import re


def right_total(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last turn's last number is the expected total."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion[-1]["content"] or "")
        out.append(float(bool(numbers) and abs(float(numbers[-1]) - float(expected)) < 0.01))
    return out


def used_the_shop(completions, environments, **kwargs) -> list[float]:
    """A small bonus for looking the item up rather than guessing its price."""
    return [float(bool(shop.looked_up)) for shop in environments]
