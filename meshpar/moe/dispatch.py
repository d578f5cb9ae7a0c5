"""The experts' feed-forward: tokens sent to the devices of their experts, computed, sent back, combined.

Letters (`meshpar/__init__.py`): E experts, El = E / ep of them on each device (ep: the `expert` mesh
axis), k experts per token, n tokens on a device, Q = n·k its assignments, r rows a device sends to each
expert shard (x: the expert shards, in a buffer's name), I = ep · r rows it receives, U an expert's capacity,
D d_model, F an expert's width (F / model under tensor parallelism).

What is sharded. The expert weights [E, D, F] are split over `expert` (E) and `model` (F, Megatron inside
each expert); at rest also over `fsdp` (D, ZeRO-3: gathered for compute like any weight). The batch is
split over `expert` too (with `data` and `fsdp`), so every device routes its own n tokens.

The dispatch, per MoE layer, inside one `jax.shard_map` (manual over the batch, sequence, expert and model
axes): each device sorts its Q assignments by expert, writes them into a send buffer [ep, r, D] (row block
j for the experts of expert shard j), and ONE all-to-all over `expert` swaps the blocks, so each device
holds the rows for its own El experts from every device. It computes them and a second all-to-all sends
the results back, where each assignment's output is weighed and added to its token. Under tensor
parallelism each `model` shard computes its F / model slice of every expert and the token outputs are
summed over `model` (one all-reduce of [n, D]).

Rows whole on every device. Outside the training step the batch may not divide over the batch axes
(generation's one prompt): every device of `expert` then holds the same n tokens, so none is sent. Each
device computes the assignments of its own El experts (its block of the send buffer) and the token outputs
are summed over `expert`, with the `model` sum when there is one: one all-reduce of [n, D], no all-to-all.

Two ways to size r (`parallel.expert_capacity`):
- dropless (0, the default): no assignment is ever dropped. The rows a device sends to one expert shard
  are at most n · min(k, El) (a token's k experts are distinct), so r is that, the rows are packed in
  expert order, and the experts run as grouped matmuls over the sorted rows (`jax.lax.ragged_dot`,
  group sizes from the counts). The buffers are sized for the worst case: with ep > 1 a device sends and
  receives ep · r rows, up to ep times the rows that carry a token. XLA (CPU and GPU, jax 0.10–0.12) has no
  grouped kernel: it compiles each ragged_dot as El matmuls over all ep · r rows, masked, so with many
  local experts dropless costs El · ep · r / (n · k) times the FLOPs of the rows that carry a token
  (`deepseek_v3`'s H100 program on expert=8: 143 times the model's FLOPs; at capacity 1.25, 1.36).
- capacity c > 0: each expert takes at most U = ceil(c · n · k / E) assignments of a device's tokens (in
  token order; the rest are dropped, their tokens keep only the residual and any shared expert), so r =
  El · U and the buffer is the GShard layout [ep, El, U, D]: the experts run as one batched matmul over
  [El, ep · U, D], no sort on arrival.

Collectives per MoE layer per device (a remat policy other than `none` runs the forward ones again in the
backward pass; `meshpar.plan.comm` counts them so, and the tests hold it to the compiled step):
| what                             | collective                 | fwd + bwd | bytes each                        |
|----------------------------------|----------------------------|-----------|-----------------------------------|
| rows to their experts, back      | all-to-all (expert)        | 2 + 2     | ep · r · D · bytes (a 1/ep stays) |
| the rows' expert ids             | all-to-all (expert)        | 1 + 0     | ep · r · 4 (dropless only)        |
| TP: the experts' outputs         | all-reduce (model)         | 1 + 0     | n · D · bytes                     |
| TP: the received rows' gradient  | all-reduce (model)         | 0 + 2     | ep · r · D · bytes (gate, up)     |
| rows whole: the experts' outputs | all-reduce (expert, model) | 1 + 0     | n · D · bytes (no all-to-all)     |

When it pays. An expert's weights (3·D·F) stay on their devices and only tokens move: per token and layer
2·k·D values each way, against 6·k·D·F FLOPs of expert compute, so the all-to-all hides behind the
matmuls when F > (FLOP/s ÷ link bandwidth) / 3, about 2,000 bf16 rows over NVLink; across nodes it is
the slowest collective of the step (keep `expert` inside a node where it fits).
"""

from __future__ import annotations

