"""A run from a preset and the command line: its config, mesh, rules and model, for every launch command.

`--mesh auto` asks the planner (`meshpar.plan`) for its fastest layouts on the devices present and takes
the first that the compiler confirms fits (`meshpar.compiler.fit`: the real step compiled for abstract
state). Import this after `launch.devices.setup`: building a mesh starts JAX's backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import configs
from meshpar import config as config_lib, dpo, lora, mesh as mesh_lib, plan, remat as remat_lib, rules as rules_lib
from meshpar import train
from meshpar.attention import kernels
from meshpar.compiler import fit, gpu
from meshpar.errors import InputError
from meshpar.run import device_memory_limit
from models.transformer import TransformerConfig

GB = 1e9


def configure(name: str, mesh_text: str | None, overrides: list[str], hardware: str = "h100",
              init_from: str | None = None, cluster: gpu.Cluster | None = None):
    """(config, mesh, rules, model factory) of a preset with `--mesh` and `--set` applied, and the model
    of `init_from` (a directory of saved parameters) if given; the mesh over the devices present, or over
    the described GPU `cluster`'s."""
    cfg = configs.load(name)
    if mesh_text not in (None, "auto"):
        cfg = dataclasses.replace(cfg, mesh=mesh_lib.parse(mesh_text))
    cfg = config_lib.apply(cfg, overrides)
    if init_from:
        from launch import weights

        if changed := [o for o in overrides if o.startswith("model.")]:
            raise InputError(f"--init-from {init_from} sets the model; {', '.join(changed)} cannot change it")
        saved = weights.saved_config(init_from)[0]
        cfg = dataclasses.replace(cfg, model=TransformerConfig.from_dict(saved["model"]))
        cfg = with_saved_adapters(cfg, weights.train_config(saved).lora, init_from, overrides)
    if mesh_text == "auto":
        cfg = auto_layout(cfg, hardware, cluster=cluster)
    mesh = mesh_lib.build(cfg.mesh, gpu.devices(cluster) if cluster else None)
    if cfg.train.objective == "dpo":  # before any state is made
        dpo.check_schedule(cfg.parallel.pipeline_schedule, mesh.shape["stage"])
    train.check_mtp_schedule(getattr(cfg.model, "mtp_depth", 0), cfg.parallel.pipeline_schedule, mesh.shape["stage"])
    return cfg, mesh, rules_lib.make(cfg.parallel), cfg.model_factory()


def with_saved_adapters(cfg: configs.Config, source: lora.LoraConfig | None, init_from: str,
                        overrides: list[str]) -> configs.Config:
    """`cfg` training the LoRA adapters `init_from` holds (`source`), with their own settings; `--set
    train.lora_rank=0` merges them in and trains every weight. Another `train.lora_*` would train other adapters
    (or, merged, none), never these: it is refused by name."""
    if source is None:
        return cfg
    own = {field.name: getattr(source, field.name) for field in dataclasses.fields(source)}
    text = lambda value: ",".join(value) if isinstance(value, tuple) else value  # as --set writes it
    given = [o for o in overrides if o.startswith("train.lora_")]
    held = config_lib.apply(cfg, [f"train.lora_{k}={text(v)}" for k, v in own.items()] + given)  # given ones win
    chosen = held.train.lora
    differ = ([o for o in given if not o.startswith("train.lora_rank=")] if chosen is None else  # merged: moot
              [f"train.lora_{k}={text(getattr(chosen, k))}" for k, v in own.items() if getattr(chosen, k) != v])
    if differ:
        raise InputError(f"--init-from {init_from} holds LoRA adapters of rank {source.rank}, alpha {source.alpha} on "
                         f"{','.join(source.targets)} (rslora {source.rslora}): {', '.join(differ)} cannot make them "
                         f"others; leave train.lora_* out to train these, or set only train.lora_rank=0 to merge them "
                         f"and train every weight")
    return held


def shape(cfg: configs.Config) -> plan.Shape:
    """The planner's view of the config's model (built abstractly), a mixture's k and the layers' windows beside
    it."""
    model = cfg.model
    windows = tuple(kind.window for kind in model.kinds)
    lead_windows = tuple(kind.window for kind in model.layer_prefix)
    return plan.Shape.of_model(cfg.model_factory(), model.experts_per_token if model.n_experts else 0,
                               windows if any(windows) else (), lead_windows if any(lead_windows) else ())


