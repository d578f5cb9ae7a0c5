"""The planner: predicted memory, communication and step time of every layout, before renting the cluster.

The wing: `shape` (the model's parameters, read from the model), `layout` (a layout from the run's own
MeshConfig and ParallelConfig, and the training step's checks asked of it), `memory`, `comm` (collectives
and their time), `time` (the step), `search` (the ranked layouts that fit), `report` (tables, reasons,
the memory picture). The hardware table is `meshpar.hardware`.
"""

from meshpar.hardware import PRESETS, Hardware, parse as parse_hardware
from meshpar.plan.layout import Layout, Run, check
from meshpar.plan.memory import Memory, memory
from meshpar.plan.search import (NothingFits, SearchResult, best_layout, capacities, check_cluster, model_states,
                                 search)
from meshpar.plan.shape import Shape
from meshpar.plan.time import Estimate, estimate

__all__ = ["Estimate", "Hardware", "Layout", "Memory", "NothingFits", "PRESETS", "Run", "SearchResult", "Shape",
           "best_layout", "capacities", "check", "check_cluster", "estimate", "memory", "model_states",
           "parse_hardware", "search"]
