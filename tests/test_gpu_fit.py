"""Full size in the GPU program (XLA's GPU compiler for described H100 clusters, no GPU here): the presets
users run on 8 and 64 H100s fit and run cuDNN attention and async collectives; `remat=auto` decides under
the H100's memory; the README's memory table and its LoRA table hold on the GPU; the planner's peak is within
10% of the GPU compiler's on the layouts its coefficients were fitted to and on layouts kept apart (1F1B, context
parallelism at 32k tokens, a mixture of experts, Gemma 3's layer pattern), and off by what the README says where
it is not. Each program is compiled once for all the tests that read it (`compiled`, and across processes and runs
the store of GPU programs, `meshpar.compiler.program_store`), with remat as the table states it.

Collected only where jax's CUDA plugin and cuDNN's wheel are installed (`make test-gpu-compile`, conftest).
"""

import functools

import pytest

import configs
from launch import configure
from meshpar.compiler import gpu

pytestmark = pytest.mark.slow

GB = 1e9
T32K = ["train.seq_len=32768", "model.max_seq_len=32768"]
SP = ["parallel.sequence_parallel=true"]


@functools.cache
def compiled(config: str, devices: int, mesh: str, *overrides: str) -> dict:
    """`launch.compile --target h100`'s report: on hosts of 8 H100s, or on one host of fewer. A program compiled
    once (for another test too, or in an earlier run) comes from the store of GPU programs."""
    cluster = (gpu.Cluster.parse("h100", hosts=devices // 8) if devices >= 8
               else gpu.Cluster.parse("h100", devices_per_host=devices))
    return configure.compile_check(configure.configure(config, mesh, list(overrides), cluster=cluster)[0], cluster)


def peak(report: dict) -> float:
    return report["memory_per_device"]["peak_bytes"]


def group(layout: tuple) -> pytest.MarkDecorator:
    """The xdist group of the tests that read `layout`'s program: `make test-gpu-compile` (`--dist loadgroup`)
    runs them in one process, whose `compiled` compiles it once."""
    return pytest.mark.xdist_group(" ".join(map(str, layout)))


def rows(table: dict, layout=lambda row: row[0]) -> list:
    """A table's row names as parameters, each in the group of its layout's program."""
    return [pytest.param(name, marks=group(layout(row)), id=name) for name, row in table.items()]


# The presets users run, compiled for H100s: (config, devices, mesh, overrides) → the README's GPU peak, GB.
PRESETS = {
    "llama3_8b, fsdp=8, T=8k, batch 8": (("llama3_8b", 8, "fsdp=8", "train.global_batch=8"), 43.4),
    "llama_70b, fsdp=8×model=8+SP, accumulation 8": (("llama_70b", 64, "fsdp=8,model=8", "train.global_batch=64",
                                                      "train.grad_accum=8", "train.remat=full", *SP), 27.5),
    "mixtral_8x7b, expert=8×fsdp=8, T=4k": (("mixtral_8x7b", 64, "expert=8,fsdp=8", "train.global_batch=64",
                                            "train.seq_len=4096", "train.remat=full"), 23.7),
}

# Layers that differ: Gemma 3's five sliding layers to one global, scanned as 8 periods of 6
GEMMA3 = ("gemma3_12b", 8, "fsdp=8", "train.global_batch=8", "train.remat=full")
# gpt-oss-20b on 8 GPUs: its experts at a capacity, its Adam moments in host memory
GPT_OSS = ("gpt_oss_20b", 8, "fsdp=8", "train.global_batch=8", "parallel.expert_capacity=1.25",
           "parallel.offload=optimizer", "train.remat=dots")


@pytest.mark.parametrize("name", rows(PRESETS))
def test_presets_compile_for_h100_clusters_and_fit(name):
    """Under what XLA's allocator gives on an H100 (0.75 of 79.1 GiB), the README's figure to 2%; cuDNN's
    attention; 90% of the weight gathers asynchronous with compute between their start and done."""
    layout, readme_gb = PRESETS[name]
    report = compiled(*layout)
    assert peak(report) <= report["budget_bytes"]
    assert abs(peak(report) / GB / readme_gb - 1) < 0.02, peak(report) / GB
    assert report["gpu"]["kernels"]["attention"] > 0 and "cuDNN" in report["attention"]
    gathers = report["gpu"]["collectives"]["all-gather"]
    assert gathers["overlapped"] >= 0.9 * gathers["count"], gathers


@group(GEMMA3)
def test_gemma3_12b_compiles_for_h100s_and_fits():
    """`gemma3_12b` (its layer pattern scanned by periods) on fsdp=8 at T = 8192: the README's GPU peak to 2%,
    within what an H100's allocator gives; its head dim of 256 runs the blockwise kernel, for the reason the
    report gives (meshpar's cuDNN check caps the head dim at 128)."""
    report = compiled(*GEMMA3)
    assert peak(report) <= report["budget_bytes"] and abs(peak(report) / GB / 47.7 - 1) < 0.02, peak(report) / GB
    assert "blockwise" in report["attention"] and "head dim 256" in report["attention"]


@group(GPT_OSS)
def test_gpt_oss_20b_compiles_for_h100s_and_fits():
    """`gpt_oss_20b` on fsdp=8 at T = 8192, capacity 1.25, the Adam moments in host memory: the README's GPU peak
    to 2%, within what an H100's allocator gives, the moments' 21 GB on the host; its sinks run the blockwise
    kernel, for the reason the report gives."""
    report = compiled(*GPT_OSS)
    memory = report["memory_per_device"]
    assert peak(report) <= report["budget_bytes"] and abs(peak(report) / GB / 47.0 - 1) < 0.02, peak(report) / GB
    assert abs(memory["host_arguments_bytes"] / GB / 20.95 - 1) < 0.02, memory
    assert "blockwise" in report["attention"] and "sinks" in report["attention"]


LLAMA3_8B = PRESETS["llama3_8b, fsdp=8, T=8k, batch 8"][0]


@group(LLAMA3_8B)
def test_what_the_llama3_8b_program_runs():
    """`llama3_8b` on fsdp=8, one sequence of 8k per GPU: every weight gather is asynchronous with compute between its
    start and done; every GEMM is a cuBLAS call; under remat `auto`, `none` compiles to more than an H100 gives a
    step, so `auto` takes `dots`, which fits (`llama_1b` keeps `none`); and what the README says is to fix: the
    embedding's [V, D] gradient is all-reduced in bf16, 2.1 GB per GPU per step (twice V·D·2 bytes: XLA's
    all-reduce of a [V, D] scatter-add)."""
    report = compiled(*LLAMA3_8B)
    gathers = report["gpu"]["collectives"]["all-gather"]
    assert gathers["count"] == gathers["async"] == gathers["overlapped"], gathers
    assert report["gpu"]["kernels"]["triton_gemm"] == 0 < report["gpu"]["kernels"]["gemm"]
    tried = report["remat_tried_peak_bytes"]
    assert report["remat"] == "dots" and list(tried) == ["none", "dots"]
    assert tried["none"] > report["budget_bytes"] >= tried["dots"]
    assert abs(tried["none"] / GB / 94.6 - 1) < 0.02 and round(report["budget_bytes"] / GB, 1) == 63.7
    assert compiled("llama_1b", 8, "fsdp=8", "train.global_batch=8", "train.seq_len=4096")["remat"] == "none"
    reduced = report["gpu"]["collectives"]["all-reduce"]["bytes_by_dtype"]
    assert abs(reduced["bf16"] / GB / 2.1 - 1) < 0.02


# The README's LoRA table: llama3_8b at T = 8192, one sequence per GPU, full fine-tuning against LoRA r = 16 on q, k,
# v, o, gate, up and down: row → (layout, the README's remat, arguments, peak and planner, GB). Its remat column is
# set, but on the 8-GPU full fine-tuning, the preset's program above, where it is what `auto` takes.
LORA = ("train.lora_rank=16", "train.lora_alpha=32")
ONE_GPU = ("llama3_8b", 1, "fsdp=1", "train.global_batch=1")
LORA_TABLE = {
    "1 GPU, full fine-tuning": ((*ONE_GPU, "train.remat=full"), "full", 96.4, 130.6, 136.4),
    "1 GPU, LoRA, float32 base": ((*ONE_GPU, "train.remat=dots", *LORA), "dots", 32.6, 56.9, 60.0),
    "1 GPU, LoRA, bfloat16 base": ((*ONE_GPU, "train.remat=dots", *LORA, "train.frozen_dtype=bfloat16"), "dots", 16.6,
                                   40.9, 43.9),
    "8 GPUs fsdp=8, full fine-tuning": (LLAMA3_8B, "dots", 12.0, 43.4, 44.5),
    "8 GPUs fsdp=8, LoRA, bfloat16 base": (("llama3_8b", 8, "fsdp=8", "train.global_batch=8", "train.remat=dots", *LORA,
                                            "train.frozen_dtype=bfloat16"), "dots", 2.4, 28.5, 30.9),
}


@pytest.mark.parametrize("row", rows(LORA_TABLE))
def test_the_lora_memory_table_holds_on_the_gpu(row):
    """Each row's remat, and its GPU arguments and peak to 2%, are the README's, its verdict (under the 63.7 GB a
    step gets) too, and the planner, which models the frozen base and the adapters, is the README's figure to 2%."""
    layout, remat, arguments_gb, peak_gb, planner_gb = LORA_TABLE[row]
    report = compiled(*layout)
    memory = report["memory_per_device"]
    assert report["remat"] == remat
    assert abs(memory["arguments_bytes"] / GB / arguments_gb - 1) < 0.02, memory
    assert abs(peak(report) / GB / peak_gb - 1) < 0.02, peak(report) / GB
    assert (peak(report) <= report["budget_bytes"]) == (peak_gb < 63.7)
    assert abs(report["predicted_peak_bytes"] / GB / planner_gb - 1) < 0.02, report["predicted_peak_bytes"] / GB


# The README's table of llama_8b on fsdp=8 at T = 8192, bf16: row → (overrides, its GPU column, GB).
TABLE = {
    "1 sequence per device, remat=full": (("train.global_batch=8", "train.remat=full"), 23.9),
    "1 sequence per device, remat=dots": (("train.global_batch=8", "train.remat=dots"), 43.4),
    "2 sequences per device, remat=full": (("train.global_batch=16", "train.remat=full"), 28.1),
    "4 sequences per device, remat=full": (("train.global_batch=32", "train.remat=full"), 36.0),
    "1 per device × grad_accum=4, remat=full": (("train.global_batch=32", "train.grad_accum=4", "train.remat=full"),
                                                30.0),
    "1 sequence per device, remat=full, dense attention": (("train.global_batch=8", "train.remat=full",
                                                            "train.attention_kernel=dense"), 64.7),
}


@pytest.mark.parametrize("row", rows(TABLE, lambda row: ("llama_8b", 8, "fsdp=8", *row[0])))
def test_the_memory_table_holds_on_the_gpu(row):
    """Each row's GPU peak is the README's to 2%, and so are its verdicts: under 80 GB, and under the 63.7 GB
    XLA's allocator gives a step on an H100."""
    overrides, readme_gb = TABLE[row]
    report = compiled("llama_8b", 8, "fsdp=8", *overrides)
    gb = peak(report) / GB
    assert abs(gb / readme_gb - 1) < 0.02, gb
    assert (gb < 80) == (readme_gb < 80) and (peak(report) <= report["budget_bytes"]) == (readme_gb < 63.7)


# Host offload (`parallel.offload`) at T = 4096, two sequences per GPU
OFFLOADED = ("llama_8b", 8, "fsdp=8", "train.global_batch=16", "train.seq_len=4096", "train.remat=full")

# The planner's GPU form against the GPU compiler. FITTED: what its coefficients were fitted to (on the CPU
# program; the GPU's needed terms more, each read in the buffers of one layout here: 1F1B's second slot from the
# 1F1B × model layout, 1F1B's gathered weights and gradients with fsdp from the 1F1B × fsdp × model one);
# HELD_OUT: never used to fit them. MISSES: layouts where it is more than 10% off, at the error the README
# states (to 2 points).
MOE_PIPELINE = ("stage=4,expert=8,data=2", "train.global_batch=128", "train.seq_len=4096", "parallel.microbatches=8",
                "train.remat=full")
FITTED = {  # the longest compiles first: `make test-gpu-compile` hands out the programs in this order
    # 1F1B's hold of the experts that `expert` alone splits (a copy and an accumulator, no chunk gradient)
    "qwen3-moe 1F1B stage=4×expert=8×data=2, T=4k": ("qwen3_30b_a3b", 64, *MOE_PIPELINE,
                                                     "parallel.pipeline_schedule=1f1b"),
    "8b fsdp, dots": ("llama_8b", 8, "fsdp=8", "train.global_batch=8", "train.remat=dots"),
    "8b fsdp×model+SP, dots": ("llama_8b", 8, "fsdp=2,model=4", "train.global_batch=4", "train.remat=dots", *SP),
    "8b ring, sequence=4, T=32k": ("llama_8b", 8, "sequence=4,fsdp=2", "train.global_batch=2", "train.remat=full",
                                   *T32K),
    "8b 1F1B × model, dots": ("llama_8b", 8, "stage=4,model=2", "train.global_batch=16", "parallel.microbatches=8",
                              "parallel.pipeline_schedule=1f1b", "train.remat=dots"),
    "70b fsdp×model+SP": ("llama_70b", 64, "fsdp=8,model=8", "train.global_batch=8", "train.remat=full", *SP),
    "8b 1F1B × fsdp × model, T=8k": ("llama_8b", 8, "stage=2,fsdp=2,model=2", "train.global_batch=16",
                                     "parallel.microbatches=8", "parallel.pipeline_schedule=1f1b", "train.remat=full"),
}
HELD_OUT = {
    "8b 1F1B × data, dots": ("llama_8b", 8, "stage=4,data=2", "train.global_batch=16", "parallel.microbatches=8",
                             "parallel.pipeline_schedule=1f1b", "train.remat=dots"),
    "8b interleaved 1F1B (R=2) × data, dots": ("llama_8b", 8, "stage=4,data=2", "train.global_batch=16",
                                              "parallel.microbatches=8", "parallel.pipeline_schedule=1f1b",
                                              "parallel.pipeline_repeats=2", "train.remat=dots"),
    "8b Ulysses, sequence=4, T=32k": ("llama_8b", 8, "sequence=4,fsdp=2", "train.global_batch=2", "train.remat=full",
                                      "parallel.context_attention=ulysses", *T32K),
    "1b GPipe, dots": ("llama_1b", 8, "stage=2,data=4", "train.global_batch=32", "parallel.microbatches=4",
                       "train.seq_len=8192", "train.remat=dots"),
    "mixtral expert=8×fsdp=8, T=4k": PRESETS["mixtral_8x7b, expert=8×fsdp=8, T=4k"][0],
    "8b zero-bubble × data, dots": ("llama_8b", 8, "stage=4,data=2", "train.global_batch=16", "parallel.microbatches=8",
                                    "parallel.pipeline_schedule=zero_bubble", "train.remat=dots"),
    "qwen3-moe fsdp=8, capacity 1.25, T=8k": ("qwen3_30b_a3b", 8, "fsdp=8", "train.global_batch=8",
                                              "train.seq_len=8192", "train.remat=full",
                                              "parallel.expert_capacity=1.25"),
    "gemma3-12b fsdp=8, T=8k (a layer pattern)": GEMMA3,
    # written down before the 1F1B × fsdp terms were read in the last of FITTED
    "8b GPipe × fsdp, P=2, T=4k": ("llama_8b", 8, "stage=2,fsdp=4", "train.global_batch=16", "parallel.microbatches=4",
                                   "train.seq_len=4096", "train.remat=full"),
    "8b interleaved 1F1B (R=2) × fsdp × model, T=4k": ("llama_8b", 8, "stage=2,fsdp=2,model=2", "train.global_batch=16",
                                                       "parallel.microbatches=8", "parallel.pipeline_schedule=1f1b",
                                                       "parallel.pipeline_repeats=2", "train.seq_len=4096",
                                                       "train.remat=full"),
    "8b data×model+SP, T=8k": ("llama_8b", 8, "data=2,model=4", "train.global_batch=4", "train.remat=full", *SP),
    "8b 1F1B × fsdp, P=2": ("llama_8b", 8, "stage=2,fsdp=4", "train.global_batch=16", "parallel.microbatches=4",
                            "parallel.pipeline_schedule=1f1b", "train.remat=full"),  # a miss (+11%) before those terms
    # a miss (-11%) while the streamed update held a whole stack of new moments on the devices
    "8b optimizer offloaded, T=4k": (*OFFLOADED, "parallel.offload=optimizer"),
}
MISSES = {
    "8b ZeRO-2": (("llama_8b", 8, "fsdp=8", "train.global_batch=8", "parallel.zero_stage=2", "train.remat=full"), -0.139),
    "gpt-oss-20b, optimizer offloaded, dots": (GPT_OSS, 0.562),
    # a described cluster's program has no host memory: the weight gradients a GPU lands there stay on the devices
    "8b optimizer+params offloaded, T=4k (held out)": ((*OFFLOADED, "parallel.offload=optimizer+params"), -0.213),
}


def error(report: dict) -> float:
    return report["predicted_peak_bytes"] / peak(report) - 1


PLANNED = {**{f"fitted: {name}": layout for name, layout in FITTED.items()},
           **{f"held out: {name}": layout for name, layout in HELD_OUT.items()}}


@pytest.mark.parametrize("name", rows(PLANNED, lambda layout: layout))
def test_planner_predicts_the_gpu_peak_within_10_percent(name):
    report = compiled(*PLANNED[name])
    assert abs(error(report)) < 0.10, (peak(report) / GB, report["predicted_peak_bytes"] / GB)


@pytest.mark.parametrize("name", rows(MISSES))
def test_the_planners_misses_are_the_readmes(name):
    layout, stated = MISSES[name]
    assert abs(error(compiled(*layout)) - stated) < 0.02


@group((*OFFLOADED, "parallel.offload=optimizer"))
def test_the_offloaded_update_holds_one_layers_moments_on_the_gpu():
    """`llama_8b` on fsdp=8 with the Adam moments in host memory: the streamed update writes each layer's new moments
    over the donated stacks, so the step's device temporaries exceed those of the step without offload by less
    than one layer's moments per GPU (0.22 GB), not by a stack of new ones (7.0 GB)."""
    shape = configure.shape(configs.load("llama_8b"))
    extra = (compiled(*OFFLOADED, "parallel.offload=optimizer")["memory_per_device"]["temp_bytes"]
             - compiled(*OFFLOADED)["memory_per_device"]["temp_bytes"])
    assert extra <= 8 * shape.layer_params / 8, extra / GB  # Adam's 8 bytes an element, split over fsdp=8


def test_zero2_beyond_the_planner_is_the_schedulers_headroom(monkeypatch):
    """ZeRO-2's miss is XLA's latency-hiding scheduler overlapping the update's gathers while its memory limit
    allows: held to half that limit, the step compiles to the README's 51.8 GB, within 2% of the planner."""
    options = gpu.compile_options()
    monkeypatch.setattr(gpu, "compile_options", lambda: {**options, "xla_gpu_memory_limit_slop_factor": 50})
    config, devices, mesh, *overrides = MISSES["8b ZeRO-2"][0]
    report = compiled.__wrapped__(config, devices, mesh, *overrides)  # not the cached compile at the default limit
    assert abs(peak(report) / GB / 51.8 - 1) < 0.01 and abs(error(report)) < 0.02


# The README's second opinion on step time: the H100 program's roofline over the planner's estimate, and the
# parts the README names (seconds, FLOPs per GPU, kernel counts).
def _part(report: dict, name: str) -> float:
    parts = report["step_time_check"]["parts_s"]
    return {"memory_s": lambda: report["gpu"]["step_time"]["memory_s"],
            "exposed_s": lambda: parts["exposed communication"]["program"],
            "planner exposed_s": lambda: parts["exposed communication"]["planner"],
            "gemms": lambda: report["gpu"]["kernels"]["gemm"],
            "flops": lambda: report["flops_per_device"], "model flops": lambda: report["model_flops_per_device"]}[name]()


STEP_RATIOS = {
    "llama3_8b, fsdp=8, T=8k, batch 8": (LLAMA3_8B, 1.19, {"memory_s": 0.13}),
    "8b ring, sequence=4, T=32k": (FITTED["8b ring, sequence=4, T=32k"], 10.9, {"gemms": 175_630, "memory_s": 14.5}),
    "70b fsdp×model+SP": (FITTED["70b fsdp×model+SP"], 1.55, {"exposed_s": 1.33, "planner exposed_s": 0.49}),
    "70b, accumulation 8": (PRESETS["llama_70b, fsdp=8×model=8+SP, accumulation 8"][0], 1.57,
                            {"exposed_s": 10.7, "planner exposed_s": 3.9}),
    "mixtral, dropless": (PRESETS["mixtral_8x7b, expert=8×fsdp=8, T=4k"][0], 1.18,
                          {"flops": 1.55e15, "model flops": 0.34e15}),
}


@pytest.mark.parametrize("name", rows(STEP_RATIOS))
def test_the_step_time_second_opinion_is_the_readmes(name):
    layout, stated, parts = STEP_RATIOS[name]
    report = compiled(*layout)
    assert abs(report["step_time_check"]["ratio"] / stated - 1) < 0.05, report["step_time_check"]
    for part, value in parts.items():
        assert abs(_part(report, part) / value - 1) < 0.05, (part, _part(report, part))


@functools.cache
def deepseek_v3_pick() -> tuple:
    """`launch.compile --config deepseek_v3 --target h100 --hosts 32 --mesh auto --top 1`: the planner's pick for
    256 H100s (its estimate) and that layout's H100 program, under XLA's allocator given 0.9 of each GPU."""
    cluster = gpu.Cluster.parse("h100", hosts=32)
    (cfg, estimate), = configure.planned_layouts(configs.load("deepseek_v3"), "h100", 1, cluster)
    return estimate, configure.compile_check(cfg, cluster)


@pytest.mark.xdist_group("deepseek_v3 on 256 H100s")
def test_deepseek_v3_on_256_h100s_fits_as_the_planner_says(monkeypatch):
    """DeepSeek-V3 at full size (671B, its MTP module too; batch 2048 × 4096) on 32 hosts of 8 H100s: the planner
    picks the README's layout (experts at capacity 1.25: dropless's masked grouped matmuls would not fit), whose
    H100 program fits 80 GB, and under 0.9 of it, with the planner within 10% of its peak and the moments' bytes
    in host memory to the byte; the README's figures, to 2%, and the experts' all-to-alls in the program."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    estimate, report = deepseek_v3_pick()
    assert estimate.layout.describe() == "fsdp=16,expert=16 zero=3 capacity=1.25 remat=full offload=optimizer accum=8"
    assert peak(report) <= report["budget_bytes"] < 80 * GB
    assert abs(error(report)) < 0.10 and abs(peak(report) / GB / 69.6 - 1) < 0.02, (peak(report) / GB, error(report))
    assert abs(error(report) + 0.087) < 0.005  # the README's −8.7%
    assert abs(report["collectives"]["all-gather"]["bytes"] / 1e12 / 3.5 - 1) < 0.02  # per GPU per step
    host = report["memory_per_device"]["host_arguments_bytes"]
    assert abs(host / report["predicted_host_bytes"] - 1) < 1e-3 and abs(host / GB / 21.3 - 1) < 0.02
    assert abs(estimate.tokens_per_s / 256 / 642 - 1) < 0.02  # per GPU
    assert abs(report["step_time_check"]["ratio"] / 6.0 - 1) < 0.05
    assert report["collectives"]["all-to-all"]["count"] > 0
