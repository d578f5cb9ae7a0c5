"""What of the GPU path can be proven on CPU: the XLA flags exist in this jaxlib under the names it knows and
yield to the user's,
and a bf16 run gathers its FSDP weights in bf16 (the HLO right after SPMD partitioning)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax

from meshpar import gpu_flags

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, xla_flags: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`code` run with these XLA_FLAGS, compiling every program (a dump needs a compile: the persistent
    cache's key leaves the dump flags out)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "JAX_ENABLE_COMPILATION_CACHE": "false"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)


def test_every_flag_is_known_to_this_jaxlib(tmp_path):
    """XLA parses XLA_FLAGS on every backend and aborts on an unknown flag (checked with a made-up one)."""
    code = "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    assert run_python(code, gpu_flags.merged(""), tmp_path).stdout.strip() == "3.0"
    assert "Unknown flag" in run_python(code, "--xla_gpu_not_a_flag=true", tmp_path).stderr


def test_the_users_flags_win():
    mine = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"
    flags = gpu_flags.merged(mine).split()
    assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
    assert "--xla_dump_to=/tmp/x" in flags
    assert len(flags) == len(gpu_flags.FLAGS) + 1


def test_flag_names_and_values_follow_the_jaxlib():
    """jaxlib 0.10 names the collective pipeliner's switches as booleans; 0.11 and later as enums of other
    names (whose XLA_FLAGS spelling is short, `on`); a compile takes the enum's full name."""
    old, new = gpu_flags.for_this_jaxlib((0, 10, 2)), gpu_flags.for_this_jaxlib((0, 12, 0))
    assert old["xla_gpu_enable_pipelined_all_gather"] is True and "xla_gpu_pipeline_all_gather" not in old
    assert new["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"
    assert "xla_gpu_enable_pipelined_all_gather" not in new and len(old) == len(new) == len(gpu_flags.FLAGS)
    if jax.__version_info__[:2] >= (0, 11):
        assert "--xla_gpu_pipeline_all_gather=on" in gpu_flags.merged("").split()


def test_compile_options_leave_the_users_flags_to_xla_flags():
    options = gpu_flags.compile_options("--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x")
    assert "xla_gpu_enable_triton_gemm" not in options and len(options) == len(gpu_flags.FLAGS) - 1


def test_not_applied_without_gpus(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert not gpu_flags.apply()  # no CUDA plugin, or JAX_PLATFORMS=cpu (conftest)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_collectives_move_the_compute_dtype(tmp_path):
    """tiny, fsdp=8, bf16: the all-gathers the SPMD partitioner makes carry bf16 weights (only the norm
    scales, which the model uses in float32, are gathered in float32), and the weight gradients are
    reduced over `fsdp` in bf16, the dtype the weight-gradient matmuls emit; in float32 for a float32 run.
    (XLA:CPU then widens bf16 collectives to float32, as it has none; a GPU keeps them.)"""
    code = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import configs
from meshpar import config, mesh, rules, train
from meshpar.compiler import fit
for dtype in ("float32", "bfloat16"):
    cfg = config.apply(configs.load("tiny"), [f"train.compute_dtype={dtype}", "model.n_layers=1"])
    m, r = mesh.build(mesh.parse("fsdp=8")), rules.make(cfg.parallel)
    sharded = train.sharded_abstract(cfg.model_factory(), train.optimizer(cfg.train), m, r)
    state, tokens = fit.abstract_inputs(sharded, cfg.train)
    train.make_step(sharded, tokens.sharding, cfg.train).lower(state, tokens).compile()
"""
    # the tests' XLA_FLAGS (XLA:CPU compiling for speed: the partitioner's output is the same) and the dump's
    dump = f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=spmd-partitioning"
    result = run_python(code, f"{os.environ.get('XLA_FLAGS', '')} {dump}", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    dumps = sorted(tmp_path.glob("*jit_step*after_spmd-partitioning*.txt"))
    assert len(dumps) == 2, [path.name for path in tmp_path.iterdir()]  # the float32 step's, then the bf16 one's
    for hlo, dtype in zip(dumps, ("f32", "bf16")):
        text = hlo.read_text()
        gathers = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather\(", text)
        assert sum(d == dtype for d, _ in gathers) >= 7  # per layer: q, k, v, o, gate, up, down
        assert all(shape in ("128", "1,128") for d, shape in gathers if d != dtype)  # [D] norm scales, float32
        reductions = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (?:all-reduce|reduce-scatter)\(.*op_name=\"([^\"]*)",
                                text)
        weight_grads = {d for d, _, name in reductions if "transpose(jvp())" in name and "dot_general" in name}
        assert weight_grads == {dtype}, (hlo.name, reductions)


def test_the_readmes_target_table_is_the_packaged_targets():
    """Each row of the README's `--target` table: the device kind, SMs, memory CUDA reports (GiB), HBM bandwidth
    (TB/s) and compute capability of `meshpar.gpu_target`'s preset."""
    from meshpar import gpu_target

    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| (\d+) \| ([\d.]+) GiB \| ([\d.]+) TB/s \| ([\d.]+) \|", readme, re.M)
    assert {name for name, *_ in rows} == set(gpu_target.TARGETS)
    for name, kind, sms, gib, tbs, capability in rows:
        target = gpu_target.TARGETS[name]
        assert (kind.strip(), int(sms), capability) == (target.description, target.core_count,
                                                        "{}.{}".format(*target.compute_capability))
        assert float(gib) == round(target.device_memory_size / 2**30, 1)
        assert abs(float(tbs) - target.memory_bandwidth / 1e12) < 0.006
