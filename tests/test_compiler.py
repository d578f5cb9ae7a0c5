"""meshpar.compiler on 8 fake CPU devices: programs whose collectives, memory and flops are known."""

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from jax._src.lib import xla_client  # XLA's own HLO parser/printer, to keep hand-written HLO honest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.compiler import collectives, compile_report, flops_per_device, matmul_flops, memory_per_device

BLOCK = 128  # f32 elements per device in the shard_map tests: 512 bytes


@pytest.fixture(scope="module")
def mesh():
    require_devices(8)
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))


@pytest.fixture(scope="module")
def auto_mesh():
    require_devices(8)
    # Auto on purpose: GSPMD must be free to insert the all-reduce of a contracting-dim matmul.
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def shard_map_hlo(mesh, f) -> str:
    """Compiled HLO of `f` applied per device to an f32[BLOCK] block of an 8-way sharded vector."""
    x = jax.device_put(jnp.arange(8 * BLOCK, dtype=jnp.float32), NamedSharding(mesh, P("x")))
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return step.lower(x).compile().as_text()


def xla_printed(hlo_text: str) -> str:
    """Hand-written HLO as XLA's parser reads it and its printer writes it back."""
    return xla_client.hlo.hlo_module_from_text(hlo_text).to_string()


RING = [(i, (i + 1) % 8) for i in range(8)]


def one(kind: str, nbytes: int) -> dict[str, dict[str, int]]:
    return {kind: {"count": 1, "bytes": nbytes}}


@pytest.mark.parametrize(
    ("f", "expected"),
    [
        (lambda a: jax.lax.pcast(jax.lax.psum(a, "x"), "x", to="varying"), one("all-reduce", 512)),
        (lambda a: jax.lax.all_gather(a, "x", tiled=True), one("all-gather", 8 * 512)),
        (lambda a: jax.lax.psum_scatter(a, "x", tiled=True), one("reduce-scatter", 512 // 8)),
        (lambda a: jax.lax.ppermute(a, "x", RING), one("collective-permute", 512)),
        (lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), one("all-to-all", 512)),
    ],
    ids=["psum", "all_gather", "psum_scatter", "ppermute", "all_to_all"],
)
def test_each_collective_counted_with_result_bytes(mesh, f, expected):
    assert collectives(shard_map_hlo(mesh, f)) == expected


def test_all_to_all_tuple_result_with_index_comment(mesh):
    # CPU splits the all-to-all into 8 f32[16] pieces: a tuple shape carrying `/*index=5*/`.
    hlo = shard_map_hlo(mesh, lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True))
    assert "/*index=5*/f32[16]{0}" in hlo
    assert collectives(hlo)["all-to-all"]["bytes"] == BLOCK * 4


def test_scan_multiplies_by_trip_count(mesh):
    def f(a):
        # The psum reads the carry, so XLA cannot hoist it out of the loop.
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "x"), None), a, None, length=5)[0]

    hlo = shard_map_hlo(mesh, f)
    assert '"known_trip_count":{"n":"5"}' in hlo
    assert collectives(hlo) == {"all-reduce": {"count": 5, "bytes": 5 * 512}}


def test_nested_scans_multiply(mesh):
    def inner(c, _):
        return c * 0.5 + jax.lax.psum(c, "x"), None

    def outer(c, _):
        return jax.lax.scan(inner, c, None, length=3)[0], None

    hlo = shard_map_hlo(mesh, lambda a: jax.lax.scan(outer, a, None, length=4)[0])
    assert collectives(hlo) == {"all-reduce": {"count": 12, "bytes": 12 * 512}}


def test_while_without_known_trip_count_counts_body_once(mesh):
    def f(a):
        return jax.lax.while_loop(lambda c: c[0] < 100.0, lambda c: c + jax.lax.psum(c, "x"), a)

    hlo = shard_map_hlo(mesh, f)
    assert '"known_trip_count"' not in hlo
    assert collectives(hlo) == {"all-reduce": {"count": 1, "bytes": 512}}


