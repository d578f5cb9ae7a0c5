"""The analytic model of one layout: per-device memory, collectives, compute and step time of OUR model.

The model is `models/transformer.py` (taken duck-typed: vocab_size, d_model, n_layers, n_heads,
n_kv_heads, d_ff, tie_embeddings): embedding V×D; per layer RMSNorm D, wq D×N×H, wk, wv D×K×H,
wo N×H×D, RMSNorm D, SwiGLU gate/up D×F and down F×D; final RMSNorm D; head D×V unless tied. Which
device holds which part of every tensor comes from `meshpar.rules.make` itself (the same tables the
training step uses), so the parameter, gradient and optimizer bytes per device are exact.

Letters: B global batch, T sequence, b = B/(data·fsdp·M·K) rows in one microbatch on one device
(M pipeline microbatches, K gradient-accumulation steps), t = T/sequence positions per device,
c compute-dtype bytes, N/K/F/V heads/kv heads/ffw/vocab split over `model` (N_l = N/model, ...).

Memory per device (`Memory`), fitted to what XLA allocates for this model (`launch.compile`; the
tests hold the per-device peak to 10% at `llama_8b`/`llama_70b` sizes, T 4k–32k):
- params, optimizer: at rest, by the params/optimizer tables: float32 params 4 + Adam moments 8 bytes per
  element (`precision="mixed"`, the ZeRO paper's convention: 2 + 12). These are XLA's argument bytes.
- grads: the gradient in its own layout (`rules` grads table: split over fsdp under ZeRO-2/3).
- activations: what the backward pass keeps of every layer this device runs, per local token
  (`layer_bytes_per_token`): `full` remat keeps each layer's input (c·D, ÷ model with Megatron SP);
  `dots` also q, k, v, the attention projection, gate and up; `none` every intermediate (the fitted
  `SAVED_NONE`). Attention adds what its kernel holds (`attention_bytes_per_token`): nothing for the
  blockwise kernel beyond its output and log-sum-exp; the dense kernel's float32 scores and
  probabilities [t, T]; ring's per-step inputs; all-gather's whole K and V. Plus one layer's backward
  working set (`WORKING`, fitted): the peak is inside a layer's backward pass. The loss is chunked
  (`meshpar.loss`): it holds at most one chunk of logits, counted in the working set. The pipeline's
  scan keeps every iteration's stage input ((R·M + S − 1) microbatch passes), plus one stage's layers
  while it recomputes them; 1F1B (`pipeline_schedule`) 2(S − 1) + 2 whatever M (`activations_1f1b`).
- other: the output head's whole float32 gradient and gathered compute copy (`HEAD_BYTES` per element),
  the int32 token batch, the pipeline's stage weights held for the step (`PIPELINE_BYTES`, more with
  fsdp), and the accumulation buffer (K > 1), in the gradients' own layout: its fsdp/model/stage shard.
- host offload (`meshpar.offload`), per device: `optimizer` moves the Adam moments (8 bytes per element of
  the optimizer table) to host memory (`host_states`); `optimizer+params` the float32 weights too, and
  the weight gradients land there (`host_temp`), while one layer's fetched weights and their gradient
  pass through the device. The update brings each offloaded array to the device in turn (XLA moves each
  array separately; the new values overwrite it before it goes back): `update` holds the largest
  tensor's offloaded states, and the peak is the larger of that and the activations (freed by then).
  Remat `offload` keeps on the device what `full` keeps (each layer's input) and in host memory (host
  temp) what `dots` keeps beyond it (q, k, v, the attention projection, gate and up); one layer's come
  back for its backward pass, which otherwise works as with `dots`.

Collectives per device per step (`Collective`: mesh axes, op, bytes, count). Bytes are the RESULT on
one device (what `meshpar.analysis` counts); time uses the wire bytes of a ring over the axes, split into
its part inside a host (NVLink) and across hosts (network), as `meshpar.mesh.host_split` lays them out:
all-reduce 2(n−1)/n·size, all-gather / reduce-scatter (n−1)/n·size, all-to-all (n−1)/n·size,
collective-permute size.
- gradient sync over the weight-replica axes data × fsdp × sequence: ZeRO 0 all-reduce of 4Ψ_l; ZeRO 1
  all-reduce + all-gather of the updated float32 params over fsdp; ZeRO 2 reduce-scatter over fsdp,
  all-reduce over data × sequence, all-gather of params; ZeRO 3 reduce-scatter + all-reduce and the
  weights all-gathered for compute (in c bytes): once per step for embedding/head, per microbatch for the
  layers, again in the backward pass with remat (XLA re-gathers instead of keeping them). The output
  head's gradient leaves the chunked loss already reduced (a reduce-scatter over the batch axes under
  ZeRO-2/3). Gradient accumulation keeps the accumulator in the gradients' layout and syncs the pure
  replica axes once per step. Overlapped with compute (XLA's async collectives); only the excess over
  compute, at least one layer's share, shows.
- tensor parallelism per layer per microbatch, a = b·t·D·c: all-reduces, 2 forward and 5 backward
  (XLA reduces dq/dk/dv and dgate/dup input gradients separately; measured), +1 with full remat (the
  attention output is recomputed; the layer output is not needed); plus the vocab-parallel embedding
  (forward) and head (backward). With Megatron SP each all-reduce becomes a reduce-scatter, 6 all-gathers
  of a per layer enter the regions (forward 2, backward 4; +2 when remat recomputes them), and GSPMD
  adds all-to-alls in the backward that reshard attention's scores and softmax statistics between the
  sequence- and head-split layouts: `SP_ALL_TO_ALL`·a per layer, measured on model=8. The
  vocab-parallel loss all-reduces its softmax statistics [b, t] forward and the hidden states' float32
  gradient backward. Not overlapped (critical path).
- context parallelism per layer per microbatch: all-gather K, V (2·b·T·K_l·H·c) + reduce-scatter of
  their gradients; ring: 2(n−1) collective-permutes of 2·b·t·K_l·H·c (forward K/V, backward dK/dV),
  overlapped with the block matmuls, + the zigzag reorder (load_balance) ~2·b·t·(N_l+K_l)·H·c each way;
  Ulysses: 8 all-to-alls of q, k, v, out. Plus the gradient sync over `sequence` above.
- pipeline (meshpar.pipeline's table): 2 collective-permutes of b·t·D·c per schedule iteration (forward
  and backward), the result leaving stage 0 and its gradient (all-reduces of M·b·t·D·c); exposed. (With
  R > 1 the stack is stored in the stages' order, so no weights move between stages.)

Compute: model FLOPs per token 6·N_mm + 12·L·N·H·T (PaLM, arXiv:2204.02311 App. B, N_mm the matmul
parameters: every weight but the input embedding lookup and the norm scales; the attention term is the
full T×T square, NOT halved for the causal mask — the convention MFU is reported in). What a device
executes: forward 2·N_mm,l + 4·N_l·H·T_kv per token (local, all-gather and Ulysses attention compute the
masked half too; zigzag ring only the visible blocks, ≈ half), backward twice that, +1 forward of the
layers with full remat, +1 attention forward with dots and with ring (its steps are rematerialised).
Time = FLOPs / (peak · efficiency) + HBM traffic of the non-matmul tensors (3 passes over the
activations, / HBM bandwidth) per microbatch, times the pipeline schedule's (R·M + S − 1)/(R·M), plus the
exposed communication, plus the optimizer update (memory-bound), plus the host↔device copies of offload
(`host_traffic`: the moments in and out for the update; with `optimizer+params` the weights fetched where
the ZeRO-3 gathers happen, the gradients out, and the weights and gradients in and the weights out for
the update; remat `offload`'s saved projections out in the forward, in in the backward).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from meshpar.mesh import AXES, host_split
from meshpar.plan_hardware import Hardware
from meshpar.rules import OFFLOAD as OFFLOADS, ParallelConfig, make as make_rules

REMATS = ("none", "dots", "full", "offload")
MODES = ("allgather", "ring", "ulysses")
PRECISIONS = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}  # bytes per element: params, grads, optimizer
EFFICIENCY = 0.6  # achieved / peak matmul FLOP/s: a stated default, not fitted (see the published-run tests)
TP_ALL_REDUCES = (2, 5)  # per layer: forward, backward (measured in the compiled step, see the docstring)
SP_ALL_TO_ALL = 1.28  # per layer, × a: GSPMD's attention reshards under Megatron SP (measured, model=8)
# Per element of a pipeline stage's weights (pipeline.py holds them for the step, gathered over fsdp):
# each shard's float32 gradient and a compute copy (6 bytes); with fsdp the gathered float32 copy and
# the float32 copy of the chunk the layer loop reads too (9 more). Fitted as SAVED_NONE. The XLA of jax
# 0.12 holds 4 bytes fewer per element (measured: 4.0-4.2 at llama_8b stage=2 with and without fsdp,
# llama_70b stage=4,fsdp=16).
PIPELINE_BYTES, PIPELINE_GATHER_BYTES = 6, 9
PIPELINE_SAVED_BYTES = 4 if jax.__version_info__ >= (0, 12) else 0


@dataclasses.dataclass(frozen=True)
class Shape:
    """The transformer's dimensions (from any object with the TransformerConfig field names)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    tied: bool = False

    @classmethod
    def of(cls, cfg) -> Shape:
        if isinstance(cfg, Shape):
            return cfg
        return cls(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff,
                   bool(getattr(cfg, "tie_embeddings", False)))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def tensors(self) -> list[tuple[int, tuple[str, ...]]]:
        """(elements, logical axes) of every parameter, layer tensors stacked under `layers`."""
        V, D, L, N, K, F, H = self.vocab, self.d_model, self.layers, self.heads, self.kv_heads, self.d_ff, self.head_dim
        out = [(V * D, ("vocab", "embed"))]
        out += [(L * n, ("layers", *names)) for n, names in (
            (D, ("embed",)), (D * N * H, ("embed", "heads", "head_dim")),
            (D * K * H, ("embed", "kv_heads", "head_dim")), (D * K * H, ("embed", "kv_heads", "head_dim")),
            (N * H * D, ("heads", "head_dim", "embed")),
            (D, ("embed",)), (D * F, ("embed", "mlp")), (D * F, ("embed", "mlp")), (F * D, ("mlp", "embed")))]
        out.append((D, ("embed",)))
        if not self.tied:
            out.append((D * V, ("embed", "vocab")))
        return out

    @property
    def params(self) -> int:
        return sum(n for n, _ in self.tensors())

    @property
    def layer_params(self) -> int:
        return sum(n for n, names in self.tensors() if names[0] == "layers") // self.layers

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul: all but the embedding lookup and the norm scales."""
        D, N, K, F, H = self.d_model, self.heads, self.kv_heads, self.d_ff, self.head_dim
        return self.layers * (2 * D * N * H + 2 * D * K * H + 3 * D * F) + D * self.vocab

    def model_flops_per_token(self, seq_len: int) -> float:
        """PaLM's 6N + 12·L·H·Q·T (full attention square, not halved for the causal mask)."""
        return palm_flops_per_token(self.matmul_params, self.layers, self.heads, self.head_dim, seq_len)


