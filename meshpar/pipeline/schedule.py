"""The pipeline schedules' arithmetic, in one place: how many steps they take, how much of it idles, and
what 1F1B keeps. The schedules (`gpipe`, `one_f_one_b`) and the planner (`meshpar.plan`) both read it.

Letters: P stages, M microbatches, R repeats (the circular schedule's rounds of the stages).
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


def slots(stages: int, microbatches: int) -> int:
    """1F1B's slots, M + 2(P − 1): P − 1 forward-only, M forward-and-backward, P − 1 backward-only."""
    return microbatches + 2 * (stages - 1)


def phases(stages: int, microbatches: int) -> tuple[tuple[int, int, bool, bool], ...]:
    """1F1B's slots in three runs of one kind: (first slot, end, forwards, backwards) each."""
    P, M = stages, microbatches
    return (0, P - 1, True, False), (P - 1, M + P - 1, True, True), (M + P - 1, slots(P, M), False, True)


def microbatches_in(slot: Any, stages: int) -> tuple[Any, Any]:
    """The microbatches every stage p = 0 … P−1 forwards and backwards in 1F1B's `slot`: (slot − p,
    slot − 2(P − 1) + p), real where in [0, M). An int slot gives numpy arrays, a traced one jax arrays."""
    xp = jnp if isinstance(slot, jax.Array) else np
    stage_P = xp.arange(stages)
    return slot - stage_P, slot - 2 * (stages - 1) + stage_P


def stash_size(stages: int) -> int:
    """Microbatch inputs a 1F1B stage may hold between slots: 2(P − 1) (stage 0; stage p needs 2(P − 1 − p)).
    A lockstep slot moves an activation one stage on, so a round trip from stage 0 takes 2(P − 1) slots."""
    return max(2 * (stages - 1), 1)
