"""Full size, compile-only (nothing is allocated): the real training step of llama_1b and llama_8b on 8 and
llama_70b on 64 fake CPU devices. Per-device memory from the compiler against the targets meshpar is built
for, and against the planner's prediction (within 10%) on the layouts its coefficients were fitted to
(`FITTED`) and, apart, on layouts they were not (`HELD_OUT`: other sizes, meshes, remat, schedules,
offload); every layout the planner ranks compiles; `launch.compile`.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import readme_figure, require_devices
from launch import configure

import configs

# full-size compiles, minutes of them: `make test-slow`, which CI runs beside `make test`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
T32K = ["train.seq_len=32768", "model.max_seq_len=32768"]
T16K = ["train.seq_len=16384", "model.max_seq_len=16384"]
SP = ["parallel.sequence_parallel=true"]

# name: (config, devices, mesh, overrides); bfloat16 compute (the presets'), T = 8192 unless said. The
# planner's coefficients are fitted to these, to five more checked once (README: fsdp T=4k none, ring at
# 16k dots, accumulation with dots; 70b T=4k none and ring at 32k) and to a grid of llama_8b pipelines
# (meshpar/plan/memory.py).
FITTED = {
    "8b fsdp, 4 sequences per device, full remat": ("llama_8b", 8, "fsdp=8", ["train.global_batch=32", "train.remat=full"]),
    "8b fsdp, dots remat": ("llama_8b", 8, "fsdp=8", ["train.global_batch=8", "train.remat=dots"]),
    "8b fsdp×model+SP, dots": ("llama_8b", 8, "fsdp=2,model=4", ["train.global_batch=4", "train.remat=dots", *SP]),
    "8b ring over sequence=4, T=32k": ("llama_8b", 8, "sequence=4,fsdp=2", ["train.global_batch=2", "train.remat=full", *T32K]),
    "8b pipeline stage=2": ("llama_8b", 8, "stage=2,fsdp=4", ["train.global_batch=16", "parallel.microbatches=4", "train.remat=full"]),
    "8b accumulation over data×fsdp": ("llama_8b", 8, "data=2,fsdp=4", ["train.global_batch=16", "train.grad_accum=2", "train.remat=full"]),
    "70b fsdp×model+SP": ("llama_70b", 64, "fsdp=8,model=8", ["train.global_batch=8", "train.remat=full", *SP]),
    "70b fsdp×model+SP, accumulation 8": ("llama_70b", 64, "fsdp=8,model=8", ["train.global_batch=64", "train.grad_accum=8", "train.remat=full", *SP]),
    "70b pipeline stage=4": ("llama_70b", 64, "stage=4,fsdp=16", ["train.global_batch=64", "parallel.microbatches=4", "train.remat=full"]),
}
# Not fitted to: chosen before the coefficients were refitted, and never used to fit them.
HELD_OUT = {
    "1b fsdp, dots": ("llama_1b", 8, "fsdp=8", ["train.global_batch=16", "train.seq_len=8192", "train.remat=dots"]),
    "1b GPipe, dots": ("llama_1b", 8, "stage=2,data=4", ["train.global_batch=32", "parallel.microbatches=4",
                                                         "train.seq_len=8192", "train.remat=dots"]),
    "8b data×fsdp×model, T=4k, no remat": ("llama_8b", 8, "data=2,fsdp=2,model=2", ["train.global_batch=8",
                                                                                  "train.seq_len=4096", "train.remat=none"]),
    "8b all-gather attention, T=16k": ("llama_8b", 8, "sequence=4,fsdp=2", ["train.global_batch=2", "train.remat=full",
                                                                           "parallel.context_attention=allgather", *T16K]),
    "8b Ulysses, T=16k, dots": ("llama_8b", 8, "sequence=2,fsdp=4", ["train.global_batch=4", "train.remat=dots",
                                                                    "parallel.context_attention=ulysses", *T16K]),
    "8b ZeRO-2": ("llama_8b", 8, "fsdp=8", ["train.global_batch=8", "parallel.zero_stage=2", "train.remat=full"]),
    "8b 1F1B × model, dots": ("llama_8b", 8, "stage=4,model=2", ["train.global_batch=16", "parallel.microbatches=8",
                                                                "parallel.pipeline_schedule=1f1b", "train.remat=dots"]),
    "8b circular, R=2": ("llama_8b", 8, "stage=2,fsdp=4", ["train.global_batch=16", "parallel.microbatches=4",
                                                          "parallel.pipeline_repeats=2", "train.remat=full"]),
    "8b offload optimizer": ("llama_8b", 8, "fsdp=8", ["train.global_batch=8", "parallel.offload=optimizer",
                                                      "train.remat=full"]),
    "8b offload optimizer+params": ("llama_8b", 8, "fsdp=8", ["train.global_batch=8", "train.remat=full",
                                                             "parallel.offload=optimizer+params"]),
    "8b remat offload": ("llama_8b", 8, "fsdp=8", ["train.global_batch=8", "train.remat=offload"]),
    "70b fsdp×model, dots": ("llama_70b", 64, "fsdp=16,model=4", ["train.global_batch=16", "train.remat=dots"]),
    # the open families' presets whose tensors are new to the planner (README): q/k/v biases; q/k norms
    # and a head dim of their own
    **{f"{name} fsdp, full remat": (name, 8, "fsdp=8", ["train.global_batch=8", "train.remat=full"])
       for name in ("qwen2_5_7b", "qwen3_8b")},
}
# Three cells of the README's table of the mixtures of experts' presets (bf16, full remat, one sequence per
# device): name → (config, devices, mesh, overrides), and the README's compiled peak in GB (jax 0.10's / 0.12's).
MOE = {
    "mixtral expert=8,fsdp=8, T=4k": (("mixtral_8x7b", 64, "expert=8,fsdp=8",
                                       ["train.global_batch=64", "train.seq_len=4096", "train.remat=full"]), "24.9 / 23.2"),
    **{f"qwen3-moe {mesh}, capacity 1.25, T=8k": (
        ("qwen3_30b_a3b", devices, mesh, [f"train.global_batch={devices}", "train.seq_len=8192", "train.remat=full",
                                          "parallel.expert_capacity=1.25"]), gb)
       for devices, mesh, gb in ((8, "fsdp=8", "69.9 / 67.8"), (64, "expert=8,fsdp=8", "14.3 / 13.7"))},
}
LAYOUTS = {**FITTED, **HELD_OUT, **{name: layout for name, (layout, _) in MOE.items()}}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """name → `launch.compile` report; 8-device layouts in this process, 64-device ones in one other."""
    require_devices(8)
    out = {name: configure.compile_check(configure.configure(config, mesh, overrides)[0])
           for name, (config, devices, mesh, overrides) in LAYOUTS.items() if devices == 8}
    wide = [name for name, (_, devices, _, _) in LAYOUTS.items() if devices == 64]
    cases = json.dumps([[LAYOUTS[name][0], LAYOUTS[name][2], LAYOUTS[name][3]] for name in wide])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_many.py"), "64", cases], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out.update(zip(wide, map(json.loads, proc.stdout.splitlines())))
    return out


def peak(report: dict) -> float:
    return report["memory_per_device"]["peak_bytes"]


# More than 10% off on a release, at the error the README states for each (percent, README_RELEASES order), to
# 2 points: the CPU form is about 1.3 GB above jax 0.12's XLA:CPU at llama_8b fsdp=8 (0.4 on 0.10), which weighs
# most where the model states are all in host memory
MISSES = {"8b offload optimizer+params": "+3.7 / +12.2"}


@pytest.mark.parametrize("name", [*(f"fitted: {n}" for n in FITTED), *(f"held out: {n}" for n in HELD_OUT)])
def test_planner_predicts_the_compiled_peak_within_10_percent(reports, name):
    """The planner's peak in the form XLA's CPU backend compiles (`predicted_cpu_peak_bytes`: host memory is
    device memory there for temporaries) against the compiler's, on fitted and held-out layouts alike."""
    layout = name.split(": ", 1)[1]
    report = reports[layout]
    error = report["predicted_cpu_peak_bytes"] / peak(report) - 1
    if layout in MISSES:
        assert abs(error - readme_figure(MISSES[layout]) / 100) < 0.02, error
    else:
        assert abs(error) < 0.10, (peak(report) / GB, report["predicted_cpu_peak_bytes"] / GB)