def flops_per_token(cfg: configs.Config) -> float:
    """The model FLOPs of one trained token of the config's run (PaLM's, what MFU counts): with a sliding
    window each query sees its W latest keys, not the whole sequence; of a mixture of experts, the active
    parameters (k of the E experts, and the router)."""
    return shape(cfg).model_flops_per_token(cfg.train.seq_len)


def device_budget(hardware: str, mem_fraction: float = 0.9, cluster: gpu.Cluster | None = None) -> float:
    """Bytes a step may use per device: on a described GPU cluster what XLA's allocator will give there
    (`gpu.memory_limit`), else what the accelerator at hand reports, else (fake CPU devices) `mem_fraction`
    of the planner's `hardware`."""
    if cluster is not None:
        return gpu.memory_limit(cluster.target)
    return device_memory_limit() or plan.parse_hardware(hardware).hbm * mem_fraction


def planned_layouts(cfg: configs.Config, hardware: str, top: int, cluster: gpu.Cluster | None = None
                    ) -> list[tuple[configs.Config, plan.Estimate]]:
    """The planner's `top` layouts for the devices present (or the described cluster's), each applied to
    `cfg`, with the planner's estimate: [(config, estimate)], fastest first."""
    devices, per_host = (cluster.devices, cluster.devices_per_host) if cluster else (jax.device_count(),
                                                                                      jax.local_device_count())
    result = plan.search(shape(cfg), devices=devices, devices_per_host=per_host,
                         hardware=cluster.target.name if cluster else hardware, global_batch=cfg.train.global_batch,
                         seq_len=cfg.train.seq_len, compute_dtype=cfg.train.compute_dtype, top=top,
                         flash_attention=plan.Run.of(cfg.train).flash_attention,
                         capacities=plan.capacities(cfg.parallel))
    out = []
    for est in result.ranked:
        chosen = dataclasses.replace(cfg, mesh=est.layout.mesh)
        out.append((config_lib.apply(chosen, [f"{k}={v}" for k, v in est.layout.overrides().items()]), est))
    return out


def compile_check(cfg: configs.Config, cluster: gpu.Cluster | None = None) -> dict:
    """The compile-only report of `cfg`'s step on its mesh (nothing allocated) — of fake CPU devices, or of the
    described GPU cluster (`meshpar.compiler.gpu`) — with the planner's prediction for the same layout beside
    it: `predicted_peak_bytes` and `predicted_host_bytes` (device and host memory), and on CPU
    `predicted_cpu_peak_bytes`, the form this CPU compile takes (`plan.memory(cpu=True)`: what XLA:CPU, having
    no host memory of its own, keeps on the device), which the compiled peak checks. For a GPU cluster
    `remat = auto` is decided as a GPU run decides it (the first of its candidates whose compiled peak fits
    `device_budget`), and the report adds the target, the attention kernel and why, the model's FLOPs and the
    planner's step time beside the program's own (`step_time_check`)."""
    platform = "cpu" if cluster is None else "gpu"
    mesh = mesh_lib.build(cfg.mesh, gpu.devices(cluster) if cluster else None)
    budget = gpu.memory_limit(cluster.target) if cluster else None
    tried = {}
    for remat in remat_lib.candidates(cfg.train.remat, platform, cfg.parallel):
        chosen = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, remat=remat))
        report = fit.compile_step(chosen.model_factory(), chosen.train, mesh, rules_lib.make(chosen.parallel),
                                  documents=chosen.data.packing != "none")
        tried[remat] = report["memory_per_device"]["peak_bytes"]
        if budget is None or tried[remat] <= budget:
            break
    lay = plan.Layout.of_run(cfg.mesh.resolve(mesh.size), cfg.parallel, chosen.train, platform)
    model, run = shape(cfg), plan.Run.of(chosen.train, platform)
    predicted = plan.memory(model, lay, run)
    report = {"config": cfg.name, "mesh": dict(mesh.shape), "devices": mesh.size, "layout": lay.describe(),
              "remat": chosen.train.remat, **report, "predicted_peak_bytes": predicted.total,
              "predicted_host_bytes": predicted.host}
    if cluster is None:
        return {**report, "predicted_cpu_peak_bytes": plan.memory(model, lay, run, cpu=True).total}
    estimate = plan.estimate(model, lay, run, plan.PRESETS[cluster.target.name], cluster.devices_per_host,
                             strict=False)
    return {**report, "target": cluster.describe(), "budget_bytes": budget,
            "fits": report["memory_per_device"]["peak_bytes"] <= budget, "remat_tried_peak_bytes": tried,
            "attention": attention_kernel(chosen, report["gpu"]["kernels"]["attention"]),
            "model_flops_per_device": flops_per_token(cfg) * cfg.train.global_batch * cfg.train.seq_len / mesh.size,
            "step_time_check": step_time_check(report["gpu"]["step_time"], estimate)}


