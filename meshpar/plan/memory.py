"""Memory per device of one layout of meshpar's transformer: model states, activations and the rest.

Fitted to what XLA allocates for this model (`launch.compile`; `tests/test_fit.py` holds the per-device
peak to 10% on the layouts it was fitted on and, apart, on layouts it was not):
- params, optimizer: at rest, by the params/optimizer tables: float32 params 4 + Adam moments 8 bytes per
  element (`precision="mixed"`, the ZeRO paper's convention: 2 + 12). These are XLA's argument bytes. A frozen
  weight (`Shape.frozen`: a LoRA run's base) is `Shape.frozen_bytes` per element, with no moments, no gradient.
- grads: the gradient in its own layout (`rules` grads table: split over fsdp under ZeRO-2/3).
- activations: what the backward pass keeps of every layer this device runs, per local token
  (`layer_bytes_per_token`): `full` remat keeps each layer's input (e·D, ÷ model with Megatron SP);
  `dots` also q, k, v, the attention projection, gate and up; `none` every intermediate (the fitted
  `SAVED_NONE`). Attention adds what its kernel holds (`attention_bytes_per_token`): nothing for the
  blockwise kernel beyond its output and log-sum-exp; the dense kernel's float32 scores and
  probabilities [t, T]; ring's per-step inputs; all-gather's whole K and V. Plus one layer's backward
  working set (`WORKING`, fitted): the peak is inside a layer's backward pass. The loss is chunked
  (`meshpar.loss`): it holds at most one chunk of logits, counted in the working set. The pipeline's
  scan keeps every iteration's stage input (`schedule.iterations` microbatch passes), plus one stage's
  layers while it recomputes them; 1F1B (`pipeline_schedule`) its stash and the two in flight whatever M
  (`activations_1f1b`). XLA:GPU's 1F1B with fsdp holds its stage weights, the embedding and the head
  gathered, their gradients accumulated in that form, and no sharded gradient at its peak
  (`GATHERED_1F1B_GPU`).
- other: the output head's whole float32 gradient and gathered compute copy (`HEAD_BYTES` per element),
  the int32 token batch, the pipeline's stage weights held for the step (`PIPELINE`, more with
  fsdp), and the accumulation buffer (A > 1), in the gradients' own layout: its fsdp/model/stage shard.
- host offload (`meshpar.offload`), per device: `optimizer` moves the Adam moments (8 bytes per element of
  the optimizer table) to host memory (`host_states`); `optimizer+params` the float32 weights too, and
  the weight gradients land there (`host_temp`), while one layer's fetched weights and their gradient
  pass through the device. The update brings each offloaded array to the device in turn (XLA moves each
  array separately; the new values overwrite it before it goes back): `update` holds the largest
  tensor's offloaded states, and the peak is the larger of that and the activations (freed by then).
  Remat `offload` keeps on the device what `full` keeps (each layer's input) and in host memory (host
  temp) what `dots` keeps beyond it (q, k, v, the attention projection, gate and up); one layer's come
  back for its backward pass, which otherwise works as with `dots`.
- a mixture of experts (`moe_bytes_per_token`; on a GPU also one layer's gathered experts and their gradient,
  `GATHERED_EXPERTS_GPU`): the dense MLP's terms cover only its shared experts (F =
  their width); the experts work on the rows of the dispatch buffers, ep·r per microbatch on a device
  (`layout.expert_rows`), each D wide in the buffers and Fe = expert_mlp / model wide inside the experts.
  Remat `none` keeps per row the rows received and the experts' outputs (2·D) and gate, up and their product
  (3·Fe), and per token its k gathered outputs (the combine weights' gradient) and the float32 router
  probabilities; `dots` the matmuls' results (the outputs, gate and up); `full` and `offload` nothing
  beyond the layer's input. A layer's backward pass works with the buffers both ways and their gradients
  (`MOE_WORKING`). Derived from meshpar.moe.dispatch, not fitted.
- layers that differ (`layer_pattern`): a "layer" here is one entry of the stack, a period's layers. Its
  widths add up its layers' (D, Q and KV each layer's; F those with an MLP; the experts' terms those with
  experts), so the fitted per-layer coefficients apply unchanged. The remat policy checkpoints the entry,
  so its backward pass works on a whole period at once.
- layers before the stack (`layer_prefix`): their weights are whole over `stage` (the model states of any
  other tensor outside `layers`); their saved activations a stacked layer's each (`_saved`), an estimate:
  a dense prefix before experts is counted at the average layer of the stack's entry. Under 1F1B and
  zero-bubble they are gathered for the step with their gradient's accumulator, as the head is (`_lead_held`).

Letters as in `meshpar.plan.layout`; the widths: D (d_model), Dsp (D / model under Megatron SP: the
residual stream), F (d_ff / model), Q (N·H / model) and KV (K·H / model), each summed over an entry's layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from meshpar.pipeline import schedule
from meshpar.plan.layout import (PRECISIONS, Layout, Run, expert_rows, layer_applications, layer_expert_elements,
                                 local_dims, local_elements, local_tensors, transposed_for_gathers)
from meshpar.plan.shape import Shape
from meshpar.rules import SLOT_SCHEDULES



@dataclasses.dataclass(frozen=True)
class PipelineBytes:
    """What a pipeline holds per element of a device's stage weights beyond the model states (the schedules
    hold them for the step, gathered over fsdp). Fitted to llama_8b's GPipe and 1F1B steps on 8 devices
    (P = 2, 4; R = 1, 2, 4; with and without fsdp and model) and llama_70b's stage=4,fsdp=16, per JAX
    version: XLA's buffer assignment differs between them by up to 4 bytes per element."""

    held: float  # each shard's float32 gradient and a compute copy
    chunk: float  # with fsdp: the float32 copy of the chunk of stage weights the layer loop reads
    chunk_per_repeat: bool  # ... of one repeat at a time (÷ R) rather than of all R
    one_f_one_b_fsdp: float  # 1F1B with fsdp: its gathered stage weights, held across the slot loop
    one_f_one_b_p2: float  # 1F1B at P = 2: its one-slot phases run outside the slot loop, each with a copy