@pytest.mark.parametrize("name", MOE)
def test_moe_presets_fit_an_80_gb_device_as_the_readme_says(reports, name):
    """Under 72 GB (90% of 80) and, on the main CI leg's jax, the README's figure (to 1%); at capacity the
    planner within 10% (dropless, XLA's El masked matmuls per grouped matmul are not fitted: README); over
    `expert` the step dispatches by all-to-all."""
    report, (_, _, mesh, overrides) = reports[name], MOE[name][0]
    assert peak(report) < 72 * GB
    assert peak(report) / GB == pytest.approx(readme_figure(MOE[name][1]), rel=0.01)
    if any("expert_capacity" in o for o in overrides):
        assert abs(report["predicted_cpu_peak_bytes"] / peak(report) - 1) < 0.10
    if "expert" in mesh:
        assert report["collectives"]["all-to-all"]["count"] > 0


def test_llama_8b_fits_four_sequences_of_8k_per_device_in_60_gb(reports):
    """fsdp=8, global batch 32, T = 8192, bf16, full remat (one sequence per device took 60.5 GB before
    the blockwise attention and the chunked loss)."""
    assert peak(reports["8b fsdp, 4 sequences per device, full remat"]) <= 60 * GB


def test_llama_8b_ring_attention_fits_32k_tokens_in_75_gb(reports):
    """sequence=4, fsdp=2, T = 32,768, global batch 2, ring attention (zigzag), full remat."""
    report = reports["8b ring over sequence=4, T=32k"]
    assert peak(report) <= 75 * GB
    assert "collective-permute" in report["collectives"]  # the ring's K/V blocks


