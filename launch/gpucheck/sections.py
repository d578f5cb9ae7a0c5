"""gpucheck's sections: which jobs each runs, in order, cheapest first."""

from __future__ import annotations

from collections.abc import Callable

from launch.gpucheck.jobs import one_line
from launch.gpucheck.record import Check, Job
from launch.gpucheck.tables import find_row

# The attention sections' shapes: llama_8b's heads (32 query heads sharing 8 kv heads, head dim 128), batch 1.
GQA = {"heads": 32, "kv_heads": 8}
SPEED_HEAD_DIM = 128
NUMERICS_T = 2048
# Dense attention's float32 scores at 32k would take 32 × 32768² × 4 B = 137 GB: no GPU holds them.
SPEED_RUNS = ((2048, ("dense", "blockwise", "cudnn")), (8192, ("dense", "blockwise", "cudnn")),
              (32768, ("blockwise", "cudnn")))

TRAIN_CONFIG = "llama_1b"
# Two sequences of 4096: the planner puts remat=none at 44 GB per device (dots 28, full 23), within the ~60 GB
# XLA takes of an H100, so that remat=auto has a choice to make and the remat A/B can run all three.
TRAIN_SETTINGS = {"train.seq_len": 4096, "train.global_batch": 2, "train.compute_dtype": "bfloat16"}
TRAIN_STEPS = 20
# Seconds a job may take before it has been measured, kept generous (a GPU's process start and compile
# included): a job starts only if its estimate fits the time left.
ESTIMATE_S = {"machine": 60, "numerics": 120, "speed": {2048: 90, 8192: 120, 32768: 180}, "train": 300,
              "compile": 120}


def train_args(changes: dict | None = None, mesh: str = "", devices: int = 1) -> dict:
    """The training job's arguments: section 4's settings with `changes`, on `mesh` over `devices`."""
    settings = {**TRAIN_SETTINGS, **(changes or {})}
    return {"config": TRAIN_CONFIG, "overrides": [f"{key}={value}" for key, value in settings.items()],
            "mesh": mesh, "devices": devices, "steps": TRAIN_STEPS}


DEFAULTS = Job("defaults", "train", train_args(), ESTIMATE_S["train"])
MACHINE = Job("machine", "machine", {}, ESTIMATE_S["machine"])


def defaults_row(check: Check) -> dict | None:
    """The defaults' training row: section 4's, else measured now (unless it was tried and not done)."""
    if "defaults" not in check.outcomes:
        check.job(DEFAULTS)
    return find_row(check.doc, "defaults")


def numerics_section(check: Check) -> None:
    check.job(Job("bf16 against float32", "attention_numerics", {"T": NUMERICS_T, **GQA}, ESTIMATE_S["numerics"]))


def speed_section(check: Check) -> None:
    for T, kernels in SPEED_RUNS:
        check.job(Job(f"T={T}", "attention_speed", {"T": T, "kernels": list(kernels), **GQA,
                                                    "head_dim": SPEED_HEAD_DIM}, ESTIMATE_S["speed"][T]))


def compile_job(remat: str) -> Job:
    """launch.compile's check of the defaults' step with `remat`, on one fake CPU device."""
    args = train_args({"train.remat": remat})
    return Job("launch.compile", "compile", {"config": args["config"], "overrides": args["overrides"],
                                             "mesh": "data=1"}, ESTIMATE_S["compile"], cpu_devices=1)


def training_section(check: Check) -> None:
    """The defaults' run, then launch.compile's check of the same step with the remat that run chose."""
    if (row := defaults_row(check)) is not None:
        check.job(compile_job(row["remat"]))


def ab_variants(remat: str) -> list[tuple[str, dict, bool]]:
    """(label, settings changed, GPU flags on) of each A/B variant: one change from the defaults, whose
    remat (auto's choice, `remat`) is pinned where remat is not the change."""
    pinned = {"train.remat": remat}
    return [("gpu flags off", pinned, False),
            *[(f"remat={policy}", {"train.remat": policy}, True) for policy in ("none", "dots", "full")
              if policy != remat],
            ("attention blockwise", {**pinned, "train.attention_kernel": "blockwise"}, True),
            ("offload optimizer", {**pinned, "parallel.offload": "optimizer"}, True)]


def ab_section(check: Check) -> None:
    baseline = defaults_row(check)
    if baseline is None:
        check.skip_section("the A/B compares with the defaults' run, which did not finish")
        return
    estimate = check.measured_s("defaults", ESTIMATE_S["train"])  # the same model, compiled once or more
    for label, changes, flags in ab_variants(baseline["remat"]):
        check.job(Job(label, "train", train_args(changes), estimate, gpu_flags=flags))


def multi_section(check: Check) -> None:
    """fsdp=N and data=N over every GPU, each GPU with the batch of the one-GPU defaults (weak scaling)."""
    n = check.machine["device_count"]
    if n < 2:
        check.skip_section(f"{n} GPU: nothing to scale across")
        return
    defaults_row(check)  # the one-GPU figure the scaling is against
    estimate = check.measured_s("defaults", ESTIMATE_S["train"])
    batch = n * TRAIN_SETTINGS["train.global_batch"]
    for axis in ("fsdp", "data"):
        mesh = f"{axis}={n}"
        check.job(Job(mesh, "train", train_args({"train.global_batch": batch}, mesh, n), estimate))


SECTIONS: dict[str, tuple[str, Callable[[Check], None] | None]] = {
    "machine": ("1. The machine", None),  # run by `main` before the rest: it decides whether there is a GPU
    "numerics": (f"2. Attention numerics: bf16 kernels against float32 attention of the same inputs, T = "
                 f"{NUMERICS_T}, {GQA['heads']} query heads, {GQA['kv_heads']} kv heads", numerics_section),
    "speed": (f"3. Attention speed: {GQA['heads']} query heads, {GQA['kv_heads']} kv heads, head dim "
              f"{SPEED_HEAD_DIM} (llama_8b), batch 1, bf16", speed_section),
    "training": (f"4. Training {TRAIN_CONFIG}, T = {TRAIN_SETTINGS['train.seq_len']}, "
                 f"{TRAIN_SETTINGS['train.global_batch']} sequences, bf16, {TRAIN_STEPS} steps, the defaults",
                 training_section),
    "ab": ("5. A/B: one change at a time from section 4's step", ab_section),
    "multi": ("6. Several GPUs: the same per-GPU batch on fsdp=N and data=N", multi_section),
}


def run_sections(check: Check, names: list[str]) -> None:
    """Each section in turn; one that fails records its error in one line, and the next goes on."""
    for name in names:
        check.open_section(name, SECTIONS[name][0])
        try:
            SECTIONS[name][1](check)
        except Exception as err:  # a fault of this file's planning, not a measurement: recorded, not fatal
            check.close_section(one_line(err))
        else:
            check.close_section()
