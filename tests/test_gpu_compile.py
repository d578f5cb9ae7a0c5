"""XLA's GPU compiler, run here with no GPU (`meshpar.compiler.gpu`); every check reads the GPU program.

The packaged targets read back from the topologies XLA builds of them; every strategy row of the README
compiles for 8 H100s; the README's GPU claims hold in the compiled program: `auto` attention is cuDNN's and
falls back where it says, a sliding window reaches cuDNN's calls, FSDP gathers weights and reduce-scatters
gradients in bf16, collectives run asynchronously with compute between start and done, each GPU flag changes
what it says it changes, remat `auto` decides under the GPU's memory; the README's GPU command runs. Full
size (slow): `llama3_8b` on 8, `llama_70b` and `mixtral_8x7b` on 64 H100s, the memory table's rows against
the GPU, and the planner's peak within 10% of the GPU compiler's on layouts its coefficients were fitted to
and on layouts kept apart.

Collected only where jax's CUDA plugin and cuDNN's wheel are installed (`make test-gpu-compile`, conftest).
"""

import contextlib
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import configs
from launch import configure
from meshpar import gpu_flags, gpu_target, train
from meshpar.compiler import fit, gpu, gpu_program, hlo, program_store
from meshpar.errors import InputError
from test_readme import block_commands, table_rows

# one group for `--dist loadgroup` (`make test-gpu-compile`): the file's programs, shared by its tests, in one process
pytestmark = pytest.mark.xdist_group("test_gpu_compile.py")
ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
H100x8 = gpu.Cluster.parse("h100")
BF16 = "train.compute_dtype=bfloat16"


@functools.cache
def compiled(config: str, mesh: str, *overrides: str, cluster: gpu.Cluster = H100x8) -> dict:
    """`launch.compile --target`'s report for a preset on a mesh of the cluster."""
    cfg = configure.configure(config, mesh, list(overrides), cluster=cluster)[0]
    return configure.compile_check(cfg, cluster)


@pytest.mark.parametrize("name", gpu_target.TARGETS)
def test_each_target_describes_its_gpu_to_xla(name):
    """The topology XLA builds from a packaged target carries its device kind, its hosts and, read back
    from the serialized topology, every field of its device description; tiny's step compiles for the A100
    and the B200 with cuDNN attention (the H100 and H200 share a compute capability)."""
    target = gpu_target.TARGETS[name]
    cluster = gpu.Cluster(target, hosts=2, devices_per_host=4)
    devices = gpu.devices(cluster)
    assert [d.device_kind for d in devices] == [target.description] * 8
    assert [d.process_index for d in devices] == [0] * 4 + [1] * 4
    serialized = topologies.TopologyDescription(devices).serialize()
    assert gpu_target.read_device_info(serialized) == target.device_info()
    assert gpu_target.differences(target.device_info(), target) == []
    assert gpu_target.differences({**target.device_info(), "core_count": 1}, target) == [("core_count", 1,
                                                                                          target.core_count)]
    if name in ("a100", "b200"):  # other compute capabilities than the H100's, which every other test compiles for
        report = compiled("tiny", "fsdp=8", BF16, cluster=gpu.Cluster(target))
        assert report["gpu"]["kernels"]["attention"] > 0 and report["target"].startswith(f"8 × {target.description}")


def test_gpucheck_reads_a_devices_own_description_against_the_packaged_one():
    """What `launch.gpucheck` prints of a GPU's own description, here of the described H100s' (on a GPU
    machine, of the GPUs at hand): the packaged H100 target, the same in every field."""
    from launch.gpucheck import jobs, tables

    row = jobs.gpu_description(gpu.devices(H100x8))
    assert row["gpu_target"] == {"own": gpu_target.TARGETS["h100"].device_info(), "packaged": "h100",
                                 "differences": []}
    assert tables.target_cell(row) == "h100: the same in every field"


@contextlib.contextmanager
def store_events():
    """What the store of GPU programs answered to the compiles made inside."""
    seen = []
    names = {program_store.HIT: "hit", program_store.MISS: "miss"}
    listener = lambda event, **_: seen.append(names[event]) if event in names else None
    jax.monitoring.register_event_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(listener)


