"""The persistent compilation cache the suite runs with (tests/conftest.py) serves a program only to the same
program: a layout compiled again is served (a hit) and computes what it computed, and the same layout with one
setting changed is compiled anew (a miss)."""

import contextlib
import dataclasses
import random

import jax
import numpy as np
from jax import monitoring

from layouts import MeshRun, TRAIN

EVENTS = {"/jax/compilation_cache/cache_hits": "hit", "/jax/compilation_cache/cache_misses": "miss"}


@contextlib.contextmanager
def cache_events():
    """The persistent cache's answers to the compiles made inside."""
    seen = []
    listener = lambda event, **_: seen.append(EVENTS[event]) if event in EVENTS else None
    monitoring.register_event_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_listener(listener)


def compile_step(layout: MeshRun):
    """The layout's training step, traced, lowered and compiled afresh (no in-memory cache between calls)."""
    from meshpar import train

    return train.make_step(layout.sharded, layout.tokens_sharding, layout.cfg).lower(
        layout.state, layout.batch(0)).compile()


def test_a_layout_is_served_again_and_a_changed_setting_compiled_anew():
    assert jax.config.jax_compilation_cache_dir and jax.config.jax_persistent_cache_min_compile_time_secs == 0
    # a learning rate that no earlier run on this machine compiled: the first compile cannot be a hit
    lr = TRAIN.lr * (1 + random.randrange(1, 2**22) / 2**23)
    layout = MeshRun("fsdp=8", dataclasses.replace(TRAIN, lr=lr))
    changed = MeshRun("fsdp=8", dataclasses.replace(TRAIN, lr=lr * 0.5))
    with cache_events() as first:
        compiled = compile_step(layout)
    with cache_events() as again:
        served = compile_step(layout)
    with cache_events() as other:
        compile_step(changed)
    assert (first, again, other) == (["miss"], ["hit"], ["miss"])
    state = lambda: jax.tree.map(lambda x: x.copy(), layout.state)  # each step donates its state
    (new_state, metrics), (served_state, served_metrics) = (step(state(), layout.batch(0)) for step in
                                                           (compiled, served))
    assert float(metrics["loss"]) == float(served_metrics["loss"])
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(served_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
