"""``zeroshard bench``: the same model trained side by side under plain data parallelism,
ZeRO stages 1-3 and activation checkpointing, with torch DDP, ZeroRedundancyOptimizer,
FSDP2 and (when installed) DeepSpeed; peak memory by category, throughput, communication
and loss for each. See docs/bench.md.

Files: ``configs`` (names and settings), ``runners`` (one per system), ``measure`` (step
instruments), ``worker`` (what each rank runs), ``launch`` (starting ranks), ``report``
(rows, ratios, budget, JSON), ``render`` (table, plots), ``cli`` (arguments).
"""

from __future__ import annotations

from zeroshard.bench.cli import add_arguments, run
from zeroshard.bench.configs import DEFAULT_CONFIGS, BenchSettings, ConfigSpec, parse_config

__all__ = ["BenchSettings", "ConfigSpec", "DEFAULT_CONFIGS", "add_arguments", "parse_config",
           "run"]