def test_the_program_store_serves_only_the_same_program(tmp_path, monkeypatch):
    """In an empty store: tiny (one layer) on 8 H100s is compiled and stored (a miss); the same layout again comes
    back from the store (a hit) with the same report; with one setting changed (the learning rate) it is compiled
    anew, as is a program under other compile options or other XLA_FLAGS; past the store's bound the program
    read longest ago is evicted."""
    monkeypatch.setenv(program_store.FOLDER, str(tmp_path))
    report = lambda *overrides: compiled.__wrapped__("tiny", "fsdp=8", BF16, "model.n_layers=1", *overrides)
    with store_events() as first:
        stored = report()
    with store_events() as again:
        served = report()
    with store_events() as other:
        report("train.lr=0.0123")
    assert (first, again, other) == (["miss"], ["hit"], ["miss"])
    assert {**served, "compile_s": 0} == {**stored, "compile_s": 0}
    mesh = Mesh(np.array(gpu.devices(H100x8)), ("x",))
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    lowered = jax.jit(lambda x: x @ x.T).lower(x)
    with store_events() as options:
        program_store.compile(lowered, mesh.devices.flat, {"xla_gpu_enable_triton_gemm": True})
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")  # read by the key only: XLA parsed its flags at start
    with store_events() as flags:
        program_store.compile(lowered, mesh.devices.flat, {"xla_gpu_enable_triton_gemm": True})
    assert (options, flags) == (["miss"], ["miss"])
    monkeypatch.setenv(program_store.MAX_BYTES, str(sum(p.stat().st_size for p in tmp_path.glob("*.json.z")) + 1))
    newest = max(tmp_path.glob("*.json.z"), key=lambda p: p.stat().st_mtime)
    before = set(tmp_path.glob("*.json.z"))
    program_store.compile(jax.jit(lambda x: x + 1).lower(x), mesh.devices.flat)
    left = set(tmp_path.glob("*.json.z"))
    assert newest in left and len(before - left) >= 1 and sum(p.stat().st_size for p in left) <= int(
        os.environ[program_store.MAX_BYTES])


# What each README strategy row's program must hold, beside compiling: the collectives that carry it, and
# what else the row is about.
def _kinds(*kinds):
    return lambda report: set(kinds) <= set(report["gpu"]["collectives"])


ROW_CHECKS = {
    "data parallel (DDP)": _kinds("all-reduce"),
    "FSDP = ZeRO-3": _kinds("all-gather", "reduce-scatter"),
    "hybrid sharded DP": _kinds("all-gather", "reduce-scatter", "all-reduce"),
    "ZeRO-1 / ZeRO-2": _kinds("all-gather", "all-reduce"),  # stage 1: whole gradients, updated weights gathered
    "Megatron tensor parallel": _kinds("all-reduce"),
    "+ Megatron sequence parallel": _kinds("all-gather", "reduce-scatter"),
    "3-D": _kinds("all-gather", "reduce-scatter", "all-reduce"),
    "mixed precision": lambda report: report["gpu"]["kernels"]["attention"] > 0,
    "rematerialisation": lambda report: report["remat"] == "full",
    "gradient accumulation": _kinds("all-gather", "reduce-scatter"),
    "context parallel (ring)": _kinds("collective-permute"),
    "pipeline (GPipe)": _kinds("collective-permute"),
    "circular pipeline": _kinds("collective-permute"),
    "pipeline (1F1B)": _kinds("collective-permute"),
    "pipeline (interleaved 1F1B)": _kinds("collective-permute"),
    "pipeline (zero-bubble)": _kinds("collective-permute"),
    "host offload (ZeRO-Offload)": lambda report: report["memory_per_device"]["host_arguments_bytes"] > 0,
    "expert parallel (MoE)": _kinds("all-to-all"),
    # every projection a cuBLASLt FP8 GEMM, and the layers' weights gathered as FP8
    "FP8 matmuls": lambda report: (report["gpu"]["kernels"]["fp8_gemm"] > 0 and
                                   report["gpu"]["collectives"]["all-gather"]["bytes_by_dtype"].get("f8e4m3fn", 0)),
    # the frozen weights gathered, only the adapters' gradients reduced: far fewer bytes
    "LoRA": lambda report: (report["gpu"]["collectives"]["reduce-scatter"]["bytes"]
                            < report["gpu"]["collectives"]["all-gather"]["bytes"] / 10),
    "planner's choice": lambda report: report["memory_per_device"]["peak_bytes"] <= report["budget_bytes"],
}


