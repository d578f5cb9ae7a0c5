"""`meshpar.compiler.gpu_program` on hand-written modules in XLA:GPU's form: device groups in XLA's three
notations, the ring costs, and a schedule's kernels, FLOPs, async collectives and exposed time, each
against a figure worked out here. (The compiled H100 programs: tests/test_gpu_compile.py.)"""

import pytest
from jax._src.lib import xla_client

from meshpar import hardware
from meshpar.compiler import gpu_program

H100 = hardware.PRESETS["h100"]
ONE_HOST = gpu_program.Costs(H100, hosts=(0,) * 8, efficiency=0.5)


@pytest.mark.parametrize("attributes, groups", [
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['data'=2,'fsdp'=4] {'data'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups={{0,2},{1,3}}", [[0, 2], [1, 3]]),
    ("source_target_pairs={{0,1},{1,0}}", [[0, 1], [1, 0]]),
    ("dimensions={0}", []),
])
def test_device_groups_in_each_notation(attributes, groups):
    assert gpu_program._groups(attributes) == groups


def test_ring_costs_inside_a_host_and_across_hosts():
    link, net = H100.link_bw * H100.net_efficiency, H100.net_bw * H100.net_efficiency
    assert ONE_HOST.collective_s("all-gather", 8e9, []) == pytest.approx(8e9 * 7 / 8 / link + 7 * H100.link_latency)
    assert ONE_HOST.collective_s("reduce-scatter", 1e9, []) == pytest.approx(7e9 / link + 7 * H100.link_latency)
    assert ONE_HOST.collective_s("all-reduce", 8e9, [[0, 1]]) == pytest.approx(8e9 / link + 2 * H100.link_latency)
    two_hosts = gpu_program.Costs(H100, hosts=(0, 0, 0, 0, 1, 1, 1, 1), efficiency=0.5)
    assert two_hosts.collective_s("all-gather", 8e9, [[0, 4]]) == pytest.approx(4e9 / net + H100.net_latency)
    assert two_hosts.collective_s("all-gather", 8e9, [[0, 1]]) == pytest.approx(4e9 / link + H100.link_latency)
    assert ONE_HOST.collective_s("all-gather", 8e9, [[3]]) == 0.0


# A weight all-gather started, a cuBLAS GEMM [1024, 4096] x [4096, 4096] in bf16 while it flies, then its
# done; a loop of 4 iterations around a Triton GEMM fusion and a synchronous all-reduce; an elementwise
# fusion; a cuDNN causal attention call; a cuBLASLt FP8 GEMM [512, 1024] x [1024, 256].
SCHEDULE = """
HloModule schedule, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%triton (p0: bf16[256,512], p1: bf16[512,128]) -> bf16[256,128] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = bf16[512,128]{1,0} parameter(1)
  ROOT %d = bf16[256,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%scale (q: f32[1024]) -> f32[1024] {
  %q = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%q, %q)
}

%cond (c: (s32[], f32[1024], bf16[256,512], bf16[512,128])) -> pred[] {
  %c = (s32[], f32[1024]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[1024], bf16[256,512], bf16[512,128])) -> (s32[], f32[1024], bf16[256,512], bf16[512,128]) {
  %b = (s32[], f32[1024]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %v = f32[1024]{0} get-tuple-element(%b), index=1
  %x = bf16[256,512]{1,0} get-tuple-element(%b), index=2
  %w = bf16[512,128]{1,0} get-tuple-element(%b), index=3
  %g = bf16[256,128]{1,0} fusion(%x, %w), kind=kCustom, calls=%triton
  %r = f32[1024]{0} all-reduce(%v), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}) tuple(%j, %r, %x, %w)
}

ENTRY %main (x: bf16[1024,4096], w: bf16[512,4096], v: f32[1024], a: bf16[256,512], c: bf16[512,128], q: bf16[1,2048,8,128], a8: f8e4m3fn[512,1024], b8: f8e4m3fn[1024,256], s: f32[]) -> (bf16[1024,4096], f32[1024]) {
  %x = bf16[1024,4096]{1,0} parameter(0)
  %w = bf16[512,4096]{1,0} parameter(1)
  %v = f32[1024]{0} parameter(2)
  %a = bf16[256,512]{1,0} parameter(3)
  %c = bf16[512,128]{1,0} parameter(4)
  %q = bf16[1,2048,8,128]{3,2,1,0} parameter(5)
  %a8 = f8e4m3fn[512,1024]{1,0} parameter(6)
  %b8 = f8e4m3fn[1024,256]{1,0} parameter(7)
  %s = f32[] parameter(8)
  %ags = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) all-gather-start(%w), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %gemm = (bf16[1024,4096]{1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %agd = bf16[4096,4096]{1,0} all-gather-done(%ags)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}) tuple(%zero, %v, %a, %c)
  %loop = (s32[], f32[1024]{0}, bf16[256,512]{1,0}, bf16[512,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %lv = f32[1024]{0} get-tuple-element(%loop), index=1
  %sq = f32[1024]{0} fusion(%lv), kind=kLoop, calls=%scale
  %att = (bf16[1,8,2048,128]{3,2,1,0}, f32[1,8,2048]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["1","8","2048","2048"]},"mask_type":"CAUSAL"}}
  %f8 = (bf16[512,256]{1,0}, s8[1048576]{0}) custom-call(%a8, %b8, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %out = bf16[1024,4096]{1,0} get-tuple-element(%gemm), index=0
  ROOT %res = (bf16[1024,4096]{1,0}, f32[1024]{0}) tuple(%out, %sq)
}
"""


def test_a_schedule_read_kernel_by_kernel():
    text = xla_client.hlo.hlo_module_from_text(SCHEDULE).to_string()
    program = gpu_program.read(text, ONE_HOST)
    gemm, triton, attention = 2 * 1024 * 4096 * 4096, 4 * 2 * 256 * 128 * 512, 2 * 2 * 8 * 2048 * 2048 * 128 * 0.5
    fp8 = 2 * 512 * 256 * 1024
    # unfused here (XLA:GPU fuses them): the loop counter's add, 4 times, and the condition's compare, 5
    assert program["kernels"] == {"attention": 1, "gemm": 1, "fp8_gemm": 1, "triton_gemm": 4, "fusion": 1, "memory": 9,
                                  "host_copy": 0}
    assert program["flops_per_device"] == gemm + triton + attention + fp8
    assert program["flops_by_kernel"] == {"gemm": gemm, "triton_gemm": triton, "attention": attention, "fp8_gemm": fp8}
    gathered = program["collectives"]["all-gather"]
    assert gathered == {"count": 1, "bytes": 4096 * 4096 * 2, "bytes_by_dtype": {"bf16": 4096 * 4096 * 2},
                        "async": 1, "overlapped": 1}
    reduced = program["collectives"]["all-reduce"]
    assert (reduced["count"], reduced["async"], reduced["overlapped"]) == (4, 0, 0)
    peak = H100.flops * 0.5
    step = program["step_time"]
    assert step["matmul_s"] == pytest.approx((gemm + triton) / peak + fp8 / (H100.fp8_flops * 0.5))
    assert step["attention_s"] == pytest.approx(attention / peak)
    # the elementwise fusion's input and output; the counter's adds (3 s32) and compares (2 s32, a pred)
    assert step["memory_s"] == pytest.approx((2 * 1024 * 4 + 4 * 12 + 5 * 9) / H100.hbm_bw)
    gather_s = ONE_HOST.collective_s("all-gather", 4096 * 4096 * 2, [list(range(8))])
    reduce_s = ONE_HOST.collective_s("all-reduce", 1024 * 4, [list(range(8))])
    assert step["exposed_s"] == pytest.approx(max(0.0, gather_s - gemm / peak) + 4 * reduce_s)
    assert step["collective_s"] == pytest.approx(gather_s + 4 * reduce_s)
    assert step["step_s"] == pytest.approx(step["matmul_s"] + step["attention_s"] + step["memory_s"]
                                           + step["exposed_s"])


# A causal cuDNN attention call over T = 2048 with a sliding window of 512 keys, forward and backward, in
# jax's BTNH layout (B = 1, 8 heads, head dim 128); both calls' backend configs name the window.
WINDOW_CONFIG = ('{"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["1","8","2048","2048"]},'
                 '"mask_type":"CAUSAL","sliding_window_length":512}}')
WINDOWED = """
HloModule windowed, is_scheduled=true

ENTRY %main (q: bf16[1,2048,8,128], do: bf16[1,2048,8,128]) -> (bf16[1,2048,8,128], bf16[1,2048,8,128], bf16[1,2048,8,128]) {
  %q = bf16[1,2048,8,128]{3,2,1,0} parameter(0)
  %do = bf16[1,2048,8,128]{3,2,1,0} parameter(1)
  %fwd = (bf16[1,2048,8,128]{3,2,1,0}, f32[1,8,2048]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config=CONFIG
  %out = bf16[1,2048,8,128]{3,2,1,0} get-tuple-element(%fwd), index=0
  %lse = f32[1,8,2048]{2,1,0} get-tuple-element(%fwd), index=1
  %bwd = (bf16[1,2048,8,128]{3,2,1,0}, bf16[1,2048,8,128]{3,2,1,0}, bf16[1,2048,8,128]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q, %lse, %out, %do), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config=CONFIG
  %dq = bf16[1,2048,8,128]{3,2,1,0} get-tuple-element(%bwd), index=0
  %dk = bf16[1,2048,8,128]{3,2,1,0} get-tuple-element(%bwd), index=1
  %dv = bf16[1,2048,8,128]{3,2,1,0} get-tuple-element(%bwd), index=2
  ROOT %grads = (bf16[1,2048,8,128]{3,2,1,0}, bf16[1,2048,8,128]{3,2,1,0}, bf16[1,2048,8,128]{3,2,1,0}) tuple(%dq, %dk, %dv)
}
""".replace("CONFIG", WINDOW_CONFIG)


def test_windowed_cudnn_attention_counts_the_window_s_pairs_not_half_the_square():
    """Query t sees its min(t + 1, 512) latest keys: 2048·512 − 512·511/2 pairs a head, 44% of the causal
    half square the call would otherwise count."""
    program = gpu_program.read(xla_client.hlo.hlo_module_from_text(WINDOWED).to_string(), ONE_HOST)
    pairs = sum(min(t + 1, 512) for t in range(2048))
    forward, backward = (2 * matmuls * 8 * pairs * 128 for matmuls in (2, 5))
    assert program["kernels"]["attention"] == 2
    assert program["flops_per_device"] == forward + backward
    assert program["step_time"]["attention_s"] == pytest.approx((forward + backward) / (H100.flops * 0.5))
