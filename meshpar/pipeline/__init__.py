"""Pipeline parallelism: the stacked `layers` axis split into stages over the mesh's `stage` axis.

The wing: `schedule` (the arithmetic both schedules and the planner share: iterations, bubble, 1F1B's
slots and stash, the default microbatch count), `stages` (what both schedules share: stage weights, batch
shards, the shift between stages, the checks), `order` (the stack's order at rest), `gpipe` (GPipe and the
circular schedule: `pipeline`) and `one_f_one_b` (1F1B, the loss inside the pipeline).
"""

from meshpar.pipeline.gpipe import pipeline
from meshpar.pipeline.order import to_layers, to_rest

__all__ = ["pipeline", "to_layers", "to_rest"]
