"""Mixtures of experts: routing (top-k, the router's losses and statistics) and the dispatch of tokens to
their experts over the `expert` mesh axis (all-to-all, grouped matmuls or capacity buffers)."""

from meshpar.moe.dispatch import (DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS, capacity, experts_ffn, rows_per_shard,
                                  swiglu)
from meshpar.moe.routing import SCORES, RouterStats, Routes, SelectionBias, metrics, route, with_loads

__all__ = ["DOWN", "DOWN_BIAS", "GATE_UP", "GATE_UP_BIAS", "SCORES", "RouterStats", "Routes", "SelectionBias",
           "capacity", "experts_ffn", "metrics", "route", "rows_per_shard", "swiglu", "with_loads"]
