"""Bytes by category after every op, for plotting a step's memory (``zeroshard bench``'s
timeline plots): recorded by :class:`~zeroshard.memory.tracker.MemoryTracker` once
``record_timeline()`` is called, folded so that every peak survives."""

from __future__ import annotations

from typing import Any

__all__ = ["Timeline"]


class Timeline:
    """One point per op (bytes per category, in a fixed category order), and labels."""

    def __init__(self) -> None:
        self.points: list[tuple[int, ...]] = []
        self.marks: list[tuple[int, str]] = []  # (index of the next point, label)

    def record(self, values: tuple[int, ...]) -> None:
        self.points.append(values)

    def mark(self, label: str) -> None:
        self.marks.append((len(self.points), label))

    def folded(self, names: list[str], max_points: int) -> dict[str, Any]:
        """``{"op": [...], "<name>": [...], "marks": [[op, label], ...]}``: runs of ops
        folded into at most ``max_points`` points, each the op of its run with the highest
        total, so every peak survives. ``names``: the categories, in the points' order."""
        points = self.points
        size = max(1, -(-len(points) // max_points))
        keep = [max(range(i, min(i + size, len(points))), key=lambda j: sum(points[j]))
                for i in range(0, len(points), size)]
        out: dict[str, Any] = {"op": keep}
        for k, name in enumerate(names):
            out[name] = [points[j][k] for j in keep]
        out["marks"] = [[i, label] for i, label in self.marks]
        return out