def test_every_strategy_row_has_a_gpu_check():
    assert set(ROW_CHECKS) == set(table_rows())


def _row_report(strategy: str) -> dict:
    args = iter(shlex.split(table_rows()[strategy]))
    config, mesh, overrides = "tiny", None, []
    for flag in args:
        value = next(args)
        if flag == "--config":
            config = value
        elif flag == "--mesh":
            mesh = value
        elif flag == "--set":
            overrides.append(value)
    return compiled(config, mesh, *overrides)


@pytest.mark.parametrize("strategy", ROW_CHECKS)
def test_every_strategy_row_compiles_for_8_h100s(strategy):
    report = _row_report(strategy)
    assert report["memory_per_device"]["peak_bytes"] > 0 and report["gpu"]["kernels"]["gemm"] > 0
    assert ROW_CHECKS[strategy](report), (report["gpu"]["collectives"], report["memory_per_device"])


# FP8 (`train.fp8`, meshpar.fp8): a layer's seven matmuls (q, k, v, o, gate, up, down), each a forward GEMM and two
# backward ones: 21 per layer; rowwise, XLA merges the forward GEMMs that share their FP8 input (q, k and v's; gate and
# up's): 18.
FP8_GEMMS_PER_LAYER = {"tensorwise": 21, "rowwise": 18}


def _projection_params(model) -> int:
    """The weights of one layer's FP8 matmuls."""
    D, N, K, H, F = model.d_model, model.n_heads, model.n_kv_heads, model.head_size, model.d_ff
    return D * (N + 2 * K) * H + N * H * D + 3 * D * F


@functools.cache
def _fp8_program(recipe: str, target: str) -> tuple[dict, str, object]:
    """tiny on 8 GPUs of `target`, fsdp=8, bf16, remat none, FP8 by `recipe`: the program read, its text, the config."""
    cluster = gpu.Cluster.parse(target)
    overrides = [BF16, f"train.fp8={recipe}", "train.remat=none"]
    cfg, mesh, rules, make_model = configure.configure("tiny", "fsdp=8", overrides, cluster=cluster)
    sharded = train.sharded_abstract(make_model, train.optimizer(cfg.train), mesh, rules)
    state, tokens = fit.abstract_inputs(sharded, cfg.train)
    lowered = train.make_step(sharded, tokens.sharding, cfg.train).lower(state, tokens)
    text = program_store.compile(lowered, mesh.devices.flat, gpu.compile_options()).as_text()
    return gpu_program.read(text, fit.program_costs(mesh)), text, cfg


@pytest.mark.parametrize("target", ["h100", "b200"])
@pytest.mark.parametrize("recipe", FP8_GEMMS_PER_LAYER)
def test_fp8_matmuls_are_cublaslt_fp8_gemms(recipe, target):
    """Every matmul of attention's projections and the MLP is a cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`), as
    many per step as the layers' matmuls make, and their FLOPs are exactly those matmuls' forward and backward;
    the bf16 GEMMs left are the rest of the program without FP8 (the output head's)."""
    report, _, cfg = _fp8_program(recipe, target)
    plain = _fp8_program("none", target)[0]
    model, t = cfg.model, cfg.train
    fp8_flops = 6 * t.global_batch * t.seq_len / 8 * _projection_params(model) * model.n_layers
    assert report["kernels"]["fp8_gemm"] == FP8_GEMMS_PER_LAYER[recipe] * model.n_layers
    assert report["flops_by_kernel"]["fp8_gemm"] == fp8_flops
    assert report["flops_by_kernel"]["gemm"] == plain["flops_by_kernel"]["gemm"] - fp8_flops > 0
    assert plain["kernels"]["fp8_gemm"] == 0


