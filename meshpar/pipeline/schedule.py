"""The pipeline schedules' arithmetic, in one place: how many steps they take, how much of it idles, and
what 1F1B and zero-bubble keep. The schedules (`gpipe`, `one_f_one_b`) and the planner (`meshpar.plan`) both
read it.

Letters: P stages, M microbatches, R repeats (the circular schedule's rounds of the stages; interleaved
1F1B's chunks per stage).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshpar.errors import InputError


def microbatches(configured: int, stages: int) -> int:
    """M: `parallel.microbatches` if set, else twice the stages (GPipe's bubble (P−1)/(3P−1) < 1/3)."""
    return configured or 2 * stages


def iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
    """How many steps the GPipe / circular schedule takes: (R−1)·max(M, P) + M + P − 1 (R·M + P − 1 when
    M ≥ P or R = 1): with R > 1 and M < P a microbatch comes back to stage 0 before the others are through,
    and the schedule waits for it."""
    return (repeats - 1) * max(microbatches, stages) + microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of the schedule's time a stage idles: (P − 1)/(R·M + P − 1) [GPipe, Huang et al. §2.3,
    with R repeats: Narayanan et al. §2.2]; 1F1B has GPipe's (R = 1).

    M = 1, R = 1 is naive model parallelism: (P − 1)/P. With R > 1 and M < P the circular schedule takes
    (R−1)·P + M + P − 1 iterations (`iterations`) and the fraction is 1 − R·M/that, larger than the formula.
    """
    for name, value in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if value < 1:
            raise InputError(f"{name} = {value} must be >= 1")
    return 1.0 - repeats * microbatches / iterations(stages, microbatches, repeats)


def slots(stages: int, microbatches: int, repeats: int = 1) -> int:
    """1F1B's slots: R·M + P − 1 that forward (the last stage's last chunk takes microbatch M − 1 in slot
    R·M + P − 2), then R·P − 1 more that only backward; M + 2(P − 1) without interleaving (R = 1)."""
    return repeats * microbatches + stages - 1 + repeats * stages - 1


def phases(stages: int, microbatches: int, repeats: int = 1) -> tuple[tuple[int, int, bool, bool], ...]:
    """1F1B's slots in three runs of one kind: (first slot, end, forwards, backwards) each. The first
    backward runs in slot R·P − 1, when the first microbatch has come out of the last chunk of the last stage."""
    first_backward, forwards_end = repeats * stages - 1, repeats * microbatches + stages - 1
    return ((0, first_backward, True, False), (first_backward, forwards_end, True, True),
            (forwards_end, slots(stages, microbatches, repeats), False, True))


def _nth(u: Any, stages: int, repeats: int) -> tuple[Any, Any]:
    """The u-th (microbatch, chunk) a stage forwards: microbatches go in groups of P, each group through
    chunk 0 of every stage, then chunk 1, … (Megatron's interleaved order; with R = 1 simply microbatch u).
    Negative for u < 0."""
    group, within = u // (repeats * stages), u % (repeats * stages)
    return group * stages + within % stages, within // stages


def microbatches_in(slot: Any, stages: int, repeats: int = 1) -> tuple[Any, Any, Any, Any]:
    """(m_F, c_F, m_B, c_B): the microbatch and chunk every stage q = 0 … P−1 forwards and backwards in 1F1B's
    `slot`, real where the microbatch is in [0, M). Stage q forwards its u-th (microbatch, chunk) in slot
    u + q, so an activation moves one stage on per slot (from stage P − 1 to stage 0 for the next chunk);
    backwards mirror it, R·P − 1 slots later at the last stage, so the last chunk of the last stage
    backwards a microbatch in the slot that forwards it (its loss). Without interleaving (R = 1): slot − q
    and slot − 2(P − 1) + q, chunk 0. An int slot gives numpy arrays, a traced one jax arrays."""
    xp = jnp if isinstance(slot, jax.Array) else np
    stage_P = xp.arange(stages)
    m_F, c_F = _nth(slot - stage_P, stages, repeats)
    m_B, c_reversed = _nth(slot - (repeats * stages - 1) - (stages - 1 - stage_P), stages, repeats)
    return m_F, c_F, m_B, repeats - 1 - c_reversed


def forward_slot(microbatch: Any, chunk: Any, stage: Any, stages: int, repeats: int = 1) -> Any:
    """The slot in which `stage` forwards `microbatch` through `chunk` (the inverse of `microbatches_in`)."""
    group, m = microbatch // stages, microbatch % stages
    return stage + group * repeats * stages + chunk * stages + m


def check_interleaving(stages: int, microbatches: int, repeats: int) -> None:
    """Interleaved 1F1B (R > 1) takes the microbatches in groups of P (`microbatches_in`): refuse another M."""
    if repeats > 1 and microbatches % stages:
        raise InputError(f"interleaved 1F1B (parallel.pipeline_repeats = {repeats}) runs the microbatches in "
                         f"groups of P = {stages} stages: parallel.microbatches = {microbatches} must be a multiple "
                         f"of {stages}")


def stash_size(stages: int, repeats: int = 1) -> int:
    """Microbatch inputs a 1F1B stage may hold between slots: 2(R·P − 1) (stage 0's first chunk; 2(P − 1)
    without interleaving). A lockstep slot moves an activation one stage on, so a round trip from stage 0
    through R·P chunks and back takes 2(R·P − 1) slots."""
    return max(2 * (repeats * stages - 1), 1)


def weight_offset(stages: int, repeats: int = 1) -> int:
    """Zero-bubble: every stage computes the weights' gradient of its u-th backward in slot u + R·P + P − 2,
    the slot in which stage 0 backwards it (ZB-H1's order, Qi et al. 2023): stage q, which backwarded it in
    slot u + R·P + P − 2 − q, defers it q slots, and the weights' parts take the last R·M slots, which
    backward anyway."""
    return repeats * stages + stages - 2


def weight_grads_in(slot: Any, stages: int, repeats: int = 1) -> tuple[Any, Any]:
    """Zero-bubble: (microbatch, chunk) whose weights' gradient every stage computes in `slot` (real where the
    microbatch is in [0, M)); the same on every stage."""
    m, c_reversed = _nth(slot - weight_offset(stages, repeats), stages, repeats)
    return m, repeats - 1 - c_reversed


def zero_bubble_phases(stages: int, microbatches: int,
                       repeats: int = 1) -> tuple[tuple[int, int, bool, bool, bool], ...]:
    """Zero-bubble's slots in runs of one kind: (first slot, end, forwards, input gradients, weight gradients),
    1F1B's slots with the weights' parts from slot R·P + P − 2 to the end (`weight_offset`)."""
    P, M, R = stages, microbatches, repeats
    n = slots(P, M, R)
    edges = sorted({0, R * P - 1, weight_offset(P, R), R * M + P - 1, n})
    return tuple((a, b, a < R * M + P - 1, a >= R * P - 1, a >= weight_offset(P, R))
                 for a, b in zip(edges, edges[1:]) if a < b)


def zero_bubble_fraction(stages: int, microbatches: int, repeats: int = 1, *, forward: float = 1.0,
                         input_grad: float = 2.0, weight_grad: float = 1.0) -> float:
    """The fraction of zero-bubble's time a stage idles, with a chunk's forward, input-gradient and
    weight-gradient parts costing `forward`, `input_grad` and `weight_grad`: R·M + P − 1 slots forward and
    as many take input gradients, R·M take weight gradients, of which a stage does R·M each:
    (P − 1)(F + B) / ((R·M + P − 1)(F + B) + R·M·W). The defaults are the matmul FLOPs of meshpar's
    (F = 1; B = 2, the input gradient recomputing its forward; W = 1)."""
    P, M, R = stages, microbatches, repeats
    busy = forward + input_grad
    return (P - 1) * busy / ((R * M + P - 1) * busy + R * M * weight_grad)


def deferred_size(stages: int) -> int:
    """Zero-bubble: weights' parts a stage holds the boundary of between slots: stage q defers q slots
    (`weight_offset`), so a ring of P entries, written before it is read in each slot."""
    return stages