def test_llama_70b_accumulator_is_a_sixty_fourth_of_the_gradient(reports):
    """fsdp=8 × model=8 with SP, 8 microbatches: the accumulator takes the gradient's layout (split over
    fsdp and model), so accumulating costs a fraction of one whole float32 gradient per device — at most
    1/8 of it (the target), and near 1/64 (the layout): compared with one microbatch without accumulation."""
    extra = (reports["70b fsdp×model+SP, accumulation 8"]["memory_per_device"]["temp_bytes"]
             - reports["70b fsdp×model+SP"]["memory_per_device"]["temp_bytes"])
    whole_gradient = 4 * configure.shape(configs.load("llama_70b")).params
    assert extra <= whole_gradient / 8
    assert extra <= 1.5 * whole_gradient / 64, (extra / GB, whole_gradient / 64 / GB)


@pytest.mark.parametrize(("name", "device", "host"), [("8b fsdp, dots remat", 12, 0), ("8b offload optimizer", 4, 8),
                                                    ("8b offload optimizer+params", 0, 12)])
def test_llama_8b_offload_moves_the_model_states_to_the_host(reports, name, device, host):
    """The README's offload table (fsdp=8, T = 8192): bytes per parameter over the 8 devices at rest on each
    device and in its host's memory, as ZeRO-Offload's formula has them (4 float32 weights, 8 Adam
    moments), within 5%; under `optimizer+params` nothing but the step counts stays on the device."""
    psi = configure.shape(configs.load("llama_8b")).params
    memory = reports[name]["memory_per_device"]
    assert memory["arguments_bytes"] == pytest.approx(device * psi / 8, rel=0.05, abs=1e-3 * GB)
    assert memory["host_arguments_bytes"] == pytest.approx(host * psi / 8, rel=0.05)


def test_launch_compile_prints_the_report_contract(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.compile", "--config", "tiny", "--devices", "4",
                           "--mesh", "data=2,model=2", "--set", "train.remat=full", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    memory = report["memory_per_device"]
    assert {"arguments_bytes", "temp_bytes", "outputs_bytes", "alias_bytes", "peak_bytes"} <= memory.keys()
    assert memory["peak_bytes"] == (memory["arguments_bytes"] + memory["temp_bytes"] + memory["outputs_bytes"]
                                    - memory["alias_bytes"])
    assert report["devices"] == 4 and report["mesh"]["model"] == 2
    assert report["collectives"]["all-reduce"]["count"] > 0 and report["compile_s"] > 0
    assert math.isfinite(report["predicted_peak_bytes"]) and report["predicted_peak_bytes"] > 0
    proc = subprocess.run([sys.executable, "-m", "launch.compile", "--config", "tiny", "--devices", "4",
                           "--mesh", "model=3"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode != 0 and "error: mesh model=3 has 3 devices, but 4 are present" in proc.stderr


@pytest.mark.parametrize(("devices", "overrides"), [
    (16, ["model.n_layers=8", "train.global_batch=32"]),
    (32, ["model.n_layers=4", "train.global_batch=8", "train.seq_len=1024", "train.compute_dtype=bfloat16"]),
    (64, ["model.n_layers=8", "model.n_kv_heads=4", "train.global_batch=64", "train.grad_accum=1"]),
])
def test_every_layout_the_planner_ranks_compiles(devices, overrides):
    """The planner's top 3 layouts for small dims on 16, 32 and 64 devices, each compiled (not only
    checked for divisibility): no layout it proposes fails inside JAX or XLA."""
    args = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "launch.compile", "--config", "tiny", "--devices", str(devices),
                           "--mesh", "auto", "--top", "3", "--json", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    assert len(reports) == 3 and all(r["fits"] for r in reports)
    assert [r["planner_rank"] for r in reports] == [1, 2, 3]