@pytest.mark.parametrize("recipe, dtype", [("tensorwise", "f8e4m3fn"), ("rowwise", "bf16")])
def test_fsdp_gathers_the_layers_weights_as_fp8_where_the_recipe_allows(recipe, dtype):
    """tensorwise: every layer weight is all-gathered as e4m3 (cast at rest, its scale the whole weight's: a
    scalar all-reduce); rowwise, whose backward pass scales the weight along another dimension, gathers bf16.
    The embedding (bf16) and the norm scales ([D], float32) are gathered as without FP8."""
    _, text, cfg = _fp8_program(recipe, "h100")
    D, V = cfg.model.d_model, cfg.model.vocab_size
    gathered = {(a.dtype, a.dims) for instructions in hlo.parse_module(text)[0].values() for i in instructions
                if i.opcode.removesuffix("-start") == "all-gather"
                for a in hlo.arrays(hlo.output_shape(i.opcode, i.shape))}
    embedding = ((V, D), (D, V))  # tiny ties the head to it
    layers = {(kind, dims) for kind, dims in gathered if dims != (D,) and dims not in embedding}
    assert layers and {kind for kind, _ in layers} == {dtype}
    assert {kind for kind, dims in gathered if dims in embedding} == {"bf16"}


def test_fp8_on_an_a100_is_refused_in_meshpars_words():
    with pytest.raises(InputError, match=r"train\.fp8 = 'tensorwise' needs FP8 tensor cores .* A100-SXM4-80GB has"):
        compiled("tiny", "fsdp=8", BF16, "train.fp8=tensorwise", cluster=gpu.Cluster.parse("a100"))


# The README's FP8 table: llama3_8b on 8 H100s, fsdp=8, T = 8192, one sequence per GPU, remat dots (what auto
# picks): recipe → (the program's step time, s; its peak per GPU, GB). Without FP8 (0.98 s, 43.4 GB): test_gpu_fit.
FP8_TABLE = {"tensorwise": (0.800, 43.6), "rowwise": (0.829, 43.8)}


@pytest.mark.parametrize("recipe", FP8_TABLE)
def test_the_fp8_table_holds_at_llama3_8b_on_8_h100s(recipe):
    """The H100 program's step time (its roofline, `gpu_program.read`) and peak are the README's to 2%; every
    projection FLOP runs in an FP8 GEMM (remat dots keeps the projections: one forward each)."""
    report = compiled("llama3_8b", "fsdp=8", "train.global_batch=8", "train.remat=dots", f"train.fp8={recipe}")
    step_s, peak_gb = FP8_TABLE[recipe]
    program = report["gpu"]
    print(f"{recipe}: step {program['step_time']['step_s']:.3f} s, peak "
          f"{report['memory_per_device']['peak_bytes'] / GB:.1f} GB, {program['kernels']}")
    assert abs(program["step_time"]["step_s"] / step_s - 1) < 0.02
    assert abs(report["memory_per_device"]["peak_bytes"] / GB / peak_gb - 1) < 0.02
    model = configs.load("llama3_8b").model
    assert program["flops_by_kernel"]["fp8_gemm"] == 6 * 8192 * _projection_params(model) * model.n_layers