PIPELINE = (PipelineBytes(held=3, chunk=8, chunk_per_repeat=False, one_f_one_b_fsdp=4, one_f_one_b_p2=0)
            if jax.__version_info__ >= (0, 12) else
            PipelineBytes(held=7, chunk=8, chunk_per_repeat=True, one_f_one_b_fsdp=4, one_f_one_b_p2=4))
# XLA:GPU's 1F1B with fsdp, read in its buffers at the peak (llama_8b, stage=2 with fsdp): per element of the
# gathered stage weights, their float32 copy gathered once for the step, the float32 gradient the slots accumulate
# in that gathered form, and a chunk's stacked float32 gradient from its layer scan (÷ R); per element of the
# embedding and of the head, the same copy and accumulator. The sharded gradient is reduce-scattered from the
# accumulator after the slot loop, so it is not at the peak. Experts that `expert` alone splits (no fsdp) keep the
# copy and the accumulator, not the chunk's gradient (qwen3_30b_a3b's 1F1B on stage=4,expert=8,data=2: +1.7%, in
# tests/test_gpu_fit.py; its zero-bubble program, once: +2.9%).
GATHERED_1F1B_GPU = {"copy_and_accumulator": 8, "chunk_gradient": 4, "head": 16}
# GPipe's other buffers, per element of one microbatch's activations [b, t, D]: the input/output buffer of
# every microbatch, its cotangent and the input's gradient (3 × M of them, in the compute dtype) and, per
# schedule iteration, the two bubble masks the backward pass reads (1 byte each).
PIPELINE_IO, PIPELINE_MASK_BYTES = 3, 2


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


# Activation bytes per local token, fitted to what XLA's compiler allocates for this model (its CPU
# backend, bfloat16 compute, checked by `launch.compile`; tests/test_fit.py holds the fit to 10% of
# the per-device peak at 8B and 70B sizes). Coefficients of the per-device widths (module docstring).
SAVED_NONE = {"Dsp": 15, "D": 4.5, "F": 12.75, "Q": 15, "KV": 1.5}  # one layer, remat none: every intermediate
WORKING = {"none": {}, "dots": {"D": 13, "F": 3, "Q": 19, "KV": 8},  # one layer's backward pass
           "full": {"D": 17, "F": 14, "Q": 12, "KV": 2}}
