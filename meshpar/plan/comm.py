"""What one step of a layout communicates, per device, and how long each collective takes.

Collectives per device per step (`Collective`: mesh axes, op, bytes, count). Bytes are the RESULT on
one device (what `meshpar.compiler.hlo` counts); time uses the wire bytes of a ring over the axes, split
into its part inside a host (NVLink) and across hosts (network), as `meshpar.mesh.host_split` lays them
out: all-reduce 2(n−1)/n·size, all-gather / reduce-scatter (n−1)/n·size, all-to-all (n−1)/n·size,
collective-permute size.
- gradient sync over the weight-replica axes data × fsdp × expert × sequence (the experts' weights, split over
  `expert`, over data × fsdp × sequence only): ZeRO 0 all-reduce of 4Ψ_l; ZeRO 1
  all-reduce + all-gather of the updated float32 params over fsdp; ZeRO 2 reduce-scatter over fsdp,
  all-reduce over data × sequence, all-gather of params; ZeRO 3 reduce-scatter + all-reduce and the
  weights all-gathered for compute (in e bytes; the layers' in 1 byte under `train.fp8 = tensorwise`, their
  norm scales counted with them): once per step for embedding/head, per microbatch for the layers, again in
  the backward pass with remat (XLA re-gathers instead of keeping them). The output
  head's gradient leaves the chunked loss already reduced (a reduce-scatter over the batch axes under
  ZeRO-2/3). Gradient accumulation keeps the accumulator in the gradients' layout and syncs the pure
  replica axes once per step. Overlapped with compute (XLA's async collectives); only the excess over
  compute, at least one layer's share, shows.
- tensor parallelism per layer per microbatch, a = b·t·D·e: all-reduces, 2 forward and 5 backward
  (XLA reduces dq/dk/dv and dgate/dup input gradients separately; measured), +1 with full remat (the
  attention output is recomputed; the layer output is not needed); plus the vocab-parallel embedding
  (forward) and head (backward). With Megatron SP each all-reduce becomes a reduce-scatter, 6 all-gathers
  of a per layer enter the regions (forward 2, backward 4; +2 when remat recomputes them), and GSPMD
  adds all-to-alls in the backward that reshard attention's scores and softmax statistics between the
  sequence- and head-split layouts: `SP_ALL_TO_ALL`·a per layer, measured on model=8. The
  vocab-parallel loss all-reduces its softmax statistics [b, t] forward and the hidden states' float32
  gradient backward. Not overlapped (critical path).
- expert parallelism (`meshpar.moe.dispatch`'s table) per MoE layer per microbatch: all-to-alls over `expert`
  of ep·r·D·e, the rows out and back, forward 2 and backward 2 (their transposes), + 1 of the rows' int32
  expert ids ep·r·4 forward (dropless); every remat policy but `none` runs the forward's again in the
  backward pass (they are no matmul results: measured on the compiled step). Under tensor parallelism a MoE
  layer's MLP all-reduces are the experts' output [b·t, D] forward, and backward the gradient of the rows
  received, per row ep·r·D·e, twice (gate and up), and of the combine weights (n·k float32), in place of the
  dense MLP's. XLA:CPU widens the bfloat16 all-to-alls to float32 (`cpu=True`). Exposed (the experts wait
  for their rows).
- context parallelism per layer per microbatch: all-gather K, V (2·b·T·K_l·H·e) + reduce-scatter of
  their gradients; ring: 2(n−1) collective-permutes of 2·b·t·K_l·H·e (forward K/V, backward dK/dV),
  overlapped with the block matmuls, + the zigzag reorder (load_balance) ~2·b·t·(N_l+K_l)·H·e each way;
  Ulysses: 8 all-to-alls of q, k, v, out. Plus the gradient sync over `sequence` above.
- pipeline (`meshpar.pipeline.gpipe`'s table): 2 collective-permutes of b·t·D·e per schedule iteration
  (forward and backward), the result leaving stage 0 and its gradient (all-reduces of M·b·t·D·e);
  exposed. (With R > 1 the stack is stored in the stages' order, so no weights move between stages.)
- host offload (`host_traffic`): the moments in and out for the update; with `optimizer+params` the
  weights fetched where the ZeRO-3 gathers happen, the gradients out, and the weights and gradients in
  and the weights out for the update; remat `offload`'s saved projections out in the forward, in in the
  backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from meshpar.hardware import Hardware
from meshpar.mesh import AXES, host_split
from meshpar.plan.layout import (PRECISIONS, Layout, Run, expert_rows, layer_applications, local_dims, local_elements,
                                 local_tensors, passes)
from meshpar.plan.memory import host_layer_bytes_per_token
from meshpar.plan.shape import Shape

TP_ALL_REDUCES = (2, 5)  # per layer: forward, backward (measured in the compiled step, see the docstring)
FP8_AMAXES = 11  # per layer and microbatch pass: the matmuls' 4 inputs (q, k, v share one) and 7 output gradients
SP_ALL_TO_ALL = 1.28  # per layer, × a: GSPMD's attention reshards under Megatron SP (measured, model=8)


@dataclasses.dataclass(frozen=True)
class Collective:
    axes: tuple[str, ...]
    op: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    bytes: float  # result bytes per device, one call (what meshpar.compiler.hlo counts)
    count: float
    kind: str  # dp (overlapped), tp, ep, cp, ring (overlapped with its blocks), pp, fp8


def weight_passes(lay: Layout) -> int:
    """How often a step gathers (ZeRO-3) or fetches from host memory (offload) the layers' weights: per
    accumulation step once, and outside a pipeline again in the backward pass (every remat policy,
    `none` too, gathers again instead of keeping them: meshpar.layers; a pipeline holds its stage's
    weights)."""
    return lay.grad_accum * (2 if lay.mesh.stage == 1 else 1)


def host_traffic(shape: Shape, lay: Layout, run: Run) -> tuple[float, float]:
    """(host→device, device→host) bytes per device per step of host offload (see the module docstring)."""
    pb, gb, ob = PRECISIONS[run.precision]
    moments = ob * local_elements(shape, lay, "optimizer", part="trained") if lay.parallel.offload != "none" else 0.0
    in_, out = moments, moments  # the update's moments
    if lay.parallel.offload == "optimizer+params":
        params = pb * local_elements(shape, lay, "params")
        grads = gb * local_elements(shape, lay, "grads", part="trained")
        layers = pb * local_elements(shape, lay, "params", only_layers=True)
        in_ += params - layers + layers * weight_passes(lay) + params + grads  # fetches; the update's inputs
        out += grads + params  # the gradients landing in host memory; the updated weights
    b, t, *_ = local_dims(shape, lay, run)
    saved = host_layer_bytes_per_token(shape, lay, run) * b * t * layer_applications(shape, lay)
    return in_ + saved, out + saved  # remat offload: out in the forward pass, in in the backward


def collectives(shape: Shape, lay: Layout, run: Run, *, cpu: bool = False) -> list[Collective]:
    """What one step communicates per device. `cpu=True`: the forms XLA's CPU backend emits (reduce-scatter
    as all-reduce of the whole input then a slice; weights gathered in float32, then cast)."""
    out = _data_parallel(shape, lay, run, cpu)
    if lay.mesh.model > 1:
        out += _tensor_parallel(shape, lay, run, cpu)
    if shape.experts and lay.mesh.expert > 1:
        out += _expert_parallel(shape, lay, run, cpu)
    if lay.mesh.sequence > 1:
        out += _context_parallel(shape, lay, run)
    batch = tuple(a for a in ("data", "fsdp", "expert", "sequence") if lay.sizes[a] > 1)
    if run.fp8 != "none" and batch:  # each activation's FP8 scale is the whole tensor's (meshpar.fp8)
        out.append(Collective(batch, "all-reduce", 4, FP8_AMAXES * layer_applications(shape, lay), "fp8"))
    if lay.mesh.stage > 1:  # gpipe.py's table: the shifts, the result leaving stage 0 (and its gradient)
        b, t, *_ = local_dims(shape, lay, run)
        a = b * t * shape.d_model * run.e
        out.append(Collective(("stage",), "collective-permute", a, 2 * passes(lay), "pp"))
        out.append(Collective(("stage",), "all-reduce", lay.M * a, 2 * lay.grad_accum, "pp"))
    return out


def _data_parallel(shape: Shape, lay: Layout, run: Run, cpu: bool) -> list[Collective]:
    """The gradient sync over the replicas of the weights, and ZeRO's parameter all-gathers. The output
    head's gradient leaves the loss reduced (meshpar.loss): with ZeRO-2/3 over fsdp as an explicit
    reduce-scatter over every batch-and-sequence axis (fsdp major), then an all-gather back over the others.
    ZeRO splits the weights outside the experts over `expert` too (meshpar.rules); their share of it is priced
    as `expert`'s replicas are, an all-reduce (XLA:CPU's compiled all-reduces within 10%: tests/test_plan_moe.py)."""
    out: list[Collective] = []
    pb, gb, _ = PRECISIONS[run.precision]
    whole = local_elements(shape, lay, "activations")
    layer_whole = local_elements(shape, lay, "activations", only_layers=True)
    trained = local_elements(shape, lay, "activations", part="trained")  # what has gradients (a LoRA run: adapters)
    experts = sum(n for i, (n, (_, names)) in enumerate(zip(local_tensors(shape, lay, "activations"), shape.elements()))
                  if "experts" in names and not shape.is_frozen(i))
    head = shape.d_model * shape.vocab * (not any(shape.is_frozen(i) for i, (_, names) in enumerate(shape.elements())
                                                  if "vocab" in names))
    replicas = tuple(a for a in ("data", "expert", "sequence") if lay.sizes[a] > 1)
    fsdp = ("fsdp",) if lay.mesh.fsdp > 1 else ()
    zero = lay.parallel.zero_stage
    split = bool(fsdp) and zero >= 2
    G = gb * (trained - experts - (head if split else 0))
    # (axes the gradient is whole over, its bytes): the experts' is split over `expert`, not a replica of it
    groups = [(replicas, G)] + ([(tuple(a for a in replicas if a != "expert"), gb * experts)] if experts else [])
    if split:
        rows = lay.mesh.fsdp * math.prod(lay.sizes[a] for a in replicas)
        out.append(Collective(replicas + fsdp, "reduce-scatter", gb * head / rows, 1, "dp"))
        if replicas:
            out.append(Collective(replicas, "all-gather", gb * head / lay.mesh.fsdp, 1, "dp"))
    for axes, grads in groups:
        if not split:
            if axes + fsdp:
                out.append(Collective(axes + fsdp, "all-reduce", grads, 1, "dp"))
        elif cpu:
            out.append(Collective(axes + fsdp, "all-reduce", grads, 1, "dp"))
        else:
            out.append(Collective(fsdp, "reduce-scatter", grads / lay.mesh.fsdp, 1, "dp"))
            if axes:
                out.append(Collective(axes, "all-reduce", grads / lay.mesh.fsdp, 1, "dp"))
    if fsdp and zero in (1, 2):
        out.append(Collective(fsdp, "all-gather", pb * whole, 1, "dp"))  # the updated parameters
    if fsdp and zero == 3:
        g = pb if cpu else min(run.e, pb)
        out.append(Collective(fsdp, "all-gather", g * (whole - layer_whole), 1, "dp"))  # embedding and head
        layer_g = 1 if run.fp8 == "tensorwise" and not cpu else g  # gathered as FP8 (meshpar.fp8)
        out.append(Collective(fsdp, "all-gather", layer_g * layer_whole, weight_passes(lay), "dp"))
    return out


def _tensor_parallel(shape: Shape, lay: Layout, run: Run, cpu: bool) -> list[Collective]:
    """Megatron tensor parallelism, per layer per microbatch pass (bubbles included), and the
    vocab-parallel embedding and loss."""
    out: list[Collective] = []
    b, t, *_ = local_dims(shape, lay, run)
    D, m, layer_steps = shape.d_model, lay.mesh.model, layer_applications(shape, lay)
    a = b * t * D * run.e
    fwd, bwd = TP_ALL_REDUCES
    reduces = fwd + bwd + (1 if lay.remat == "full" else 0)  # recompute: attention output (x1) again
    mb = passes(lay) if lay.mesh.stage > 1 else lay.grad_accum
    if shape.experts:  # the rows' input gradients (gate, up) and the combine weights' replace dgate, dup
        reduces -= 2
        r, *_ = expert_rows(shape, lay, run)
        out.append(Collective(("model",), "all-reduce", lay.mesh.expert * r * D * run.e, 2 * layer_steps, "tp"))
        out.append(Collective(("model",), "all-reduce", b * t * shape.experts_per_token * 4, layer_steps, "tp"))
    rs, rs_bytes = ("all-reduce", a) if cpu else ("reduce-scatter", a / m)
    if lay.parallel.sequence_parallel:
        gathers = 6 + (2 if lay.remat != "none" else 0)  # recompute re-gathers both region inputs
        out.append(Collective(("model",), rs, rs_bytes, reduces * layer_steps, "tp"))
        out.append(Collective(("model",), "all-gather", a, gathers * layer_steps, "tp"))
        out.append(Collective(("model",), "all-to-all", SP_ALL_TO_ALL * a, layer_steps, "tp"))
        out.append(Collective(("model",), rs, rs_bytes, mb, "tp"))  # embedding output
        out.append(Collective(("model",), "all-gather", a, mb, "tp"))  # into the loss
    else:
        out.append(Collective(("model",), "all-reduce", a, reduces * layer_steps, "tp"))
        out.append(Collective(("model",), "all-reduce", a, mb, "tp"))  # the vocab-parallel embedding
    # the vocab-parallel loss: max, sum of exponentials and target logit [b, t] forward; the hidden
    # states' float32 gradient [b, t, D] backward (meshpar.loss)
    out.append(Collective(("model",), "all-reduce", 3 * b * t * 4 + b * t * D * 4, mb, "tp"))
    return out


def _expert_parallel(shape: Shape, lay: Layout, run: Run, cpu: bool) -> list[Collective]:
    """The dispatch's all-to-alls over `expert`, per MoE layer per microbatch pass."""
    r, *_ = expert_rows(shape, lay, run)
    ep, e, layer_steps = lay.mesh.expert, 4 if cpu else run.e, layer_applications(shape, lay)
    forward = 2 if lay.remat == "none" else 4  # remat replays the forward's in the backward pass
    out = [Collective(("expert",), "all-to-all", ep * r * shape.d_model * e, (forward + 2) * layer_steps, "ep")]
    if not lay.parallel.expert_capacity:  # the rows' expert ids
        out.append(Collective(("expert",), "all-to-all", ep * r * 4, forward // 2 * layer_steps, "ep"))
    return out


def _context_parallel(shape: Shape, lay: Layout, run: Run) -> list[Collective]:
    """Context-parallel attention, per layer per microbatch pass."""
    b, t, N, K, *_ = local_dims(shape, lay, run)
    e, H, n, layer_steps = run.e, shape.head_dim, lay.mesh.sequence, layer_applications(shape, lay)
    kv, mode = 2 * b * t * K * H * e, lay.parallel.context_attention
    if mode == "allgather":  # dK, dV reduce-scattered back in float32 (attention.context_parallel)
        return [Collective(("sequence",), "all-gather", n * kv, layer_steps, "cp"),
                Collective(("sequence",), "reduce-scatter", kv * 4 / e, layer_steps, "cp")]
    if mode == "ring":
        out = [Collective(("sequence",), "collective-permute", kv, 2 * (n - 1) * layer_steps, "ring")]
        if lay.parallel.load_balance:
            out.append(Collective(("sequence",), "collective-permute", b * t * (N + K) * H * e, 4 * layer_steps, "cp"))
        return out
    return [Collective(("sequence",), "all-to-all", b * t * 2 * (N + K) * H * e, 2 * layer_steps, "cp")]


def totals(colls: list[Collective]) -> dict[str, float]:
    """Result bytes per op kind, the unit `meshpar.compiler.hlo.collectives` counts."""
    out: dict[str, float] = {}
    for x in colls:
        out[x.op] = out.get(x.op, 0.0) + x.bytes * x.count
    return out


@functools.lru_cache(maxsize=65536)
def _host_split(*sizes_and_host: int) -> tuple[dict[str, int], dict[str, int]]:
    *sizes, devices_per_host = sizes_and_host
    return host_split(dict(zip(AXES, sizes)), devices_per_host)


def collective_time(x: Collective, lay: Layout, hw: Hardware, devices_per_host: int) -> tuple[float, float]:
    """(wire bytes per device, seconds) of one collective on a hierarchical ring: host, then network."""
    inside, across = _host_split(*lay.sizes.values(), devices_per_host)
    n_in = math.prod(inside[a] for a in x.axes)
    n_out = math.prod(across[a] for a in x.axes)
    n = n_in * n_out
    if n == 1:
        return 0.0, 0.0
    link, net = hw.link_bw * hw.net_efficiency, hw.net_bw * hw.net_efficiency
    size = x.bytes * n if x.op == "reduce-scatter" else x.bytes  # a reduce-scatter's input
    lat = lambda k, lat_: lat_ * math.ceil(math.log2(k)) if k > 1 else 0.0
    if x.op == "collective-permute":
        return size, size / (net if n_out > 1 else link) + (hw.net_latency if n_out > 1 else hw.link_latency)
    if x.op == "all-to-all":
        wire = size * (n - 1) / n
        seconds = size * (n_in - 1) / n / link + size * (n - n_in) / n / net  # other hosts' part uses the NIC
        return wire, seconds + lat(n_in, hw.link_latency) + lat(n_out, hw.net_latency)
    factor = 2 if x.op == "all-reduce" else 1
    wire = factor * size * (n - 1) / n
    seconds = factor * (size * (n_in - 1) / n_in / link + (size / n_in) * (n_out - 1) / n_out / net
                        + lat(n_in, hw.link_latency) + lat(n_out, hw.net_latency))
    return wire, seconds
