"""The example agent's tools. Each is what an agent framework already has: a function with type hints and a
Google-style docstring (its JSON schema, shown to the model by the chat template, is built from them)."""

from __future__ import annotations

PRICES = {"apple": 0.5, "bread": 2.25, "cheese": 4.0, "milk": 1.2, "rice": 3.1}


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return round(a * b, 2)


class Shop:
    """One per rollout: the stock of the row's shop, and what the agent looked up (a reward can read it)."""

    def __init__(self):
        self.stock: dict[str, int] = {}
        self.looked_up: list[str] = []

    def reset(self, stock: dict | None = None, **row) -> None:
        self.stock = dict(stock or {})
        self.looked_up = []

    def price(self, item: str) -> float:
        """The price of one unit of an item.

        Args:
            item: The item's name, e.g. "bread".
        """
        self.looked_up.append(item)
        if item not in PRICES:
            raise KeyError(f"no item called {item!r}")
        return PRICES[item]

    def in_stock(self, item: str) -> int:
        """How many units of an item the shop has.

        Args:
            item: The item's name.
        """
        self.looked_up.append(item)
        return self.stock.get(item, 0)