HEAD_BYTES = 6  # per element of the output head: its whole float32 gradient and its gathered compute copy
# XLA:GPU's backward pass of a layer with experts under fsdp: per element of its experts gathered, their compute
# copy and their float32 gradient before it is reduce-scattered (deepseek_v3's H100 programs on 256 GPUs,
# expert=8,fsdp=32 and fsdp=64,model=4 at capacity 1.25, within 3% of both; XLA:CPU's is in `WORKING`)
GATHERED_EXPERTS_GPU = 6
# A mixture of experts' layer, elements per row of its dispatch buffers (D wide or Fe wide: module docstring)
MOE_SAVED = {"none": {"D": 2, "Fe": 3}, "dots": {"D": 1, "Fe": 2}}
MOE_WORKING = {"D": 8, "Fe": 6}


def _widths(shape: Shape, lay: Layout) -> dict[str, float]:
    return _widths_of(shape, lay.mesh.model, lay.parallel.sequence_parallel)


@functools.lru_cache(maxsize=4096)
def _widths_of(shape: Shape, m: int, sequence_parallel: bool) -> dict[str, float]:
    """The widths of one entry of the stack: of every layer it holds (`Shape.period`), F of those with an MLP."""
    L = shape.period
    return {"D": L * shape.d_model, "Dsp": L * shape.d_model / (m if sequence_parallel else 1),
            "F": shape.mlp_layers * shape.d_ff / m, "Q": L * shape.heads * shape.head_dim / m,
            "KV": L * shape.kv_heads * shape.head_dim / m}


def _weighted(coefficients: dict[str, float], widths: dict[str, float], run: Run) -> float:
    """Σ coefficient·width, scaled from the bfloat16 fit to the compute dtype."""
    return sum(k * widths[name] for name, k in coefficients.items()) * run.e / 2


def attention_bytes_per_token(shape: Shape, lay: Layout, run: Run) -> float:
    """What attention holds per local token beyond q, k, v and its output: the dense kernel's f32
    scores and probabilities [t, T], ring's n saved step inputs, all-gather's whole K and V."""
    w, n, e, T = _widths(shape, lay), lay.mesh.sequence, run.e, run.seq_len
    ring = n > 1 and lay.parallel.context_attention == "ring"
    out = n * (4 * w["Q"] + 2 * e * w["KV"]) if ring else 0.0  # f32 output accumulator, K/V block per step
    if not run.flash_attention:
        out += w["Q"] / shape.head_dim * (T / n if ring else T) * (4 + e)
    if n > 1 and lay.parallel.context_attention == "allgather":
        out += 2 * n * e * w["KV"]
    return out


def _projections(w: dict[str, float], e: int) -> float:
    """What `dots` keeps of a layer beyond its input, per token: q, k, v, the attention projection, gate, up."""
    return e * (w["Dsp"] + w["Q"] + 2 * w["KV"] + 2 * w["F"])


def layer_bytes_per_token(shape: Shape, lay: Layout, run: Run, *, saved: bool = True) -> float:
    """Activation bytes of one layer per local token on the device: what the backward pass keeps of it
    under the layout's remat (`saved`), or what its backward pass works with (`saved=False`)."""
    w, e = _widths(shape, lay), run.e
    moe = moe_bytes_per_token(shape, lay, run, saved=saved)
    if not saved:  # offload's backward pass is dots', with the layer's projections fetched back
        remat = "dots" if lay.remat == "offload" else lay.remat
        return (_weighted(WORKING[remat], w, run) + host_layer_bytes_per_token(shape, lay, run)
                + (attention_bytes_per_token(shape, lay, run) if remat != "none" else 0.0) + moe)
    if lay.remat in ("full", "offload"):  # the layer's input (offload: the rest is in host memory)
        return e * w["Dsp"]
    if lay.remat == "dots":
        return e * w["Dsp"] + _projections(w, e) + moe
    return _weighted(SAVED_NONE, w, run) + attention_bytes_per_token(shape, lay, run) + moe