@pytest.mark.parametrize("mesh, overrides, chosen", [
    ("fsdp=8", (), "auto chose cuDNN"),
    ("model=8", (), "auto chose cuDNN"),
    ("stage=2,data=4", ("parallel.microbatches=4",), "auto chose cuDNN"),
    ("sequence=2,fsdp=4", ("parallel.context_attention=ulysses", "parallel.load_balance=false"), "blockwise: context"),
    ("sequence=2,fsdp=4", ("parallel.context_attention=ring",), "blockwise: context"),
    ("fsdp=8", ("train.compute_dtype=float32",), "blockwise: cuDNN cannot run it (it needs bfloat16"),
])
def test_auto_attention_is_cudnn_where_the_readme_says(mesh, overrides, chosen):
    """`auto` takes cuDNN's fused attention (its calls in the program) for bf16 where attention sees the
    whole sequence (data, FSDP, tensor and pipeline parallel), and the blockwise kernel (no cuDNN call) under
    context parallelism and for float32, saying why."""
    report = compiled("tiny", mesh, BF16, "model.n_layers=2", *overrides)
    assert chosen in report["attention"]
    assert (report["gpu"]["kernels"]["attention"] > 0) == chosen.startswith("auto chose")


def test_cudnn_asked_for_under_context_parallelism_is_refused_in_meshpars_words():
    with pytest.raises(InputError, match="'cudnn' cannot run ulysses attention over 'sequence'"):
        compiled("tiny", "sequence=2,fsdp=4", BF16, "parallel.context_attention=ulysses",
                 "parallel.load_balance=false", "train.attention_kernel=cudnn")


def test_a_sliding_window_reaches_cudnns_calls_as_their_window_length():
    """The cuDNN kernel with a window of W keys (GQA, bf16, one H100): the forward and backward fused
    attention calls are causal with `sliding_window_length` W, cuDNN's count of the latest keys a query sees,
    its own included (meshpar's window; the call's arguments against the formula: test_kernels_cudnn.py)."""
    from meshpar.attention import kernels

    W, T = 64, 1024
    device = gpu.devices(gpu.Cluster.parse("h100", devices_per_host=1))[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    q_BTNH = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16, sharding=sharding)
    kv_BTKH = jax.ShapeDtypeStruct((1, T, 2, 128), jnp.bfloat16, sharding=sharding)
    loss = lambda q, k, v: kernels.causal_attention(q, k, v, window=W, kernel="cudnn", platform="gpu").sum(
        dtype=jnp.float32)
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q_BTNH, kv_BTKH, kv_BTKH)
    text = program_store.compile(lowered, [device]).as_text()
    calls = {}
    for instructions in hlo.parse_module(text)[0].values():
        for i in instructions:
            if i.opcode == "custom-call" and gpu_program.CUDNN_ATTENTION in i.attributes:
                target = re.search(r'custom_call_target="([^"]+)"', i.attributes)[1]
                config = gpu_program._backend_config(i)["cudnn_fmha_backend_config"]
                calls[target] = (config["mask_type"], config["sliding_window_length"])
    assert calls == {"__cudnn$fmhaSoftmax": ("CAUSAL", W), "__cudnn$fmhaSoftmaxBackward": ("CAUSAL", W)}