def test_gspmd_contracting_dim_matmul_all_reduces(auto_mesh):
    m, k, n = 16, 64, 32
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    step = jax.jit(
        lambda a, b: a @ b,
        in_shardings=(NamedSharding(auto_mesh, P(None, "x")), NamedSharding(auto_mesh, P("x", None))),
        out_shardings=NamedSharding(auto_mesh, P()),
    )
    compiled, report = compile_report(step, a, b)
    assert set(report) == {"memory_per_device", "collectives", "flops_per_device", "compile_s"}
    # Each device multiplies its k/8 slice, then the partial products are summed.
    assert report["collectives"] == {"all-reduce": {"count": 1, "bytes": m * n * 4}}
    assert report["memory_per_device"]["arguments_bytes"] == (m * k + k * n) * 4 // 8
    assert report["compile_s"] > 0
    assert report["flops_per_device"] == flops_per_device(compiled) > 0


def test_replicated_computation_has_no_collectives(auto_mesh):
    replicated = NamedSharding(auto_mesh, P())
    step = jax.jit(lambda a: jnp.sin(a) @ a.T, in_shardings=replicated, out_shardings=replicated)
    _, report = compile_report(step, jnp.ones((16, 16)))
    assert report["collectives"] == {}


def test_memory_per_device_of_sharded_argument(mesh):
    x = jax.device_put(jnp.ones((8, 1024), jnp.float32), NamedSharding(mesh, P("x")))
    memory = memory_per_device(jax.jit(lambda x: x * 2).lower(x).compile())
    kinds = ("arguments_bytes", "outputs_bytes", "temp_bytes", "alias_bytes", "peak_bytes")
    assert set(memory) == {*kinds, *(f"host_{kind}" for kind in kinds)}
    assert memory["arguments_bytes"] == 1024 * 4
    assert memory["outputs_bytes"] == 1024 * 4
    assert memory["peak_bytes"] == memory["arguments_bytes"] + memory["temp_bytes"] + memory["outputs_bytes"]
    assert all(memory[f"host_{kind}"] == 0 for kind in kinds)


def test_memory_in_host_memory_is_counted_there(mesh):
    """Arguments and outputs placed in host memory (meshpar.offload) leave the device figures for the host's,
    read from the compiled entry layout (XLA:CPU fills no host fields); a donated one is aliased there."""
    device = NamedSharding(mesh, P("x"))
    host = device.with_memory_kind("pinned_host")
    x, moments = (jax.device_put(jnp.ones((8, 1024), jnp.float32), s) for s in (device, host))
    step = jax.jit(lambda x, m: (x * 2, m + 1), in_shardings=(device, host), out_shardings=(device, host),
                   donate_argnums=1)
    memory = memory_per_device(step.lower(x, moments).compile())
    assert memory["arguments_bytes"] == 1024 * 4
    assert 0 <= memory["outputs_bytes"] - 1024 * 4 <= 16  # and the output tuple's table of buffers
    assert memory["host_arguments_bytes"] == memory["host_outputs_bytes"] == memory["host_alias_bytes"] == 1024 * 4
    assert memory["alias_bytes"] == 0
    assert memory["host_peak_bytes"] == 1024 * 4


def test_peak_counts_a_donated_buffer_once(mesh):
    x = jax.device_put(jnp.ones((8, 1024), jnp.float32), NamedSharding(mesh, P("x")))
    memory = memory_per_device(jax.jit(lambda x: x * 2, donate_argnums=0).lower(x).compile())
    assert memory["alias_bytes"] == 1024 * 4
    assert memory["peak_bytes"] == memory["arguments_bytes"] + memory["temp_bytes"]


def test_flops_of_matmul_is_two_m_n_k():
    m, k, n = 16, 64, 32
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
    assert flops_per_device(compiled) == 2 * m * n * k


def test_matmul_flops_count_a_loop_body_as_often_as_it_runs():
    m, k, layers = 16, 64, 5
    scan = lambda x, ws: jax.lax.scan(lambda x, w: (x @ w, None), x, ws)[0]
    compiled = jax.jit(scan).lower(jnp.ones((m, k)), jnp.ones((layers, k, k))).compile()
    assert matmul_flops(compiled.as_text()) == layers * 2 * m * k * k
    assert flops_per_device(compiled) == pytest.approx(2 * m * k * k, abs=8)  # cost_analysis: the body once