def moe_bytes_per_token(shape: Shape, lay: Layout, run: Run, *, saved: bool = True) -> float:
    """A mixture of experts' layer beyond its shared experts, per local token (module docstring): what the
    backward pass keeps of it under the layout's remat (`saved`), or what its backward pass works with."""
    if not shape.experts:
        return 0.0
    _, _, rows = expert_rows(shape, lay, run)
    widths = {"D": shape.d_model, "Fe": shape.expert_width / lay.mesh.model}
    per_row = lambda counts: sum(k * widths[name] for name, k in counts.items()) * rows * run.e
    if not saved:
        return per_row(MOE_WORKING) * shape.moe_layers
    if lay.remat in ("full", "offload"):  # the layer's input only (offload: activations on the device)
        return 0.0
    kept = per_row(MOE_SAVED[lay.remat])
    if lay.remat == "none":  # the combine's gathered outputs and the router's float32 probabilities
        kept += shape.experts_per_token * shape.d_model * run.e + 4 * shape.experts
    return kept * shape.moe_layers


def host_layer_bytes_per_token(shape: Shape, lay: Layout, run: Run) -> float:
    """What one layer keeps in host memory per local token: remat `offload`'s projections."""
    return _projections(_widths(shape, lay), run.e) if lay.remat == "offload" else 0.0


def update_bytes(shape: Shape, lay: Layout, run: Run) -> float:
    """Device bytes of the update under offload: it streams (meshpar.offload.update), so the largest of one
    layer's share of a stacked tensor's offloaded states, or a whole unstacked tensor's, brought in."""
    if lay.parallel.offload == "none":
        return 0.0
    pb, gb, ob = PRECISIONS[run.precision]
    kinds = {"optimizer": {"optimizer": ob},
             "optimizer+params": {"params": pb, "grads": gb, "optimizer": ob}}[lay.parallel.offload]
    layers_here = shape.layers / lay.mesh.stage  # the stacked layers one device holds
    per_tensor = zip(*(local_tensors(shape, lay, kind) for kind in kinds), (names for _, names in shape.elements()))
    return max((sum(nbytes * n for nbytes, n in zip(kinds.values(), ns[:-1]))
                / (layers_here if "layers" in ns[-1] else 1) for i, ns in enumerate(per_tensor)
                if not shape.is_frozen(i)), default=0.0)  # a frozen weight is not updated


def deferred_bytes_per_token(shape: Shape, lay: Layout, run: Run) -> float:
    """Zero-bubble: what one layer's deferred weights' gradient reads, per local token (the boundary of
    `meshpar.pipeline.split_backward`): each deferred weight matmul's input and its output's cotangent (the
    q/k/v projections' shared input, q, k and v's cotangents; the output projection's input and cotangent;
    a dense MLP's input, gate's and up's cotangents, down's input and cotangent; a router's input and its
    logits' cotangent): 4·D + 2·Q + 2·KV + 3·F values dense, 3·D + 2·Q + 2·KV and E float32 ones for a
    mixture without a dense MLP (the tests' models: their boundaries exactly, in float32 and bfloat16). Not
    the norms' scales' nor a mixture's experts' (`split_backward`: finished with the input's gradient)."""
    w, E, D = _widths(shape, lay), shape.experts, shape.d_model
    mlp = 2 * D * shape.mlp_layers + 3 * w["F"]
    router_inputs = D * (shape.period - shape.mlp_layers) if E else 0.0  # where no MLP shares the input
    return run.e * (2 * w["D"] + 2 * w["Q"] + 2 * w["KV"] + mlp + router_inputs) + 4 * E * shape.moe_layers