def test_fsdp_gathers_weights_and_reduce_scatters_gradients_in_bf16():
    """tiny (4 layers), fsdp=8, bf16, from the shapes the program's collectives move: every weight is
    all-gathered in bf16, the only float32 gathers being the [D] norm scales (used in float32); every layer
    weight's gradient is reduce-scattered in bf16; in float32 go the norm scales' and the output head's (the
    chunked loss reduces it in float32) gradients; and the embedding's gradient is all-reduced whole, in bf16."""
    _, _, text = _program("fsdp=8")
    model = configs.load("tiny").model
    D, V = model.d_model, model.vocab_size
    moved = {kind: set() for kind in ("all-gather", "reduce-scatter", "all-reduce")}
    for instructions in hlo.parse_module(text)[0].values():
        for instruction in instructions:
            if (kind := instruction.opcode.removesuffix("-start")) in moved:
                moved[kind] |= {(a.dtype, a.dims) for a in hlo.arrays(hlo.output_shape(instruction.opcode,
                                                                                          instruction.shape))}
    assert {dims for dtype, dims in moved["all-gather"] if dtype == "f32"} == {(D,)}
    assert {dtype for dtype, dims in moved["all-gather"] if dims != (D,)} == {"bf16"}
    assert {dims for dtype, dims in moved["reduce-scatter"] if dtype == "f32"} == {(D // 8,), (D // 8, V)}
    assert {dtype for dtype, dims in moved["reduce-scatter"] if dims not in ((D // 8,), (D // 8, V))} == {"bf16"}
    assert {(dtype, dims) for dtype, dims in moved["all-reduce"] if len(dims) > 1} == {("bf16", (V, D))}  # + metrics


def test_fsdp_collectives_run_asynchronously_behind_compute():
    """Of an FSDP step's weight gathers and gradient reduce-scatters, most run as async start/done pairs and
    every one of those has compute scheduled between its start and its done (llama3_8b: tests/test_gpu_fit.py)."""
    report = _program("fsdp=8")[0]
    for kind in ("all-gather", "reduce-scatter"):
        entry = report["collectives"][kind]
        assert entry["async"] == entry["overlapped"] >= 0.7 * entry["count"], (kind, entry)


# Each GPU flag against XLA's default, in the program it is for: a layer stack (tiny with 4 layers, bf16,
# full remat) on fsdp=8 or data=8, or a program of 16 arrays of 4 MB gathered, reduce-scattered or
# all-reduced at once (XLA's default combine thresholds are 30 MiB).
@functools.cache
def _stack(mesh: str) -> tuple:
    cfg, mesh, rules, make_model = configure.configure("tiny", mesh, [BF16, "model.n_layers=4", "train.remat=full"],
                                                       cluster=H100x8)
    sharded = train.sharded_abstract(make_model, train.optimizer(cfg.train), mesh, rules)
    state, tokens = fit.abstract_inputs(sharded, cfg.train)
    return train.make_step(sharded, tokens.sharding, cfg.train).lower(state, tokens), mesh


def _options(changes: dict) -> dict:
    """meshpar's GPU flags as compile options, changed by `changes` (None: left to XLA's default)."""
    return {k: v for k, v in {**gpu.compile_options(), **changes}.items() if v is not None}


def _program(mesh: str, **changes) -> tuple[dict, list[int], str]:
    """The layer stack on `mesh` compiled with meshpar's flags changed (None: left to XLA's default): its
    collectives, kernels, loop trip counts and text."""
    lowered, mesh = _stack(mesh)
    text = program_store.compile(lowered, mesh.devices.flat, _options(changes)).as_text()
    return gpu_program.read(text, fit.program_costs(mesh)), hlo.loop_trip_counts(text), text


def _combined(kind: str, mixed: bool = False, **changes) -> int:
    """How many `kind` collectives 16 arrays of 4 MB results take, with meshpar's flags changed; `mixed`:
    half of them split along their rows, half along their columns."""
    mesh = Mesh(np.array(gpu.devices(H100x8)), ("x",))
    shape, f = {"all-gather": ((1024, 1024), lambda x: x * 2), "all-reduce": ((8, 1024, 1024), lambda x: x.sum(0)),
                "reduce-scatter": ((8, 8192, 1024), lambda x: x.sum(0))}[kind]
    split = [P(None, "x") if mixed and i % 2 else P("x") for i in range(16)]  # the reduce-scatter's result
    arrays = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, split[i] if kind == "all-gather"
                                                                             else P("x"))) for i in range(16)]
    out = [split[i] if kind == "reduce-scatter" else P() for i in range(16)]
    step = jax.jit(lambda *xs: tuple(map(f, xs)), out_shardings=tuple(NamedSharding(mesh, o) for o in out))
    text = program_store.compile(step.lower(*arrays), mesh.devices.flat, _options(changes)).as_text()
    return len(re.findall(rf" {kind}(?:-start)?\(", text))


def _async(report: dict, kind: str) -> int:
    return report["collectives"][kind]["async"]


OFF = "COLLECTIVE_PIPELINING_MODE_OFF"
FLAG_CHECKS = {
    # on by default in this XLA: off, the weight gathers wait where they are issued
    "xla_gpu_enable_latency_hiding_scheduler": lambda: (
        _async(_program("fsdp=8")[0], "all-gather") >= 6
        and _async(_program("fsdp=8", xla_gpu_enable_latency_hiding_scheduler=False)[0], "all-gather") == 0),
    # the next layer's gathers start in this layer's iteration: async across the loop, not only inside it
    "xla_gpu_pipeline_all_gather": lambda: (
        _async(_program("fsdp=8")[0], "all-gather") > _async(_program("fsdp=8", xla_gpu_pipeline_all_gather=None)[0],
                                                              "all-gather")),
    "xla_gpu_pipeline_all_reduce": lambda: (
        _async(_program("data=8")[0], "all-reduce") > _async(_program("data=8", xla_gpu_pipeline_all_reduce=None)[0],
                                                              "all-reduce")),
    # unrolled by two: fewer loop iterations
    "xla_gpu_enable_while_loop_double_buffering": lambda: (
        sum(_program("fsdp=8")[1]) < sum(_program("fsdp=8", xla_gpu_enable_while_loop_double_buffering=None)[1])),
    **{f"xla_gpu_{kind.replace('-', '_')}_combine_threshold_bytes": functools.partial(
        lambda kind: _combined(kind) < _combined(kind, **{f"xla_gpu_{kind.replace('-', '_')}_combine_threshold_bytes":
                                                          None}), kind)
       for kind in ("all-gather", "reduce-scatter", "all-reduce")},
    # XLA's default here too: set, it keeps collectives along different dimensions apart
    **{f"xla_gpu_enable_{kind.replace('-', '_')}_combine_by_dim": functools.partial(
        lambda kind: _combined(kind, mixed=True) == 1 < _combined(
            kind, mixed=True, **{f"xla_gpu_enable_{kind.replace('-', '_')}_combine_by_dim": True}), kind)
       for kind in ("all-gather", "reduce-scatter")},
    # cuBLAS, not Triton, runs every GEMM
    "xla_gpu_enable_triton_gemm": lambda: (
        _program("fsdp=8")[0]["kernels"]["triton_gemm"] == 0 < _program("fsdp=8")[0]["kernels"]["gemm"]
        and _program("fsdp=8", xla_gpu_enable_triton_gemm=None)[0]["kernels"]["gemm"] == 0),
    # a property of the streams XLA creates when it runs the program, not of the program's text
    "xla_gpu_enable_highest_priority_async_stream": lambda: _executable_holds(
        "xla_gpu_enable_highest_priority_async_stream"),
}


def _executable_holds(flag: str) -> bool:
    """For a flag that acts when the program runs: XLA takes it by this name (a name it does not know is refused
    at compile time), and the executable it builds, serialized, holds the flag as meshpar sets it (true), where
    one compiled with XLA's default holds none."""
    mesh = Mesh(np.array(gpu.devices(H100x8)), ("x",))
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    lowered = jax.jit(lambda x: (x @ x.T).sum()).lower(x)
    serialized = lambda **changes: lowered.compile(_options(changes)).runtime_executable().serialize()
    record = flag.encode() + b"\x12\x02\x10"  # the option's name, then its value: a bool (protobuf's wire format)
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"No such compile option: '{flag}s'"):
        lowered.compile(_options({f"{flag}s": True}))
    meshpars, xlas = serialized(), serialized(**{flag: None})
    return meshpars[meshpars.index(record) + len(record)] == 1 and record not in xlas


def test_every_gpu_flag_has_a_check_of_what_it_changes():
    assert set(FLAG_CHECKS) == set(gpu_flags.FLAGS)


@pytest.mark.parametrize("flag", FLAG_CHECKS)
def test_each_gpu_flag_changes_what_it_says(flag):
    assert FLAG_CHECKS[flag]()


def test_the_readme_gpu_commands_run():
    """The README's `launch.compile --target` commands, as written (with this venv's Python)."""
    commands = [c for block in block_commands() for c in block if "--target" in c]
    assert commands
    for command in commands:
        argv = [sys.executable if "python" in a else a for a in shlex.split(command)]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        assert "cuDNN attention" in proc.stdout and "usable on the GPU" in proc.stdout, proc.stdout