def attention_kernel(cfg: configs.Config, cudnn_calls: int) -> str:
    """The attention kernel the GPU program runs, and why (`meshpar.attention.kernels.resolve_kernel`'s rules,
    checked against the cuDNN calls the program holds)."""
    asked = cfg.train.attention_kernel
    if cudnn_calls:
        return f"cudnn: {'asked for' if asked == 'cudnn' else 'auto chose cuDNN fused attention'}"
    if asked not in ("auto", "cudnn"):
        return f"{asked}: asked for"
    if reason := kernels.cudnn_unsupported(jnp.dtype(cfg.train.compute_dtype), cfg.model.head_dim):
        return f"blockwise: cuDNN cannot run it ({reason})"
    if cfg.model.attn_sinks:
        return "blockwise: attention sinks need the log-sum-exp's gradient, which JAX's cuDNN call does not give"
    if cfg.model.attn_softcap:
        return "blockwise: JAX's cuDNN call has no soft-capping"
    if cfg.mesh.sequence > 1:
        return ("blockwise: context parallelism calls attention inside a partly manual shard_map, where cuDNN's "
                "custom partitioner fails to compile")
    if cfg.data.packing != "none":
        return "blockwise: documents' masks are not plain causal"
    return "blockwise"


def step_time_check(program: dict, estimate: plan.Estimate, tolerance: float = 0.15) -> dict:
    """The GPU program's roofline step time beside the planner's, part by part (compute; exposed
    communication; host copies), and where they differ by more than `tolerance`, the part that differs most."""
    parts = {"compute": (program["matmul_s"] + program["attention_s"] + program["memory_s"],
                         estimate.compute_s + estimate.optimizer_s),
             "exposed communication": (program["exposed_s"], estimate.exposed_s),
             "host copies": (program["host_s"], estimate.host_s)}
    ratio = program["step_s"] / estimate.step_s
    check = {"program_step_s": program["step_s"], "planner_step_s": estimate.step_s, "ratio": ratio,
             "parts_s": {name: {"program": a, "planner": b} for name, (a, b) in parts.items()}}
    if abs(ratio - 1) > tolerance:
        name, (a, b) = max(parts.items(), key=lambda item: abs(item[1][0] - item[1][1]))
        check["differs_most"] = f"{name}: program {a:.3f} s, planner {b:.3f} s"
    return check


def auto_layout(cfg: configs.Config, hardware: str, top: int = 5, cluster: gpu.Cluster | None = None
                ) -> configs.Config:
    """The planner's fastest layout that the compiler confirms fits on these devices (or the described
    cluster's), trying the planner's top `top` in order."""
    budget = device_budget(hardware, cluster=cluster)
    for chosen, est in planned_layouts(cfg, hardware, top, cluster):
        peak = compile_check(chosen, cluster)["memory_per_device"]["peak_bytes"]
        fits = peak <= budget
        print(f"--mesh auto: {est.layout.describe()}: compiler peak {peak / GB:.1f} GB per device (planner "
              f"{est.memory.total / GB:.1f}), {budget / GB:.1f} GB usable: {'fits' if fits else 'does not fit'}",
              flush=True)
        if fits:
            return chosen
    raise InputError(f"--mesh auto: none of the planner's top {top} layouts fits {budget / GB:.1f} GB per device "
                     f"once compiled; use more devices, a smaller batch or sequence, or set the layout with --mesh")