def activations_1f1b(shape: Shape, lay: Layout, run: Run, *, cpu: bool = False) -> float:
    """What the 1F1B schedule (meshpar.pipeline.one_f_one_b) keeps per device beyond one layer's working set,
    whatever M: its stash of 2(R·P − 1) chunk inputs and the two microbatches in flight (activations and
    cotangents), and one chunk's layers (a stage's, R = 1), as the remat policy saves them, while its
    backward recomputes them. On a GPU, XLA's while-loop double buffering (meshpar.gpu_flags) unrolls the
    slot loop by two, so a second slot's recomputed chunk and its working set are live beside the first (not
    on XLA:CPU, which has no such pass), but not a second set of a mixture's dispatch buffers. Zero-bubble
    adds its ring of deferred weights' parts: P chunks' boundaries (`deferred_bytes_per_token`)."""
    b, t, *_ = local_dims(shape, lay, run)
    stage_inputs = schedule.stash_size(lay.mesh.stage, lay.R) + 2
    chunk_layers = shape.layers / (lay.mesh.stage * lay.R)
    stage = chunk_layers * layer_bytes_per_token(shape, lay, run)
    working = layer_bytes_per_token(shape, lay, run, saved=False) - moe_bytes_per_token(shape, lay, run, saved=False)
    second_slot = 0.0 if cpu else stage + working
    deferred = 0.0
    if lay.parallel.pipeline_schedule == "zero_bubble":
        deferred = schedule.deferred_size(lay.mesh.stage) * chunk_layers * deferred_bytes_per_token(shape, lay, run)
    return (stage_inputs * run.e * shape.d_model + stage + second_slot + deferred) * b * t


def _saved(shape: Shape, lay: Layout, run: Run, tokens: float, cpu: bool) -> float:
    """What the backward pass keeps of the activations, per device: every layer's as the remat policy saves
    it, or a pipeline schedule's stash and one stage's layers while its backward recomputes them. A prefix's
    layers (`Shape.lead`) and multi-token prediction's modules (`Shape.mtp`) keep a stacked layer's each (an
    entry's over its layers), on a microbatch's tokens,
    under GPipe on the batch split over the stages too, under 1F1B nothing past a slot (it recomputes them)."""
    per_layer = layer_bytes_per_token(shape, lay, run)
    lead = (shape.lead + shape.mtp) * per_layer / shape.period * tokens
    if lay.mesh.stage == 1:
        return shape.layers * per_layer * tokens + lead
    if lay.parallel.pipeline_schedule in SLOT_SCHEDULES:
        return activations_1f1b(shape, lay, run, cpu=cpu)
    # Every schedule iteration keeps what its stage step's remat saves: the stage input (full, offload) or
    # every layer's (dots, none), and its bubble masks; the backward pass then recomputes one stage.
    P, M, R, D = lay.mesh.stage, lay.M, lay.R, shape.d_model
    layers = shape.layers / (P * R)
    per_iteration = run.e * D if lay.remat in ("full", "offload") else layers * per_layer
    iterations = schedule.iterations(P, M, R)
    io = PIPELINE_IO * M * run.e * D
    return (iterations * (per_iteration + PIPELINE_MASK_BYTES * D) + layers * per_layer + io) * tokens + lead * M / P


def _gathered_1f1b(lay: Layout, cpu: bool) -> bool:
    """XLA:GPU's 1F1B with fsdp: the weights and their gradients held in the gathered form (`GATHERED_1F1B_GPU`)."""
    return not cpu and lay.mesh.stage > 1 and lay.zero_ways > 1 and lay.parallel.pipeline_schedule in SLOT_SCHEDULES


def _stage_weights(shape: Shape, lay: Layout, cpu: bool) -> float:
    """What a pipeline holds per device for its stage weights beyond the model states (`PIPELINE`;
    `GATHERED_1F1B_GPU` for XLA:GPU's 1F1B with fsdp)."""
    if lay.mesh.stage == 1:
        return 0.0
    whole = local_elements(shape, lay, "activations", only_layers=True)
    # what ZeRO splits at rest: all of them, but the experts where `expert` alone splits them
    gathered = whole if lay.mesh.fsdp > 1 else whole - layer_expert_elements(shape, lay) * shape.layers / lay.mesh.stage
    if _gathered_1f1b(lay, cpu):  # experts that only `expert` splits: their copy and accumulator, no chunk gradient
        return (GATHERED_1F1B_GPU["copy_and_accumulator"] * whole
                + GATHERED_1F1B_GPU["chunk_gradient"] / lay.R * gathered)
    per_element, one_f_one_b = PIPELINE.held, lay.parallel.pipeline_schedule in SLOT_SCHEDULES
    if one_f_one_b and lay.mesh.stage == 2:
        per_element += PIPELINE.one_f_one_b_p2
    gathered_bytes = 0.0
    if lay.zero_ways > 1:
        gathered_bytes = PIPELINE.chunk / (lay.R if PIPELINE.chunk_per_repeat else 1)
        gathered_bytes += PIPELINE.one_f_one_b_fsdp if one_f_one_b else 0
    return per_element * whole + gathered_bytes * gathered