def test_flops_of_row_sharded_matmul_are_per_device(mesh):
    m, k, n = 16, 64, 32
    a = jax.device_put(jnp.ones((m, k)), NamedSharding(mesh, P("x", None)))
    b = jax.device_put(jnp.ones((k, n)), NamedSharding(mesh, P()))
    compiled = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
    assert flops_per_device(compiled) == 2 * (m // 8) * n * k
    assert collectives(compiled.as_text()) == {}


ASYNC_HLO = """
HloModule async_forms, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_all_to_all (y: f32[128]) -> f32[128] {
  %y = f32[128]{0} parameter(0)
  %n = f32[128]{0} negate(%y)
  ROOT %a2a = f32[128]{0} all-to-all(%n), channel_id=8, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

ENTRY %main (p: f32[128], q: bf16[64]) -> f32[128] {
  %p = f32[128]{0} parameter(0)
  %q = bf16[64]{0} parameter(1)
  %ars = f32[128]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard = f32[128]{0} all-reduce-done(%ars)
  %ars2 = (f32[128]{0}, bf16[64]{0}) all-reduce-start(%p, %q), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard2 = (f32[128]{0}, bf16[64]{0}) all-reduce-done(%ars2)
  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%p), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[1024]{0} all-gather-done(%ags)
  %ags2 = ((f32[128]{0}, bf16[64]{0}), (f32[1024]{0}, bf16[512]{0})) all-gather-start(%p, %q), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd2 = (f32[1024]{0}, bf16[512]{0}) all-gather-done(%ags2)
  %cps = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %cpd = f32[128]{0} collective-permute-done(%cps)
  %rss = ((f32[128]{0}), f32[16]{0}, s32[]) reduce-scatter-start(%p), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %rsd = f32[16]{0} reduce-scatter-done(%rss)
  %a2as = ((f32[128]{0}), f32[128]{0}, s32[]) all-to-all-start(%p), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %a2ad = f32[128]{0} all-to-all-done(%a2as)
  %wrapped_start = ((f32[128]{0}), f32[128]{0}, s32[]) async-start(%a2ad), calls=%wrapped_all_to_all
  ROOT %wrapped_done = f32[128]{0} async-done(%wrapped_start), calls=%wrapped_all_to_all
}
"""


def test_async_forms_count_start_once_with_output_bytes():
    printed = xla_printed(ASYNC_HLO)
    # The printer folds a one-instruction async computation into `X-start`/`X-done`; a bigger one
    # stays `async-start(...), calls=%comp` and the `async-done` loses its `calls=`.
    assert "reduce-scatter-start(" in printed and "async-start(" in printed
    assert "calls=" not in printed.split("%wrapped_done")[1]
    expected = {
        "all-reduce": {"count": 2, "bytes": 512 + (512 + 128)},
        "all-gather": {"count": 2, "bytes": 4096 + (4096 + 1024)},
        "collective-permute": {"count": 1, "bytes": 512},
        "reduce-scatter": {"count": 1, "bytes": 64},
        "all-to-all": {"count": 2, "bytes": 512 + 512},
    }
    assert collectives(printed) == expected
    # An `async-done` that names its computation (as written above) must not count it twice.
    assert collectives(ASYNC_HLO) == expected


CONTROL_FLOW_HLO = """
HloModule control_flow, num_partitions=8

%or (a: pred[], b: pred[]) -> pred[] {
  %a = pred[] parameter(0)
  %b = pred[] parameter(1)
  ROOT %o = pred[] or(%a, %b)
}

%reduce_pair (x: (bf16[4,8], pred[16])) -> (bf16[4,8], pred[16]) {
  %x = (bf16[4,8]{1,0}, pred[16]{0}) parameter(0)
  %x0 = bf16[4,8]{1,0} get-tuple-element(%x), index=0
  %x1 = pred[16]{0} get-tuple-element(%x), index=1
  ROOT %ar = (bf16[4,8]{1,0}, pred[16]{0}) all-reduce(%x0, %x1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%or
}

%body (b: (bf16[4,8], pred[16])) -> (bf16[4,8], pred[16]) {
  %b = (bf16[4,8]{1,0}, pred[16]{0}) parameter(0)
  ROOT %c = (bf16[4,8]{1,0}, pred[16]{0}) call(%b), to_apply=%reduce_pair
}

%cond (c: (bf16[4,8], pred[16])) -> pred[] {
  %c = (bf16[4,8]{1,0}, pred[16]{0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

%left (l: s8[32]) -> s8[32] {
  %l = s8[32]{0} parameter(0)
  ROOT %cp = s8[32]{0} collective-permute(%l), channel_id=2, source_target_pairs={{0,1},{1,0}}
}

%right (r: s8[32]) -> s8[32] {
  %r = s8[32]{0} parameter(0)
  %ag = s8[256]{0} all-gather(%r), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %sl = s8[32]{0} slice(%ag), slice={[0:32]}
}

ENTRY %main (p: (bf16[4,8], pred[16]), i: s32[], s: s8[32]) -> s8[32] {
  %p = (bf16[4,8]{1,0}, pred[16]{0}) parameter(0)
  %known = (bf16[4,8]{1,0}, pred[16]{0}) while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %unknown = (bf16[4,8]{1,0}, pred[16]{0}) while(%known), condition=%cond, body=%body
  %i = s32[] parameter(1)
  %s = s8[32]{0} parameter(2)
  ROOT %branch = s8[32]{0} conditional(%i, %s, %s), branch_computations={%left, %right}
}
"""


def test_control_flow_multiplicity_and_element_sizes():
    # all-reduce of (bf16[4,8], pred[16]) = 64 + 16 bytes: 3 times in the known loop, once in the
    # unknown one; each conditional branch counts once.
    assert collectives(xla_printed(CONTROL_FLOW_HLO)) == {
        "all-reduce": {"count": 4, "bytes": 4 * 80},
        "collective-permute": {"count": 1, "bytes": 32},
        "all-gather": {"count": 1, "bytes": 256},
    }


# A loop whose trip count XLA dropped (as XLA:GPU's peeling leaves them): its induction variable starts at a
# constant 1 (through a copy) and the condition's fused compare stops it below 4: the body runs 3 times.
PEELED_LOOP_HLO = """
HloModule peeled, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%below (i: s32[]) -> pred[] {
  %i = s32[] parameter(0)
  %bound = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %f = pred[] fusion(%ci), kind=kLoop, calls=%below
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %bi = s32[] get-tuple-element(%b), index=0
  %bx = f32[8]{0} get-tuple-element(%b), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%bi, %one)
  %sum = f32[8]{0} all-reduce(%bx), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %sum)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %start = s32[] constant(1)
  %copied = s32[] copy(%start)
  %init = (s32[], f32[8]{0}) tuple(%copied, %x)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_without_xlas_trip_count_is_read_from_its_bounds():
    assert collectives(xla_printed(PEELED_LOOP_HLO)) == {"all-reduce": {"count": 3, "bytes": 3 * 32}}
    no_induction = PEELED_LOOP_HLO.replace(', backend_config={"known_induction_variable":{"tuple_index":"0"}}', "")
    assert collectives(xla_printed(no_induction)) == {"all-reduce": {"count": 1, "bytes": 32}}  # a lower bound


ENTRY_WITH = "HloModule m\n\nENTRY %main () -> f32[] {{\n  {}\n}}\n"  # a module around one line


@pytest.mark.parametrize(
    ("hlo_text", "message"),
    [
        ("not an HLO module", "HloModule"),
        (ENTRY_WITH.format("%x = f32[ parameter(0)"), r"%x = f32\[ parameter"),
        (ENTRY_WITH.format("%x = q32[] parameter(0)"), "q32"),
        (ENTRY_WITH.format("%x = f32[] (0)"), "opcode"),
        (ENTRY_WITH.format("this is not an instruction"), "this is not"),
        (ENTRY_WITH.format("ROOT %x = f32[] call(), to_apply=%nowhere"), "nowhere"),
        ("HloModule m\n\nENTRY %main () -> f32[] {\n  ROOT %x = f32[] constant(0)\n", "missing"),
        ("HloModule m\n\n%f () -> f32[] {\n  ROOT %x = f32[] constant(0)\n}\n", "ENTRY"),
        ("HloModule m\n\ngarbage here\n", "garbage here"),
    ],
)
def test_malformed_hlo_raises(hlo_text, message):
    with pytest.raises(ValueError, match=message):
        collectives(hlo_text)