import fractions
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshpar import context, fp8, sharding

# The logical axes of the experts' weights, their biases (gpt-oss), and of the tokens the dispatch reads.
GATE_UP = ("experts", "expert_embed", "expert_mlp")
DOWN = ("experts", "expert_mlp", "expert_embed")
GATE_UP_BIAS = ("experts", "expert_mlp")
DOWN_BIAS = ("experts", "expert_embed")
TOKENS = ("batch", "seq", "embed")


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def capacity() -> float:
    """The active step's `parallel.expert_capacity` (0: dropless, also outside a step)."""
    compute = context.active()
    return compute.rules.parallel.expert_capacity if compute is not None else 0.0


def rows_per_shard(n: int, k: int, experts: int, shards: int, capacity: float) -> int:
    """r: the rows a device sends to each expert shard (module docstring)."""
    local = experts // shards
    return n * min(k, local) if not capacity else local * expert_capacity(n, k, experts, capacity)


def expert_capacity(n: int, k: int, experts: int, capacity: float) -> int:
    """U: the assignments of a device's n tokens one expert takes at capacity factor `capacity`."""
    # In exact arithmetic, c the decimal it was written as: in floats 1.1 · 50 · 8 / 8 is 55.00000000000001,
    # whose ceiling would be 56.
    c = fractions.Fraction(str(float(capacity)))
    return min(n * k, math.ceil(c * n * k / experts))


def experts_ffn(x_BTD: jax.Array, experts_BTk: jax.Array, weights_BTk: jax.Array, w_gate_EDF: jax.Array,
                w_up_EDF: jax.Array, w_down_EFD: jax.Array, capacity: float = 0.0, *,
                biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                gated: Callable[[jax.Array, jax.Array], jax.Array] = swiglu) -> tuple[jax.Array, jax.Array]:
    """Σ over each token's k experts of weight · down_e(gated(gate_e(x), up_e(x))), and the assignments
    dropped per row [B]. `biases`: (gate [E, F], up [E, F], down [E, D]) added to each expert's projections
    (gpt-oss), or None; `gated`: the unit between them (SwiGLU's, or the model's `gated_unit`).

    The weights come in their compute layout (`sharding.gathered`). Outside a step, on one device, or
    with no mesh axis splitting the tokens, experts or F, it runs as one device would."""
    compute = context.active()
    local = functools.partial(_local, capacity=capacity, experts=w_gate_EDF.shape[0], gated=gated)
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD, biases)
    if compute is None:
        return local(x_BTD, experts_BTk, weights_BTk, *weights, expert_axis=None, model=(), recipe=None)
    mesh, table = compute.mesh, compute.rules.table("activations")
    spec = lambda logical, x: sharding.spec_for(logical, x.shape, table, mesh.shape, f"MoE input {logical}")
    tokens, gate_up, down = spec(TOKENS, x_BTD), spec(GATE_UP, w_gate_EDF), spec(DOWN, w_down_EFD)
    bias_specs = None if biases is None else (P(gate_up[0], gate_up[2]),) * 2 + (P(down[0], down[2]),)
    routes, rows = P(*tokens[:2], None), P(tokens[0])
    names = set(sharding.spec_axes(tokens) + sharding.spec_axes(gate_up) + compute.vmapped)
    if not names:
        return local(x_BTD, experts_BTk, weights_BTk, *weights, expert_axis=None, model=(), recipe=fp8.for_experts(()))
    expert_axis = "expert" if "expert" in sharding.spec_axes(gate_up) else None
    model = tuple(a for a in sharding.spec_axes(gate_up[2:]))
    body = functools.partial(local, expert_axis=expert_axis, model=model, positions=sharding.spec_axes(tokens[1:2]),
                             whole=expert_axis is not None and expert_axis not in sharding.spec_axes(tokens),
                             vmapped=bool(compute.vmapped),
                             recipe=fp8.for_experts(tuple(sorted(names - set(compute.vmapped))),
                                                    checked=not compute.vmapped))
    # Manual over the size-1 axes too: in a partly manual region jax pins the psums' reducers with sharding
    # constraints, which XLA:CPU's widening of bfloat16 all-reduces cannot clone (a crash at compile time).
    names |= {axis for axis, size in mesh.shape.items() if size == 1}
    return jax.shard_map(body, mesh=mesh, axis_names=names,
                         in_specs=(tokens, routes, routes, gate_up, gate_up, down, bias_specs),
                         out_specs=(tokens, rows), check_vma=not compute.vmapped)(x_BTD, experts_BTk, weights_BTk,
                                                                                  *weights)


