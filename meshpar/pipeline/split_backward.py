"""A layer's backward pass in two parts, the input's gradient now and the weights' gradient later: what a
zero-bubble schedule (`meshpar.pipeline.one_f_one_b`) needs, taken from the layer's own VJP, with no change
to the model.

`Split.of(fn, w, x, extra)` traces `fn(w, x, extra) → y` and its VJP with respect to the weights `w` and
the input `x` (`extra`: per-call inputs with no gradient, e.g. positions) into one program, and sorts its
equations into three:
- forward: those that do not depend on the output's cotangent g (the layer's forward pass);
- input: those that depend on g and lead to the input's gradient dx (the critical path of a pipeline);
- weights: those that depend on g and lead only to the weights' gradient dw (for a transformer layer, one
  matmul per weight: dW = Xᵀ·dY).
`forward(w, x, extra) → (y, residuals)`, `input_grad(w, residuals, g) → (dx, boundary, early)` and
`weight_grad(w, boundary) → late` run them; the residuals are the forward values the other two read, the
boundary what the weights' part reads of the others' (each matmul's input and its output's cotangent).
Together they compute `jax.vjp` exactly, in three calls (`gradient(early, late)` is dw). An equation is
never split: one that computes both (a shard_map whose body yields some weights' gradient with an input's:
a mixture of experts' dispatch) runs in the input part. A weight's gradient that then needs no matmul
(that one's, at most cast from the compute dtype) is finished there too, for deferring it would only
carry a weight-sized value to the weights' part: those are `early` (the leaves `Split.early` of dw), and
the weights' part computes the others, `late`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore


def _is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def _needed(eqns: Sequence[Any], outputs: Sequence[Any]) -> list[bool]:
    """Which equations the `outputs` depend on (or that have effects)."""
    need, keep = {v for v in outputs if _is_var(v)}, [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        if eqns[i].effects or any(v in need for v in eqns[i].outvars):
            keep[i] = True
            need.update(v for v in eqns[i].invars if _is_var(v))
    return keep


def _has_matmul(eqn: Any) -> bool:
    """Whether an equation multiplies matrices, itself or inside a program it carries (a scan's, a shard_map's,
    a cond's branches)."""
    if "dot" in eqn.primitive.name:
        return True
    values = [v for p in eqn.params.values() for v in (p if isinstance(p, (tuple, list)) else (p,))]
    inner = [getattr(v, "jaxpr", v) for v in values if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    return any(_has_matmul(e) for jaxpr in inner for e in getattr(jaxpr, "eqns", ()))


def _run(eqns: Sequence[Any], env: dict) -> Callable[[Any], Any]:
    """Evaluate `eqns` in order into `env` (as `jax.core.eval_jaxpr` does); returns a reader of `env`."""
    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in eqns:
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return read


@dataclasses.dataclass(frozen=True)
class Split:
    """The three parts of one traced VJP (module docstring); pytrees in, pytrees out."""

    jaxpr: Any
    consts: list
    eqns: tuple[list, list, list]  # forward, input, weights
    residuals: list
    boundary: list
    early: tuple[int, ...]  # the leaves of dw that the input part computes; the weights' part the others
    trees: tuple[Any, Any, Any]  # of w, x, y
    counts: tuple[int, int, int, int]  # leaves of w, x, extra, y

    @classmethod
    def of(cls, fn: Callable[[Any, Any, Any], Any], w: Any, x: Any, extra: Any) -> Split:
        def full(w, x, extra, g):
            y, vjp = jax.vjp(lambda w, x: fn(w, x, extra), w, x)
            return y, vjp(g)

        y = jax.eval_shape(fn, w, x, extra)
        closed = jax.make_jaxpr(full)(w, x, extra, y)
        jaxpr, counts = closed.jaxpr, tuple(len(jax.tree.leaves(t)) for t in (w, x, extra, y))
        nw, nx, ne, ny = counts
        g_in, (y_out, dw_out, dx_out) = jaxpr.invars[nw + nx + ne:], _cut(jaxpr.outvars, (ny, nw, nx))
        on_g, depends = set(g_in), []
        for eqn in jaxpr.eqns:
            depends.append(any(_is_var(v) and v in on_g for v in eqn.invars))
            if depends[-1]:
                on_g.update(eqn.outvars)
        for_y, for_dx, for_dw = (_needed(jaxpr.eqns, outs) for outs in (y_out, dx_out, dw_out))
        parts = ([], [], [])
        for i, eqn in enumerate(jaxpr.eqns):
            if not depends[i] and (for_y[i] or for_dx[i] or for_dw[i]):
                parts[0].append(eqn)
            elif depends[i] and for_dx[i]:
                parts[1].append(eqn)
            elif depends[i] and for_dw[i]:
                parts[2].append(eqn)
        # a weight's gradient whose weights' part has no matmul is finished with the input's (module docstring)
        finished = set()
        for v in dw_out:
            needs = [eqn for eqn, need in zip(parts[2], _needed(parts[2], [v])) if need]
            if not any(map(_has_matmul, needs)):
                finished.update(map(id, needs))
        parts[1].extend(eqn for eqn in parts[2] if id(eqn) in finished)
        parts = (parts[0], parts[1], [eqn for eqn in parts[2] if id(eqn) not in finished])
        # what a part reads; the weights and constants every part has, so neither is carried between them
        reads = lambda eqns, outs: {v for e in eqns for v in e.invars if _is_var(v)} | {v for v in outs if _is_var(v)}
        made = lambda eqns: [v for e in eqns for v in e.outvars]
        late_made = set(made(parts[2]))
        early = tuple(i for i, v in enumerate(dw_out) if v not in late_made)
        early_out, late_out = [dw_out[i] for i in early], [v for v in dw_out if v in late_made]
        later = reads(parts[1], dx_out + early_out) | reads(parts[2], late_out)
        residuals = [v for v in jaxpr.invars[nw:nw + nx + ne] + made(parts[0]) if v in later]
        weight_reads = reads(parts[2], late_out)
        boundary = [v for v in residuals + list(g_in) + made(parts[1]) if v in weight_reads]
        trees = tuple(jax.tree.structure(t) for t in (w, x, y))
        return cls(jaxpr, closed.consts, parts, residuals, boundary, early, trees, counts)

    def _env(self, w: Any) -> dict:
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars[:self.counts[0]], jax.tree.leaves(w)))
        return env

    def forward(self, w: Any, x: Any, extra: Any) -> tuple[Any, list]:
        """(y, the residuals the other parts read)."""
        nw, nx, ne, ny = self.counts
        env = self._env(w)
        env.update(zip(self.jaxpr.invars[nw:nw + nx + ne], jax.tree.leaves(x) + jax.tree.leaves(extra)))
        read = _run(self.eqns[0], env)
        return jax.tree.unflatten(self.trees[2], [read(v) for v in self.jaxpr.outvars[:ny]]), \
            [read(v) for v in self.residuals]

    @property
    def late(self) -> tuple[int, ...]:
        """The leaves of dw that the weights' part computes."""
        return tuple(i for i in range(self.counts[0]) if i not in self.early)

    def _dw_out(self, leaves: tuple[int, ...]) -> list:
        ny = self.counts[3]
        return [self.jaxpr.outvars[ny + i] for i in leaves]

    def input_grad(self, w: Any, residuals: list, g: Any) -> tuple[Any, list, list]:
        """(dx, the boundary the weights' part reads, the `early` leaves of dw)."""
        nw, nx, ne, ny = self.counts
        env = self._env(w)
        env.update(zip(self.residuals, residuals))
        env.update(zip(self.jaxpr.invars[nw + nx + ne:], jax.tree.leaves(g)))
        read = _run(self.eqns[1], env)
        return (jax.tree.unflatten(self.trees[1], [read(v) for v in self.jaxpr.outvars[ny + nw:]]),
                [read(v) for v in self.boundary], [read(v) for v in self._dw_out(self.early)])

    def weight_grad(self, w: Any, boundary: list) -> list:
        """The `late` leaves of dw, from the boundary."""
        env = self._env(w)
        env.update(zip(self.boundary, boundary))
        read = _run(self.eqns[2], env)
        return [read(v) for v in self._dw_out(self.late)]

    def gradient(self, early: list, late: list) -> Any:
        """dw, the weights' tree, from both parts' leaves."""
        leaves = dict(zip(self.early, early)) | dict(zip(self.late, late))
        return jax.tree.unflatten(self.trees[0], [leaves[i] for i in range(self.counts[0])])


def _cut(seq: Sequence[Any], sizes: Sequence[int]) -> list[list]:
    out, start = [], 0
    for size in sizes:
        out.append(list(seq[start:start + size]))
        start += size
    return out
