"""A run from a preset and the command line: its config, mesh, rules and model, for every launch command.

`--mesh auto` asks the planner (`meshpar.plan`) for its fastest layouts on the devices present and takes
the first that the compiler confirms fits (`meshpar.compiler.fit`: the real step compiled for abstract
state). Import this after `launch.devices.setup`: building a mesh starts JAX's backend.
"""

from __future__ import annotations

import dataclasses

import jax

import configs
from meshpar import config as config_lib, mesh as mesh_lib, plan, rules as rules_lib
from meshpar.compiler import fit
from meshpar.errors import InputError
from meshpar.run import device_memory_limit
from models.transformer import TransformerConfig

GB = 1e9


def configure(name: str, mesh_text: str | None, overrides: list[str], hardware: str = "h100",
              init_from: str | None = None):
    """(config, mesh, rules, model factory) of a preset with `--mesh` and `--set` applied, and the model
    of `init_from` (a directory of saved parameters) if given."""
    cfg = configs.load(name)
    if mesh_text not in (None, "auto"):
        cfg = dataclasses.replace(cfg, mesh=mesh_lib.parse(mesh_text))
    cfg = config_lib.apply(cfg, overrides)
    if init_from:
        from launch import weights

        if changed := [o for o in overrides if o.startswith("model.")]:
            raise InputError(f"--init-from {init_from} sets the model; {', '.join(changed)} cannot change it")
        cfg = dataclasses.replace(cfg, model=TransformerConfig.from_dict(weights.saved_config(init_from)[0]["model"]))
    if mesh_text == "auto":
        cfg = auto_layout(cfg, hardware)
    return cfg, mesh_lib.build(cfg.mesh), rules_lib.make(cfg.parallel), cfg.model_factory()


def shape(cfg: configs.Config) -> plan.Shape:
    """The planner's view of the config's model (built abstractly), a mixture's k beside it."""
    return plan.Shape.of_model(cfg.model_factory(), cfg.model.experts_per_token if cfg.model.n_experts else 0)


def flops_per_token(cfg: configs.Config) -> float:
    """The model FLOPs of one trained token of the config's run (PaLM's, what MFU counts): with a sliding
    window each query sees its W latest keys, not the whole sequence; of a mixture of experts, the active
    parameters (k of the E experts, and the router)."""
    return shape(cfg).model_flops_per_token(cfg.train.seq_len, getattr(cfg.model, "sliding_window", 0))


def device_budget(hardware: str, mem_fraction: float = 0.9) -> float:
    """Bytes a step may use per device: what the accelerator's allocator reports, else (fake CPU devices)
    `mem_fraction` of the planner's `hardware`."""
    return device_memory_limit() or plan.parse_hardware(hardware).hbm * mem_fraction


def planned_layouts(cfg: configs.Config, hardware: str, top: int) -> list[tuple[configs.Config, plan.Estimate]]:
    """The planner's `top` layouts for the devices present, each applied to `cfg`, with the planner's
    estimate: [(config, estimate)], fastest first."""
    result = plan.search(shape(cfg), devices=jax.device_count(), devices_per_host=jax.local_device_count(),
                         hardware=hardware, global_batch=cfg.train.global_batch, seq_len=cfg.train.seq_len,
                         compute_dtype=cfg.train.compute_dtype, top=top,
                         flash_attention=plan.Run.of(cfg.train).flash_attention)
    out = []
    for est in result.ranked:
        chosen = dataclasses.replace(cfg, mesh=est.layout.mesh)
        out.append((config_lib.apply(chosen, [f"{k}={v}" for k, v in est.layout.overrides().items()]), est))
    return out


def compile_check(cfg: configs.Config) -> dict:
    """The compile-only report of `cfg`'s step on its mesh (nothing allocated), with the planner's
    prediction for the same layout beside it: `predicted_peak_bytes` and `predicted_host_bytes` (device and
    host memory), and `predicted_cpu_peak_bytes`, the form this CPU compile takes (`plan.memory(cpu=True)`:
    what XLA:CPU, having no host memory of its own, keeps on the device), which the compiled peak checks."""
    mesh = mesh_lib.build(cfg.mesh)
    report = fit.compile_step(cfg.model_factory(), cfg.train, mesh, rules_lib.make(cfg.parallel),
                              documents=cfg.data.packing != "none")
    lay = plan.Layout.of_run(cfg.mesh.resolve(mesh.size), cfg.parallel, cfg.train, "cpu")
    model, run = shape(cfg), plan.Run.of(cfg.train, "cpu")
    predicted, on_cpu = plan.memory(model, lay, run), plan.memory(model, lay, run, cpu=True)
    return {"config": cfg.name, "mesh": dict(mesh.shape), "devices": mesh.size, "layout": lay.describe(),
            **report, "predicted_peak_bytes": predicted.total, "predicted_host_bytes": predicted.host,
            "predicted_cpu_peak_bytes": on_cpu.total}


def auto_layout(cfg: configs.Config, hardware: str, top: int = 5) -> configs.Config:
    """The planner's fastest layout that the compiler confirms fits on these devices, trying the planner's
    top `top` in order."""
    budget = device_budget(hardware)
    for chosen, est in planned_layouts(cfg, hardware, top):
        peak = compile_check(chosen)["memory_per_device"]["peak_bytes"]
        fits = peak <= budget
        print(f"--mesh auto: {est.layout.describe()}: compiler peak {peak / GB:.1f} GB per device (planner "
              f"{est.memory.total / GB:.1f}), {budget / GB:.1f} GB usable: {'fits' if fits else 'does not fit'}",
              flush=True)
        if fits:
            return chosen
    raise InputError(f"--mesh auto: none of the planner's top {top} layouts fits {budget / GB:.1f} GB per device "
                     f"once compiled; use more devices, a smaller batch or sequence, or set the layout with --mesh")