def grouped_matmul(x_ID: jax.Array, w_EDF: jax.Array, sizes_E: jax.Array, vmapped: bool,
                   recipe: fp8.Recipe | None = None) -> jax.Array:
    """Rows [I, D] in groups of `sizes_E` consecutive rows, group e times w_EDF[e] (rows past the groups: 0):
    `jax.lax.ragged_dot`. Under a vmap (`vmapped`: the pipeline's lanes, accumulation's replicas), whose
    batching rule ragged_dot lacks for these layouts, a loop over the experts, each multiplying every row
    and keeping its own group's: what XLA runs for ragged_dot anyway (module docstring), but one [I, F]
    product at a time (one matmul of the rows masked per group would hold
    El copies of the rows: 17 GB per GPU at `qwen3_30b_a3b` in a pipeline). In FP8 under `recipe`."""
    if recipe is not None:
        return fp8.grouped(functools.partial(grouped_matmul, vmapped=vmapped), x_ID, w_EDF, sizes_E, recipe=recipe)
    if not vmapped:
        return jax.lax.ragged_dot(x_ID, w_EDF, sizes_E)
    group_I = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(x_ID.shape[0]), side="right")

    @jax.checkpoint  # the backward recomputes the product and its mask: no [I, F] residual per expert
    def own_group(e, w_DF):
        return jnp.where((group_I == e)[:, None], x_ID @ w_DF, 0)

    def one_expert(y_IF, e_and_w):
        return y_IF + own_group(*e_and_w), None

    y_IF = jnp.zeros((x_ID.shape[0], w_EDF.shape[2]), jnp.result_type(x_ID, w_EDF))
    return jax.lax.scan(one_expert, y_IF, (jnp.arange(w_EDF.shape[0]), w_EDF))[0]