def palm_flops_per_token(params: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """Model FLOPs per token, PaLM (arXiv:2204.02311) App. B: 6N + 12·L·H·Q·T."""
    return 6 * params + 12 * layers * heads * head_dim * seq_len


def mfu(flops_per_token: float, tokens_per_s: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation (PaLM §4.1): achieved model FLOP/s over the devices' peak FLOP/s."""
    return flops_per_token * tokens_per_s / (devices * peak_flops)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh sizes and the settings that change memory or communication (ParallelConfig/TrainConfig names)."""

    data: int = 1
    stage: int = 1
    fsdp: int = 1
    sequence: int = 1
    model: int = 1
    zero_stage: int = 3
    sequence_parallel: bool = False
    context_attention: str = "ring"
    load_balance: bool = True
    microbatches: int = 0  # 0: twice the stages (ParallelConfig's default)
    pipeline_repeats: int = 1
    remat: str = "none"
    grad_accum: int = 1
    offload: str = "none"  # parallel.offload: none, optimizer, optimizer+params
    pipeline_schedule: str = "gpipe"  # parallel.pipeline_schedule: gpipe, 1f1b (activations_1f1b)

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def M(self) -> int:
        """Pipeline microbatches (1 without a pipeline)."""
        return 1 if self.stage == 1 else (self.microbatches or 2 * self.stage)

    @property
    def R(self) -> int:
        return 1 if self.stage == 1 else self.pipeline_repeats

    def describe(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.sizes.items() if n > 1) or "data=1"


@dataclasses.dataclass(frozen=True)
class Run:
    global_batch: int
    seq_len: int
    compute_dtype: str = "bfloat16"
    precision: str = "fp32"
    efficiency: float = EFFICIENCY
    flash_attention: bool = True  # the attention kernel keeps no score matrix (blockwise, meshpar's on GPUs); False: dense

    @property
    def c(self) -> int:
        return 2 if self.compute_dtype == "bfloat16" else 4


@dataclasses.dataclass(frozen=True)
class Collective:
    axes: tuple[str, ...]
    op: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    bytes: float  # result bytes per device, one call (what meshpar.analysis counts)
    count: float
    kind: str  # dp (overlapped), tp, cp, ring (overlapped with its blocks), pp


def check(shape: Shape, lay: Layout, run: Run) -> list[str]:
    """Every divisibility rule meshpar enforces for this layout, as messages (empty: it builds).

    Mirrors the checks of `meshpar.sharding.spec_for` (a dimension its mesh axes do not divide), the
    pipeline (`L % (S·R)`, the batch into M microbatches over data × fsdp), gradient accumulation and
    context attention (T over `sequence`, 2·sequence for the zigzag order, heads for Ulysses), and
    host offload's (`optimizer+params` needs a remat that fetches the weights again).
    """
    s, m, n, B, T = shape, lay.model, lay.sequence, run.global_batch, run.seq_len
    rules = (
        (min(lay.sizes.values()) >= 1 and lay.grad_accum >= 1 and lay.microbatches >= 0 and lay.pipeline_repeats >= 1,
         lambda: f"sizes, grad_accum and pipeline_repeats must be >= 1 and microbatches >= 0 ({lay})"),
        (lay.zero_stage in (0, 1, 2, 3), lambda: f"zero_stage {lay.zero_stage} is not one of 0, 1, 2, 3"),
        (lay.remat in REMATS, lambda: f"remat '{lay.remat}' is not one of {', '.join(REMATS)}"),
        (lay.pipeline_schedule == "gpipe" or (lay.pipeline_schedule == "1f1b" and lay.R == 1),
         lambda: f"pipeline_schedule '{lay.pipeline_schedule}': gpipe, or 1f1b with pipeline_repeats 1"),
        (lay.offload in OFFLOADS, lambda: f"offload '{lay.offload}' is not one of {', '.join(OFFLOADS)}"),
        (lay.offload != "optimizer+params" or lay.remat != "none",  # as meshpar.offload.check
         lambda: "offload 'optimizer+params' needs remat dots, full or offload (with none every layer's fetched "
                 "weights stay on the device until the backward pass)"),
        (lay.context_attention in MODES,
         lambda: f"context_attention '{lay.context_attention}' is not one of {', '.join(MODES)}"),
        (s.heads % m == 0 and s.kv_heads % m == 0,
         lambda: f"n_heads {s.heads} and n_kv_heads {s.kv_heads} must be divisible by model = {m}"),
        (s.d_ff % m == 0, lambda: f"d_ff {s.d_ff} must be divisible by model = {m}"),
        (s.vocab % m == 0, lambda: f"vocab_size {s.vocab} must be divisible by model = {m}"),
        (lay.fsdp == 1 or lay.zero_stage == 0 or s.d_model % lay.fsdp == 0,
         lambda: f"d_model {s.d_model} (the 'embed' axis) must be divisible by fsdp = {lay.fsdp}"),
        (s.layers % (lay.stage * lay.R) == 0,
         lambda: f"n_layers {s.layers} must be divisible by stage {lay.stage} × pipeline_repeats {lay.R}"),
        (B % (lay.data * lay.fsdp * lay.M * lay.grad_accum) == 0,
         lambda: f"global batch {B} must be divisible by data·fsdp {lay.data * lay.fsdp} × microbatches {lay.M} "
                 f"× grad_accum {lay.grad_accum}"),
        (T % (n * (m if lay.sequence_parallel else 1)) == 0,
         lambda: f"seq_len {T} must be divisible by sequence {n}" + (f" × model {m} (sequence parallelism)"
                                                                      if lay.sequence_parallel else "")),
        (n == 1 or lay.context_attention != "ring" or not lay.load_balance or T % (2 * n) == 0,
         lambda: f"seq_len {T} must be divisible by 2·sequence = {2 * n} (zigzag load balancing)"),
        (n == 1 or lay.context_attention != "ulysses" or ((s.heads // m) % n == 0 and (s.kv_heads // m) % n == 0),
         lambda: f"ulysses: heads per model shard ({s.heads // m} q, {s.kv_heads // m} kv) must be divisible by "
                 f"sequence = {n}"),
    )
    return [message() for ok, message in rules if not ok]


@functools.lru_cache(maxsize=None)
def _tables(zero_stage: int) -> dict[str, dict[str, tuple[str, ...]]]:
    rules = make_rules(ParallelConfig(zero_stage=zero_stage))
    return {kind: rules.table(kind) for kind in ("params", "grads", "optimizer", "activations")}


def local_elements(shape: Shape, lay: Layout, kind: str, only_layers: bool = False) -> float:
    """Parameter elements on one device under a rules table (`activations`: the gathered compute form)."""
    return _local_elements(shape, lay.zero_stage, lay.stage, lay.fsdp, lay.model, kind, only_layers)


def local_tensors(shape: Shape, lay: Layout, kind: str) -> tuple[float, ...]:
    """Elements on one device of each parameter tensor (`Shape.tensors` order) under a rules table."""
    return _local_tensors(shape, lay.zero_stage, lay.stage, lay.fsdp, lay.model, kind)


@functools.lru_cache(maxsize=65536)
def _local_tensors(shape: Shape, zero: int, stage: int, fsdp: int, model: int, kind: str) -> tuple[float, ...]:
    table, sizes = _tables(zero)[kind], {"stage": stage, "fsdp": fsdp, "model": model}
    # params are never split over data or sequence
    return tuple(n / math.prod(sizes.get(a, 1) for name in names for a in table.get(name, ()))
                 for n, names in shape.tensors())


@functools.lru_cache(maxsize=65536)
def _local_elements(shape: Shape, zero: int, stage: int, fsdp: int, model: int, kind: str, only_layers: bool) -> float:
    tensors = _local_tensors(shape, zero, stage, fsdp, model, kind)
    return sum(n for n, (_, names) in zip(tensors, shape.tensors()) if not only_layers or names[0] == "layers")


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device: on the device (params … other, update; `total`: the peak) and in its host's memory."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float
    update: float = 0.0  # offload: the update's offloaded states of one tensor, after the activations are freed
    host_states: float = 0.0  # offloaded params and moments at rest (XLA's host argument bytes)
    host_temp: float = 0.0  # offloaded gradients and saved activations (XLA's host temp bytes)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + max(self.activations, self.update) + self.other

    @property
    def host(self) -> float:
        return self.host_states + self.host_temp

    @property
    def states(self) -> float:
        return self.params + self.optimizer


def iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Pipeline schedule length, (R−1)·max(M, S) + M + S − 1 (as `meshpar.pipeline.iterations`)."""
    return (repeats - 1) * max(microbatches, stages) + microbatches + stages - 1


def local_dims(shape: Shape, lay: Layout, run: Run):
    m = lay.model
    b = run.global_batch / (lay.data * lay.fsdp * lay.M * lay.grad_accum)  # rows per microbatch per device
    t = run.seq_len / lay.sequence
    return b, t, shape.heads / m, shape.kv_heads / m, shape.d_ff / m, shape.vocab / m


# Activation bytes per local token, fitted to what XLA's compiler allocates for this model (its CPU
# backend, bfloat16 compute, checked by `launch.compile`; tests/test_plan.py holds the fit to 10% of
# the per-device peak at 8B and 70B sizes). Coefficients of the per-device widths: D (d_model), Dsp
# (D / model under Megatron SP: the residual stream), F (d_ff / model), Q (N·H / model) and KV (K·H / model).
SAVED_NONE = {"Dsp": 15, "D": 4.5, "F": 12.75, "Q": 15, "KV": 1.5}  # one layer, remat none: every intermediate
WORKING = {"none": {}, "dots": {"D": 13, "F": 3, "Q": 19, "KV": 8},  # one layer's backward pass
           "full": {"D": 17, "F": 14, "Q": 12, "KV": 2}}
HEAD_BYTES = 6  # per element of the output head: its whole float32 gradient and its gathered compute copy


def _widths(shape: Shape, lay: Layout) -> dict[str, float]:
    m = lay.model
    return {"D": shape.d_model, "Dsp": shape.d_model / (m if lay.sequence_parallel else 1), "F": shape.d_ff / m,
            "Q": shape.heads * shape.head_dim / m, "KV": shape.kv_heads * shape.head_dim / m}


def _weighted(coefficients: dict[str, float], widths: dict[str, float], run: Run) -> float:
    """Σ coefficient·width, scaled from the bfloat16 fit to the compute dtype."""
    return sum(c * widths[name] for name, c in coefficients.items()) * run.c / 2


def attention_bytes_per_token(shape: Shape, lay: Layout, run: Run) -> float:
    """What attention holds per local token beyond q, k, v and its output: the dense kernel's f32
    scores and probabilities [t, S], ring's n saved step inputs, all-gather's whole K and V."""
    w, n, c, T = _widths(shape, lay), lay.sequence, run.c, run.seq_len
    ring = n > 1 and lay.context_attention == "ring"
    out = n * (4 * w["Q"] + 2 * c * w["KV"]) if ring else 0.0  # f32 output accumulator, K/V block per step
    if not run.flash_attention:
        out += w["Q"] / shape.head_dim * (T / n if ring else T) * (4 + c)
    if n > 1 and lay.context_attention == "allgather":
        out += 2 * n * c * w["KV"]
    return out


def _projections(w: dict[str, float], c: int) -> float:
    """What `dots` keeps of a layer beyond its input, per token: q, k, v, the attention projection, gate, up."""
    return c * (w["Dsp"] + w["Q"] + 2 * w["KV"] + 2 * w["F"])


def layer_bytes_per_token(shape: Shape, lay: Layout, run: Run, *, saved: bool = True) -> float:
    """Activation bytes of one layer per local token on the device: what the backward pass keeps of it
    under the layout's remat (`saved`), or what its backward pass works with (`saved=False`)."""
    w, c = _widths(shape, lay), run.c
    if not saved:  # offload's backward pass is dots', with the layer's projections fetched back
        remat = "dots" if lay.remat == "offload" else lay.remat
        return (_weighted(WORKING[remat], w, run) + host_layer_bytes_per_token(shape, lay, run)
                + (attention_bytes_per_token(shape, lay, run) if remat != "none" else 0.0))
    if lay.remat in ("full", "offload"):  # the layer's input (offload: the rest is in host memory)
        return c * w["Dsp"]
    if lay.remat == "dots":
        return c * w["Dsp"] + _projections(w, c)
    return _weighted(SAVED_NONE, w, run) + attention_bytes_per_token(shape, lay, run)


def host_layer_bytes_per_token(shape: Shape, lay: Layout, run: Run) -> float:
    """What one layer keeps in host memory per local token: remat `offload`'s projections."""
    return _projections(_widths(shape, lay), run.c) if lay.remat == "offload" else 0.0


def layer_applications(shape: Shape, lay: Layout) -> float:
    """Layers a device applies per step: per accumulation step its layers, in every pipeline iteration."""
    passes = lay.grad_accum * (iterations(lay.stage, lay.M, lay.R) if lay.stage > 1 else 1)
    return passes * shape.layers / (lay.stage * lay.R)


def update_bytes(shape: Shape, lay: Layout, run: Run) -> float:
    """Device bytes of the update under offload: it streams (meshpar.offload.update), so the largest of one
    layer's share of a stacked tensor's offloaded states, or a whole unstacked tensor's, brought in."""
    pb, gb, ob = PRECISIONS[run.precision]
    kinds = {"none": {}, "optimizer": {"optimizer": ob},
             "optimizer+params": {"params": pb, "grads": gb, "optimizer": ob}}[lay.offload]
    layers_here = shape.layers / lay.stage  # the stacked layers one device holds
    per_tensor = zip(*(local_tensors(shape, lay, kind) for kind in kinds), (names for _, names in shape.tensors()))
    return max((sum(nbytes * n for nbytes, n in zip(kinds.values(), ns[:-1])) / (layers_here if "layers" in ns[-1] else 1)
                for ns in per_tensor), default=0.0)


def activations_1f1b(shape: Shape, lay: Layout, run: Run) -> float:
    """What the 1F1B schedule (meshpar.pipeline_1f1b) keeps per device beyond one layer's working set,
    whatever M: its stash of 2(S − 1) stage inputs and the two microbatches in flight (activations and
    cotangents), and one stage's layers, as the remat policy saves them, while its backward recomputes them."""
    b, t, *_ = local_dims(shape, lay, run)
    stage_inputs = 2 * (lay.stage - 1) + 2
    stage = shape.layers / lay.stage * layer_bytes_per_token(shape, lay, run)
    return (stage_inputs * run.c * shape.d_model + stage) * b * t


def memory(shape: Shape, lay: Layout, run: Run) -> Memory:
    pb, gb, ob = PRECISIONS[run.precision]
    params = pb * local_elements(shape, lay, "params")
    optimizer = ob * local_elements(shape, lay, "optimizer")
    grads = gb * local_elements(shape, lay, "grads")
    b, t, _, _, _, V = local_dims(shape, lay, run)
    tokens = b * t  # one microbatch on this device
    per_layer = layer_bytes_per_token(shape, lay, run)
    working = layer_bytes_per_token(shape, lay, run, saved=False) * tokens
    if lay.stage > 1 and lay.pipeline_schedule == "1f1b":
        saved = activations_1f1b(shape, lay, run)
    elif lay.stage > 1:
        # Every schedule iteration keeps what its stage step's remat saves: the stage input (full, offload)
        # or every layer's (dots, none); the backward pass then recomputes one stage, keeping per layer.
        S, M, R = lay.stage, lay.M, lay.R
        layers = shape.layers / (S * R)
        per_iteration = run.c * shape.d_model if lay.remat in ("full", "offload") else layers * per_layer
        saved = (iterations(S, M, R) * per_iteration + layers * per_layer) * tokens
    else:
        saved = shape.layers * per_layer * tokens
    rows = run.global_batch / (lay.data * lay.fsdp)
    other = HEAD_BYTES * shape.d_model * V + 4 * rows * (run.seq_len + 1)  # the head; the int32 token batch
    if lay.stage > 1:
        per_weight = PIPELINE_BYTES + (PIPELINE_GATHER_BYTES if lay.fsdp > 1 else 0) - PIPELINE_SAVED_BYTES
        other += per_weight * local_elements(shape, lay, "activations", only_layers=True)
    if lay.grad_accum > 1:
        other += gb * local_elements(shape, lay, "grads")  # the accumulator, in the gradients' layout
    # remat offload: every layer application of one accumulation step keeps its projections
    kept = layer_applications(shape, lay) / lay.grad_accum
    host_states, host_temp = 0.0, host_layer_bytes_per_token(shape, lay, run) * kept * tokens
    if lay.offload != "none":
        host_states, optimizer = optimizer, 0.0
    if lay.offload == "optimizer+params":
        host_states += params
        host_temp += grads
        per_layer_share = lay.stage / shape.layers  # one layer's fetched weights and its gradient on the way out
        other += per_layer_share * (pb * local_elements(shape, lay, "params", only_layers=True)
                                    + gb * local_elements(shape, lay, "grads", only_layers=True))
        params = grads = 0.0
    return Memory(params, grads, optimizer, saved + working, other, update_bytes(shape, lay, run),
                  host_states, host_temp)


def weight_passes(lay: Layout) -> int:
    """How often a step gathers (ZeRO-3) or fetches from host memory (offload) the layers' weights: per
    accumulation step once, and outside a pipeline again in the backward pass (every remat policy,
    `none` too, gathers again instead of keeping them: meshpar.layers; a pipeline holds its stage's
    weights)."""
    return lay.grad_accum * (2 if lay.stage == 1 else 1)


def host_traffic(shape: Shape, lay: Layout, run: Run) -> tuple[float, float]:
    """(host→device, device→host) bytes per device per step of host offload (see the module docstring)."""
    pb, gb, ob = PRECISIONS[run.precision]
    moments = ob * local_elements(shape, lay, "optimizer") if lay.offload != "none" else 0.0
    in_, out = moments, moments  # the update's moments
    if lay.offload == "optimizer+params":
        params, grads = pb * local_elements(shape, lay, "params"), gb * local_elements(shape, lay, "grads")
        layers = pb * local_elements(shape, lay, "params", only_layers=True)
        in_ += params - layers + layers * weight_passes(lay) + params + grads  # fetches; the update's inputs
        out += grads + params  # the gradients landing in host memory; the updated weights
    b, t, *_ = local_dims(shape, lay, run)
    saved = host_layer_bytes_per_token(shape, lay, run) * b * t * layer_applications(shape, lay)
    return in_ + saved, out + saved  # remat offload: out in the forward pass, in in the backward


def collectives(shape: Shape, lay: Layout, run: Run, *, cpu: bool = False) -> list[Collective]:
    """What one step communicates per device. `cpu=True`: the forms XLA's CPU backend emits (reduce-scatter
    as all-reduce of the whole input then a slice; weights gathered in float32, then cast)."""
    out: list[Collective] = []
    pb, gb, _ = PRECISIONS[run.precision]
    c, D, H = run.c, shape.d_model, shape.head_dim
    b, t, N, K, F, V = local_dims(shape, lay, run)
    rs = "all-reduce" if cpu else "reduce-scatter"
    passes = lay.grad_accum * (iterations(lay.stage, lay.M, lay.R) if lay.stage > 1 else 1)
    layer_steps = layer_applications(shape, lay)

    # gradient sync over the replicas of the weights, and ZeRO's parameter all-gathers. The output head's
    # gradient leaves the loss reduced (meshpar.loss): with ZeRO-2/3 over fsdp as an explicit reduce-scatter
    # over every batch-and-sequence axis (fsdp major), then an all-gather back over the others.
    whole = local_elements(shape, lay, "activations")
    layer_whole = local_elements(shape, lay, "activations", only_layers=True)
    head = D * V
    replicas = tuple(a for a in ("data", "sequence") if lay.sizes[a] > 1)
    fsdp = ("fsdp",) if lay.fsdp > 1 else ()
    split = bool(fsdp) and lay.zero_stage >= 2
    G = gb * (whole - (head if split else 0))
    if not split:
        if replicas + fsdp:
            out.append(Collective(replicas + fsdp, "all-reduce", G, 1, "dp"))
    else:
        rows = lay.fsdp * math.prod(lay.sizes[a] for a in replicas)
        out.append(Collective(replicas + fsdp, "reduce-scatter", gb * head / rows, 1, "dp"))
        if replicas:
            out.append(Collective(replicas, "all-gather", gb * head / lay.fsdp, 1, "dp"))
        if cpu:
            out.append(Collective(replicas + fsdp, "all-reduce", G, 1, "dp"))
        else:
            out.append(Collective(fsdp, "reduce-scatter", G / lay.fsdp, 1, "dp"))
            if replicas:
                out.append(Collective(replicas, "all-reduce", G / lay.fsdp, 1, "dp"))
    if fsdp and lay.zero_stage in (1, 2):
        out.append(Collective(fsdp, "all-gather", pb * whole, 1, "dp"))  # the updated parameters
    if fsdp and lay.zero_stage == 3:
        g = pb if cpu else min(c, pb)
        out.append(Collective(fsdp, "all-gather", g * (whole - layer_whole), 1, "dp"))  # embedding and head
        out.append(Collective(fsdp, "all-gather", g * layer_whole, weight_passes(lay), "dp"))

    if lay.model > 1:  # Megatron tensor parallelism, per layer per microbatch pass (bubbles included)
        a = b * t * D * c
        fwd, bwd = TP_ALL_REDUCES
        reduces = fwd + bwd + (1 if lay.remat == "full" else 0)  # recompute: attention output (x1) again
        mb = passes if lay.stage > 1 else lay.grad_accum
        rs_bytes = a if cpu else a / lay.model
        if lay.sequence_parallel:
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

    n = lay.sequence
    if n > 1:  # context-parallel attention, per layer per microbatch pass
        kv = 2 * b * t * K * H * c
        if lay.context_attention == "allgather":  # dK, dV reduce-scattered back in float32 (attention.py)
            out.append(Collective(("sequence",), "all-gather", n * kv, layer_steps, "cp"))
            out.append(Collective(("sequence",), "reduce-scatter", kv * 4 / c, layer_steps, "cp"))
        elif lay.context_attention == "ring":
            out.append(Collective(("sequence",), "collective-permute", kv, 2 * (n - 1) * layer_steps, "ring"))
            if lay.load_balance:
                out.append(Collective(("sequence",), "collective-permute", b * t * (N + K) * H * c,
                                      4 * layer_steps, "cp"))
        else:
            qkvo = b * t * 2 * (N + K) * H * c
            out.append(Collective(("sequence",), "all-to-all", qkvo, 2 * layer_steps, "cp"))

    if lay.stage > 1:  # pipeline.py's table: the shifts, the result leaving stage 0 (and its gradient)
        out.append(Collective(("stage",), "collective-permute", b * t * D * c, 2 * passes, "pp"))
        out.append(Collective(("stage",), "all-reduce", lay.M * b * t * D * c, 2 * lay.grad_accum, "pp"))
    return out


def totals(colls: list[Collective]) -> dict[str, float]:
    """Result bytes per op kind, the unit `meshpar.analysis.collectives` counts."""
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
    inside, across = _host_split(lay.data, lay.stage, lay.fsdp, lay.sequence, lay.model, devices_per_host)
    n_in = math.prod(inside[a] for a in x.axes)
    n_out = math.prod(across[a] for a in x.axes)
    n = n_in * n_out
    if n == 1:
        return 0.0, 0.0
    link, net = hw.link_bw * hw.net_efficiency, hw.net_bw * hw.net_efficiency
    S = x.bytes * n if x.op == "reduce-scatter" else x.bytes  # a reduce-scatter's input
    lat = lambda k, lat_: lat_ * math.ceil(math.log2(k)) if k > 1 else 0.0
    if x.op == "collective-permute":
        return S, S / (net if n_out > 1 else link) + (hw.net_latency if n_out > 1 else hw.link_latency)
    if x.op == "all-to-all":
        wire = S * (n - 1) / n
        seconds = S * (n_in - 1) / n / link + S * (n - n_in) / n / net  # the part for other hosts uses the NIC
        return wire, seconds + lat(n_in, hw.link_latency) + lat(n_out, hw.net_latency)
    factor = 2 if x.op == "all-reduce" else 1
    wire = factor * S * (n - 1) / n
    seconds = factor * (S * (n_in - 1) / n_in / link + (S / n_in) * (n_out - 1) / n_out / net
                        + lat(n_in, hw.link_latency) + lat(n_out, hw.net_latency))
    return wire, seconds