def _lead_held(shape: Shape, lay: Layout, per_element: float) -> float:
    """1F1B's and zero-bubble's hold of a prefix's weights (`Shape.lead`), in its first part: gathered for the
    step with their gradient's accumulator, as the head's (`per_element`); none elsewhere."""
    if lay.mesh.stage == 1 or lay.parallel.pipeline_schedule not in SLOT_SCHEDULES:
        return 0.0
    return per_element * sum(n for n, (_, names) in zip(local_tensors(shape, lay, "activations"), shape.elements())
                             if "lead_layers" in names)


def memory(shape: Shape, lay: Layout, run: Run, *, cpu: bool = False) -> Memory:
    """Per-device memory of `lay` (module docstring). `cpu=True`: the form XLA's CPU backend compiles, where
    host memory is device memory for temporaries: remat `offload` is `dots` there, offloaded gradients are
    device temporaries, and fetched weights are the arguments themselves."""
    if cpu and lay.remat == "offload":
        lay = lay.replace(remat="dots")
    pb, gb, ob = PRECISIONS[run.precision]
    params = pb * local_elements(shape, lay, "params", part="trained") + \
        shape.frozen_bytes * local_elements(shape, lay, "params", part="frozen")
    optimizer = ob * local_elements(shape, lay, "optimizer", part="trained")
    grads = gb * local_elements(shape, lay, "grads", part="trained")
    b, t, _, _, _, V = local_dims(shape, lay, run)
    tokens = b * t  # one microbatch on this device
    activations = _saved(shape, lay, run, tokens, cpu) + layer_bytes_per_token(shape, lay, run, saved=False) * tokens
    rows = run.global_batch / lay.batch_ways
    head_bytes = GATHERED_1F1B_GPU["head"] if _gathered_1f1b(lay, cpu) else HEAD_BYTES
    other = head_bytes * shape.d_model * V + 4 * rows * (run.seq_len + 1)  # the head; the int32 token batch
    other += _stage_weights(shape, lay, cpu) + _lead_held(shape, lay, head_bytes)
    if not cpu:  # XLA:GPU's reordered copies of the weights it gathers along a later dimension; a layer's experts
        other += pb * transposed_for_gathers(shape, lay)
        other += GATHERED_EXPERTS_GPU * layer_expert_elements(shape, lay) if lay.mesh.fsdp > 1 else 0.0
    if lay.grad_accum > 1:
        other += grads  # the accumulator, in the gradients' layout
    # remat offload: every layer application of one accumulation step keeps its projections
    kept = layer_applications(shape, lay) / lay.grad_accum
    host_states, host_temp = 0.0, host_layer_bytes_per_token(shape, lay, run) * kept * tokens
    if lay.parallel.offload != "none":
        host_states, optimizer = optimizer, 0.0
    if lay.parallel.offload == "optimizer+params":
        host_states += params
        host_temp += 0.0 if cpu else grads
        # one layer's fetched weights and gradient on the way out; XLA:CPU's fetch is the argument buffer itself
        # (its temp bytes equal `optimizer`'s to the byte, llama_8b on fsdp=8, jax 0.10.2 and 0.12)
        per_layer_share = 0.0 if cpu else lay.mesh.stage / shape.layers
        other += per_layer_share * (pb * local_elements(shape, lay, "params", only_layers=True)
                                    + gb * local_elements(shape, lay, "grads", only_layers=True, part="trained"))
        params, grads = 0.0, grads if cpu else 0.0
    update = update_bytes(shape, lay, run)
    if _gathered_1f1b(lay, cpu):  # until after the peak, the gradients are the gathered accumulators in `other`
        grads = 0.0
    return Memory(params, grads, optimizer, activations, other, update, host_states, host_temp)