def _local(x_btD, experts_btk, weights_btk, w_gate_EDF, w_up_EDF, w_down_EFD, biases, *, capacity: float,
           experts: int, gated, expert_axis: str | None, model: tuple[str, ...], positions: tuple[str, ...] = (),
           whole: bool = False, vmapped: bool = False,
           recipe: fp8.Recipe | None = None) -> tuple[jax.Array, jax.Array]:
    """One device's dispatch (module docstring): its El experts' weights, E / El = ep expert shards; the
    mesh axes in `positions` split the rows' positions (context parallelism), and their drops are summed;
    `whole`: every device of `expert_axis` holds these same tokens (`_exchange`); the experts' matmuls in
    FP8 under `recipe`."""
    b, t, D = x_btD.shape
    k, E, El = experts_btk.shape[-1], experts, w_gate_EDF.shape[0]
    ep, n = E // El, b * t
    Q, r = n * k, rows_per_shard(n, k, E, ep, capacity)
    # The assignments sorted by expert (stable: in token order within an expert).
    expert_Q = experts_btk.reshape(Q)
    order_Q = jnp.argsort(expert_Q, stable=True)
    expert_Q, token_Q = expert_Q[order_Q], order_Q // k
    counts_E = jnp.zeros((E,), jnp.int32).at[expert_Q].add(1)
    rank_Q = jnp.arange(Q) - (jnp.cumsum(counts_E) - counts_E)[expert_Q]  # place within its expert
    shard_Q, local_Q = expert_Q // El, expert_Q % El
    if capacity:
        U = r // El
        kept_Q = rank_Q < U
        row_Q = jnp.where(kept_Q, local_Q * U + rank_Q, r)
    else:  # packed in expert order within each expert shard's block
        first_Q = (jnp.cumsum(counts_E) - counts_E).reshape(ep, El)[:, 0]
        row_Q = jnp.arange(Q) - first_Q[shard_Q]
        kept_Q = row_Q < r  # r holds a shard's every row: counted all the same, so a short buffer shows as drops
    x_nD = x_btD.reshape(n, D)
    send_xrD = jnp.zeros((ep, r, D), x_btD.dtype).at[shard_Q, row_Q].set(x_nD[token_Q], mode="drop")
    there, back = _exchange(expert_axis, whole, ep)
    recv_xrD = there(send_xrD)
    senders = recv_xrD.shape[0]  # the devices whose rows arrive: ep, or this one alone (`whole`)
    gate_bias_EF, up_bias_EF, down_bias_ED = biases or (None, None, None)
    if model and biases:  # the model shards' outputs are summed: one of them adds the down bias
        down_bias_ED = jnp.where(jax.lax.axis_index(model) == 0, down_bias_ED, 0)
    if capacity:  # [ep, El, U, D] → [El, ep·U, D]: one batched matmul per expert
        x_EUD = recv_xrD.reshape(senders, El, U, D).swapaxes(0, 1).reshape(El, senders * U, D)
        gate, up = (fp8.matmul(x_EUD, w, batch=1, recipe=recipe) for w in (w_gate_EDF, w_up_EDF))
        if biases:
            gate, up = gate + gate_bias_EF[:, None], up + up_bias_EF[:, None]
        y_EUD = fp8.matmul(gated(gate, up), w_down_EFD, batch=1, recipe=recipe)
        y_EUD = y_EUD + down_bias_ED[:, None] if biases else y_EUD
        y_xrD = y_EUD.reshape(El, senders, U, D).swapaxes(0, 1).reshape(senders, r, D)
    else:  # rows from every device, sorted by local expert (unfilled rows: El, last), grouped matmuls
        local_xr = there(jnp.full((ep, r), El, jnp.int32).at[shard_Q, row_Q].set(local_Q, mode="drop"))
        local_I = local_xr.reshape(senders * r)
        arrival_I = jnp.argsort(local_I, stable=True)
        sizes_E = jnp.zeros((El + 1,), jnp.int32).at[local_I].add(1)[:El]
        x_ID = recv_xrD.reshape(senders * r, D)[arrival_I]
        gate, up = (grouped_matmul(x_ID, w, sizes_E, vmapped, recipe) for w in (w_gate_EDF, w_up_EDF))
        if biases:  # each row's expert (the unfilled rows past the groups take the last one: never read back)
            expert_I = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(senders * r), side="right"), El - 1)
            gate, up = gate + gate_bias_EF[expert_I], up + up_bias_EF[expert_I]
        y_ID = grouped_matmul(gated(gate, up), w_down_EFD, sizes_E, vmapped, recipe)
        y_ID = y_ID + down_bias_ED[expert_I] if biases else y_ID
        y_xrD = jnp.zeros_like(y_ID).at[arrival_I].set(y_ID).reshape(senders, r, D)
    back_xrD = back(y_xrD)
    y_QD = back_xrD.at[shard_Q, row_Q].get(mode="fill", fill_value=0)
    y_QD = y_QD * weights_btk.reshape(Q)[order_Q][:, None].astype(y_QD.dtype)
    y_nD = jnp.zeros((n, D), y_QD.dtype).at[token_Q].add(y_QD)
    summed = model + ((expert_axis,) if whole else ())
    if summed:  # each model shard summed its F slice; with `whole` tokens each expert shard its experts'
        y_nD = jax.lax.psum(y_nD, summed)
    dropped_b = jnp.zeros((b,), jnp.float32).at[token_Q // t].add((~kept_Q).astype(jnp.float32))
    if positions:  # a row's drops, over all of its positions
        dropped_b = jax.lax.psum(dropped_b, positions)
    return y_nD.reshape(b, t, D), dropped_b


def _exchange(expert_axis: str | None, whole: bool, ep: int):
    """(there, back): how a device's buffer [ep, r, ...] of rows for each expert shard reaches those experts'
    devices, and their outputs [senders, r, D] come back into such a buffer. Over `expert_axis`, all-to-alls;
    with its tokens `whole` on every device of it (generation's rows, which the batch axes do not divide),
    a device keeps only the block of its own experts and finds zeros in the others' place (the caller sums
    the outputs over the axis); with no expert axis, nothing moves."""
    if expert_axis is None:
        return (lambda a: a), (lambda a: a)
    if not whole:
        swap = lambda a: jax.lax.all_to_all(a, expert_axis, 0, 0)
        return swap, swap
    own = jax.lax.axis_index(expert_axis)
    keep = lambda a: jax.lax.dynamic_index_in_dim(a, own, 0)
    put = lambda y: jax.lax.dynamic_update_index_in_dim(jnp.zeros((ep,) + y.shape[1:], y.dtype), y, own, 0)
    return keep, put
