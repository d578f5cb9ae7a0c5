"""FP8 matmuls (meshpar.fp8, `train.fp8`) on CPU: one matmul's forward and backward against a reference
written here (ml_dtypes' casts, explicit power-of-two scales) and within the FP8 rounding bound of the exact
product, also for all-zero and tiny tensors; the scales bit for bit; rowwise scales keep rows that one scale
per tensor flushes; a quantised tensor quantises to itself (what the FP8 all-gather relies on); a layer's
FP8 backward split as zero-bubble runs it; every parallel layout with FP8 against one device with FP8
(float32 master weights, 1e-5), a microbatched one against one device running the same microbatches; a
resume onto another mesh; the planner's FP8 figures in the README; the refusals.
What the GPU program runs: test_gpu_compile.py; the 300-step run against bf16: test_fp8_training.py."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import configs
import layouts
from conftest import require_devices
from layouts import MODEL, TRAIN, max_relative_error, shared_run
from meshpar import context, fp8, mesh as mesh_lib, plan, rules as rules_lib, train
from meshpar.errors import InputError
from meshpar.pipeline.split_backward import Split
from meshpar.rules import ParallelConfig
from models.transformer import Block, Transformer
from test_checkpoint import train_to

# FP8 rounding: relative half-ulp u of a normal value, and half the spacing of the subnormals (× the scale)
ROUNDING = {"e4m3": (2.0**-4, 2.0**-10), "e5m2": (2.0**-3, 2.0**-17)}
FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def reference_quantize(t: np.ndarray, fmt: str, over: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """t cast to the FP8 format by ml_dtypes after dividing by its power-of-two scale over the axes `over`, at
    least 2⁻⁶³ (two scales' product stays a float32 normal), 1 for an all-zero t: (the FP8 values as float64,
    the scale)."""
    top = float(ml_dtypes.finfo(FORMATS[fmt]).max)
    amax = np.abs(t).max(axis=over, keepdims=True)
    with np.errstate(divide="ignore"):  # log2(0) = -inf where amax is 0: scale 1 there
        s = np.where(amax > 0, np.maximum(2.0 ** np.ceil(np.log2(amax / top)), 2.0**-63), 1.0)
    return np.clip(t / s, -top, top).astype(FORMATS[fmt]).astype(np.float64), s


def reference(x_MK, w_KN, g_MN, rowwise: bool):
    """y = x·w, dx, dw of one FP8 matmul written out: each matmul's operands quantised along what it
    contracts (rowwise) or whole, the gradient in e5m2."""
    def q(t, fmt, over):
        values, s = reference_quantize(t, fmt, over if rowwise else (0, 1))
        return values * s
    y = q(x_MK, "e4m3", (1,)) @ q(w_KN, "e4m3", (0,))
    dx = q(g_MN, "e5m2", (1,)) @ q(w_KN, "e4m3", (1,)).T
    dw = q(x_MK, "e4m3", (0,)).T @ q(g_MN, "e5m2", (0,))
    return y, dx, dw


def rounding_bound(t: np.ndarray, fmt: str, rowwise_over: tuple[int, ...] | None) -> np.ndarray:
    """The largest |t − its FP8 value| the format allows, element by element (its scale taken as fp8.scale
    takes it)."""
    u, subnormal = ROUNDING[fmt]
    _, s = reference_quantize(t, fmt, rowwise_over if rowwise_over is not None else (0, 1))
    return np.maximum(u * np.abs(t), subnormal * s)


def product_bound(a, ea, b, eb):
    """|(a + δa)(b + δb) − ab| ≤ |δa||b| + |a||δb| + |δa||δb|, summed over the contraction."""
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb


def operands(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(24, 48)), rng.normal(size=(48, 40)) * 0.05, rng.normal(size=(24, 40)) * 1e-3)


def fp8_vjp(x_MK, w_KN, g_MN, rowwise: bool):
    """meshpar's y, dx, dw in float32 for the cotangent g."""
    f = lambda x, w: fp8.matmul(x, w, recipe=fp8.Recipe(rowwise=rowwise))
    y, vjp = jax.vjp(f, *(jnp.asarray(a, jnp.float32) for a in (x_MK, w_KN)))
    return (np.asarray(y, np.float64), *(np.asarray(d, np.float64) for d in vjp(jnp.asarray(g_MN, jnp.float32))))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_fp8_matmul_equals_the_reference_and_stays_within_the_rounding_bound(recipe):
    """Forward and backward equal the ml_dtypes reference (float32 accumulation against float64: 1e-6 of the
    largest value); each is within the FP8 rounding bound of the exact product (float64) element by element."""
    rowwise = recipe == "rowwise"
    x_MK, w_KN, g_MN = (a.astype(np.float32).astype(np.float64) for a in operands())
    ours = fp8_vjp(x_MK, w_KN, g_MN, rowwise)
    for got, want in zip(ours, reference(x_MK, w_KN, g_MN, rowwise)):
        assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
    over = lambda axes: axes if rowwise else None
    y, dx, dw = ours
    bounds = [
        (y, x_MK @ w_KN, product_bound(x_MK, rounding_bound(x_MK, "e4m3", over((1,))),
                                       w_KN, rounding_bound(w_KN, "e4m3", over((0,))))),
        (dx, g_MN @ w_KN.T, product_bound(g_MN, rounding_bound(g_MN, "e5m2", over((1,))),
                                          w_KN.T, rounding_bound(w_KN, "e4m3", over((1,))).T)),
        (dw, x_MK.T @ g_MN, product_bound(x_MK.T, rounding_bound(x_MK, "e4m3", over((0,))).T,
                                          g_MN, rounding_bound(g_MN, "e5m2", over((0,))))),
    ]
    for got, exact, bound in bounds:
        slack = 1e-6 * np.max(np.abs(exact))  # float32 accumulation
        assert np.all(np.abs(got - exact) <= bound + slack)
        assert np.max(np.abs(got - exact)) > 1e-4 * np.max(np.abs(exact))  # FP8, not float32 in disguise


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize(("x_factor", "g_factor"), [(0.0, 1.0), (2.0**-120, 1.0), (2.0**-60, 1.0), (1.0, 2.0**-120),
                                                     (1.0, 2.0**-60)],
                         ids=["zero x", "tiny x", "small x", "tiny gradient", "small gradient"])
def test_a_zero_or_tiny_tensor_quantises_to_finite_values_equal_to_the_reference(recipe, x_factor, g_factor):
    """An all-zero x; an x or an output gradient of amax about 2⁻¹¹⁸, whose amax / the format's largest value
    is below float32's normals (a power-of-two scale there would flush to 0 and quantise 0/0), or 2⁻⁵⁸, whose
    own scale is below the floor of 2⁻⁶³: forward and backward are finite and equal the reference's, whose
    scales are floored at 2⁻⁶³ too (1e-6 of the largest value, or float32's smallest normal: XLA:CPU flushes
    subnormals to 0, so the operands' magnitudes are 0 (a third: 0/0 where a scale is 0) or 0.5 to 4 before
    the factor, and a sum that cancels below the normals is 0)."""
    rng = np.random.default_rng(2)
    draw = lambda *shape: rng.uniform(0.5, 4.0, shape) * rng.choice([-1.0, 0.0, 1.0], shape)
    x_MK, w_KN, g_MN = draw(24, 48) * x_factor, draw(48, 40), draw(24, 40) * g_factor
    ours = fp8_vjp(x_MK, w_KN, g_MN, recipe == "rowwise")
    for got, want in zip(ours, reference(x_MK, w_KN, g_MN, recipe == "rowwise")):
        assert np.all(np.isfinite(got))
        assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want)) + np.finfo(np.float32).tiny


def test_rowwise_scales_keep_rows_that_one_scale_per_tensor_flushes():
    """Half of x's rows 2⁻²⁰ of the others: one scale for the tensor leaves them below e4m3's subnormals (their
    products all but lost), a scale per row keeps them to FP8's rounding."""
    x_MK, w_KN, _ = (a.astype(np.float32) for a in operands())
    x_MK[::2] *= 2.0**-20
    exact = x_MK[::2].astype(np.float64) @ w_KN
    error = {recipe: np.max(np.abs(np.asarray(fp8.matmul(jnp.asarray(x_MK), jnp.asarray(w_KN),
                                                         recipe=fp8.Recipe(recipe == "rowwise")))[::2] - exact))
             / np.max(np.abs(exact)) for recipe in ("tensorwise", "rowwise")}
    assert error["rowwise"] < 0.1 < 0.9 < error["tensorwise"], error


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_scale_is_the_smallest_power_of_two_that_fits_bit_for_bit(fmt):
    """Rows whose amax is the format's largest value times 2⁻¹²⁶ … 2⁹⁹, the next float32 above each, and random
    ones from 2⁻¹²⁶ to 2¹⁰⁰: every row's scale is the reference's bit for bit (float64 log2 of exact powers), at
    least 2⁻⁶³. XLA:CPU's exp2 and log2 are a few ulps off: scales computed through them are not powers of two,
    and two programs that fuse them otherwise (a pipeline's stages with tensor parallelism) round otherwise."""
    top = np.float32(ml_dtypes.finfo(FORMATS[fmt]).max)
    edges_R = top * np.exp2(np.arange(-126, 100, 3)).astype(np.float32)
    random_R = np.exp2(np.random.default_rng(3).uniform(-126, 100, 64)).astype(np.float32)
    amax_R = np.concatenate([edges_R, np.nextafter(edges_R, np.float32(np.inf)), random_R])
    t_RC = amax_R[:, None] * np.array([1.0, -0.5, 0.25], np.float32)
    got = np.asarray(fp8.scale(jnp.asarray(t_RC), FORMATS[fmt], (1,)), np.float64)
    np.testing.assert_array_equal(got, reference_quantize(t_RC.astype(np.float64), fmt, (1,))[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_quantised_tensor_quantises_to_itself(dtype):
    """Dequantised in the compute dtype (exact: the scale is a power of two), a tensor's FP8 values come back
    bit for bit when it is quantised again: what lets `sharding.gathered` gather a weight as FP8 and the
    matmul cast it again."""
    w = jnp.asarray(operands()[1], dtype)
    q, s = fp8.quantize(w, fp8.E4M3, (0, 1))
    again, s_again = fp8.quantize(fp8.dequantize(q, s, dtype), fp8.E4M3, (0, 1))
    assert np.array_equal(np.asarray(fp8.dequantize(again, s_again, jnp.float32)),
                          np.asarray(fp8.dequantize(q, s, jnp.float32)))


def test_a_mixtures_grouped_matmul_is_fp8_forward_and_backward():
    """`fp8.grouped` around `ragged_dot`: forward and backward equal the reference's tensorwise ones expert by
    expert (the rows of each group against its expert's weight)."""
    rng = np.random.default_rng(1)
    x_ID, w_EDF, g_IF = rng.normal(size=(12, 16)), rng.normal(size=(3, 16, 8)) * 0.1, rng.normal(size=(12, 8))
    sizes_E = np.array([5, 0, 7], np.int32)
    f = lambda x, w: fp8.grouped(jax.lax.ragged_dot, x, w, jnp.asarray(sizes_E), recipe=fp8.Recipe(False))
    y, vjp = jax.vjp(f, jnp.asarray(x_ID, jnp.float32), jnp.asarray(w_EDF, jnp.float32))
    dx, dw = vjp(jnp.asarray(g_IF, jnp.float32))
    qx, qw, qg = (v * s for v, s in (reference_quantize(x_ID, "e4m3", (0, 1)),
                                     reference_quantize(w_EDF, "e4m3", (0, 1, 2)),
                                     reference_quantize(g_IF, "e5m2", (0, 1))))
    group_I = np.repeat(np.arange(3), sizes_E)
    want_y = np.einsum("id,idf->if", qx, qw[group_I])
    want_dx = np.einsum("if,idf->id", qg, qw[group_I])
    want_dw = np.stack([qx[group_I == e].T @ qg[group_I == e] for e in range(3)])
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert np.max(np.abs(np.asarray(got) - want)) <= 1e-6 * np.max(np.abs(want))


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_a_layers_fp8_backward_splits_as_zero_bubble_runs_it(recipe):
    """A block's backward pass with FP8 matmuls, split into the input's and the weights' parts
    (`pipeline.split_backward`, what the zero-bubble schedule runs): output and gradients equal `jax.vjp`'s
    with FP8 (1e-6), and the weights' part holds the seven weight-gradient matmuls, each on FP8 operands."""
    one_device = mesh_lib.build(mesh_lib.parse(""), jax.devices()[:1])
    compute = context.Compute(one_device, rules_lib.make(ParallelConfig()), fp8=recipe)
    with nnx.use_eager_sharding(False):
        graphdef, w = nnx.split(Block(MODEL, jnp.float32, nnx.Rngs(0)))
    x_BTD = jax.random.normal(jax.random.key(1), (2, 16, MODEL.d_model))
    g_BTD, positions = jax.random.normal(jax.random.key(2), x_BTD.shape), jnp.arange(16)
    fn = lambda w, x, positions: nnx.merge(graphdef, w)(x, positions)
    with context.use(compute):
        split = Split.of(fn, w, x_BTD, positions)

    @jax.jit
    def reference(w, x, positions, g):
        with context.use(compute):
            y, vjp = jax.vjp(lambda w, x: fn(w, x, positions), w, x)
        return y, *vjp(g)[::-1]

    @jax.jit
    def three_parts(w, x, positions, g):
        y, residuals = split.forward(w, x, positions)
        dx, boundary, early = split.input_grad(w, residuals, g)
        return y, dx, split.gradient(early, split.weight_grad(w, boundary))

    for got, want in zip(three_parts(w, x_BTD, positions, g_BTD), reference(w, x_BTD, positions, g_BTD)):
        assert max_relative_error(got, want) < 1e-6
    in_fp8 = lambda eqn: eqn.primitive.name == "dot_general" and all(v.aval.dtype.itemsize == 1 for v in eqn.invars)
    assert sum(map(in_fp8, split.eqns[2])) == sum(eqn.primitive.name == "dot_general" for eqn in split.eqns[2]) == 7


DEEP = dataclasses.replace(MODEL, n_layers=4)
MOE = dataclasses.replace(MODEL, n_experts=4, experts_per_token=2, d_expert=64)
B = TRAIN.global_batch


def pipeline_lanes(M: int, Z: int) -> list[np.ndarray]:
    """The rows each lane of a pipeline scales together: microbatch m is rows m, M + m, …, split over Z batch
    shards in blocks."""
    return [rows[z * len(rows) // Z:(z + 1) * len(rows) // Z] for m in range(M) for rows in [np.arange(m, B, M)]
            for z in range(Z)]


def accumulation_lanes(Y: int, X: int, A: int) -> list[np.ndarray]:
    """The rows each of accumulation's vmapped replicas scales together in each microbatch: batch shard
    (y, x) holds rows [(y·X + x)·B/(Y·X), …), microbatch a the a-th block of b of them."""
    b = B // (Y * X * A)
    return [np.concatenate([(y * X + x) * (B // (Y * X)) + a * b + np.arange(b) for x in range(X)])
            for y in range(Y) for a in range(A)]


# name → (mesh, ParallelConfig fields, train fields, model, the rows scaled together; None: the whole batch)
LAYOUTS = {
    "data": ("data=8", {}, {}, MODEL, None),
    "fsdp": ("fsdp=8", {}, {}, MODEL, None),
    "fsdp+tp+sp": ("data=2,fsdp=2,model=2", {"sequence_parallel": True}, {"remat": "full"}, MODEL, None),
    "ulysses": ("fsdp=2,sequence=2,model=2", {"context_attention": "ulysses"}, {}, MODEL, None),
    "experts": ("expert=4,data=2", {}, {}, MOE, None),
    "experts capacity": ("expert=4,fsdp=2", {"expert_capacity": 2.0}, {}, MOE, None),
    "offload": ("fsdp=8", {"offload": "optimizer+params"}, {"remat": "dots"}, MODEL, None),
    "lora": ("data=2,fsdp=4", {}, {"lora_rank": 4, "lora_alpha": 8.0}, MODEL, None),
    "accumulation": ("data=2,fsdp=2,model=2", {}, {"grad_accum": 2}, MODEL, accumulation_lanes(2, 2, 2)),
    "gpipe": ("stage=2,data=4", {"microbatches": 2}, {}, DEEP, pipeline_lanes(2, 4)),
    "circular": ("stage=2,fsdp=2,model=2", {"microbatches": 2, "pipeline_repeats": 2}, {}, DEEP, pipeline_lanes(2, 2)),
    "1f1b": ("stage=2,data=2,fsdp=2", {"pipeline_schedule": "1f1b", "microbatches": 4}, {}, DEEP,
             pipeline_lanes(4, 4)),
    "interleaved 1f1b": ("stage=2,data=4", {"pipeline_schedule": "1f1b", "microbatches": 2, "pipeline_repeats": 2},
                         {}, DEEP, pipeline_lanes(2, 4)),
    "zero_bubble": ("stage=2,data=4", {"pipeline_schedule": "zero_bubble", "microbatches": 2}, {}, DEEP,
                    pipeline_lanes(2, 4)),
    "zero1": ("data=2,fsdp=4", {"zero_stage": 1}, {}, MODEL, None),
}
FAST = {("fsdp", "tensorwise"), ("gpipe", "rowwise")}  # the FP8 all-gather; lanes; the rest in the slow tier


def marks(name: str, recipe: str) -> list:
    return [] if (name, recipe) in FAST else [pytest.mark.slow]


# For CI's time: tensorwise on all but GPipe (rowwise's lanes are in make test), rowwise on five
BOTH = ("fsdp+tp+sp", "experts", "accumulation", "circular", "zero_bubble")
RECIPES = {name: ("tensorwise", "rowwise") if name in BOTH else ("rowwise",) if name == "gpipe" else ("tensorwise",)
           for name in LAYOUTS}
CASES = [pytest.param(name, recipe, marks=marks(name, recipe)) for name in LAYOUTS for recipe in RECIPES[name]]


def one_device(cfg: train.TrainConfig, model, parallel: dict, lanes: list[np.ndarray] | None):
    """One device's loss and gradients with FP8: over the whole batch, or over the same lanes as accumulation
    microbatches (the batch's rows reordered lane by lane: each row weighs the same, so the mean is the
    same)."""
    capacity = {k: v for k, v in parallel.items() if k == "expert_capacity"}
    cfg = dataclasses.replace(cfg, grad_accum=len(lanes) if lanes else 1, remat="none")
    if lanes is None:
        return shared_run("single", cfg=cfg, model=model, parallel=ParallelConfig(**capacity)).loss_and_grads()
    order, tokens = np.concatenate(lanes), layouts.tokens
    layouts.tokens = lambda step, c=TRAIN: tokens(step, c)[order]
    try:
        return shared_run("single", cfg=cfg, model=model).loss_and_grads()
    finally:
        layouts.tokens = tokens


@pytest.mark.parametrize(("name", "recipe"), CASES)
def test_fp8_on_a_mesh_matches_one_device(name, recipe):
    """Loss and every gradient with FP8 on each layout's mesh equal one device's with FP8 (float32 master
    weights, 1e-5), and differ from one device's without it: the FP8 matmuls ran."""
    require_devices(8)
    spec, parallel, fields, model, lanes = LAYOUTS[name]
    cfg = dataclasses.replace(TRAIN, fp8=recipe, **fields)
    loss, grads = shared_run(spec, cfg=cfg, model=model, parallel=ParallelConfig(**parallel)).loss_and_grads()
    ref_loss, ref_grads = one_device(cfg, model, parallel, lanes)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-5
    _, plain_grads = one_device(dataclasses.replace(cfg, fp8="none"), model, parallel, lanes)
    assert max_relative_error(grads, plain_grads) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "parallel"), [
    ("sequence=4,fsdp=2", {}),
    ("data=2,sequence=4", {"context_attention": "allgather", "load_balance": False}),
], ids=["ring", "allgather"])
def test_context_attention_with_fp8_matches_one_device_to_an_fp8_rounding(spec, parallel):
    """Context-parallel attention computes a query's attention otherwise than one device (ring: its keys in
    another order; all-gather: another program's fusions): an FP8 rounding of an attention output that falls
    the other way moves a few gradient elements by their share of an e4m3 step, so both are held to 1e-4
    (measured: 1.25e-5 each), the loss to 1e-5."""
    require_devices(8)
    cfg = dataclasses.replace(TRAIN, fp8="tensorwise")
    loss, grads = shared_run(spec, cfg=cfg, parallel=ParallelConfig(**parallel)).loss_and_grads()
    ref_loss, ref_grads = one_device(cfg, MODEL, {}, None)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(grads, ref_grads) < 1e-4


@pytest.mark.slow
def test_an_fp8_run_resumes_onto_another_mesh(tmp_path):
    """FP8 keeps no scale state: 3 steps on fsdp=8, checkpointed, then resumed on data=2,model=4 to step 6 give
    the losses of 6 uninterrupted steps, which differ from bf16's. To 1e-3: tensor parallelism sums the matmuls'
    parts in another order, an FP8 rounding falls the other way now and then, and Adam's normalised steps carry
    it on (uninterrupted runs on the two meshes drift 1.5e-4 apart by step 5; without FP8 a resume holds 1e-4)."""
    require_devices(8)
    uninterrupted = [r["loss"] for r in train_to("fsdp=8", 6, fp8="tensorwise")]
    first = train_to("fsdp=8", 3, tmp_path, fp8="tensorwise")
    resumed = train_to("data=2,model=4", 6, tmp_path, fp8="tensorwise")
    np.testing.assert_allclose([r["loss"] for r in first + resumed], uninterrupted, rtol=1e-3)
    assert uninterrupted != [r["loss"] for r in train_to("fsdp=8", 6)]


# The README's FP8 table, the planner's columns: llama3_8b on 8 H100s, fsdp=8, batch 8 × 8192, remat dots; recipe →
# (step s, tokens/s per GPU, MFU %), as printed (2 decimals, units, 1 decimal).
PLANNER_TABLE = {"none": (0.83, 9925, 58.1), "tensorwise": (0.61, 13513, 79.1), "rowwise": (0.61, 13536, 79.3)}


def test_the_planners_fp8_figures_are_the_readmes():
    """The planner's step, tokens/s per GPU and MFU for each recipe are the README's as printed, hence its
    gain from FP8 (+36%); the FP8 peaks it prices them at are the README's: 1,979 TFLOP/s on an H100, 4,500
    on a B200."""
    model = configs.load("llama3_8b").model
    shape = plan.Shape.of_model(Transformer.factory(model), 0)
    lay = plan.Layout(mesh_lib.parse("fsdp=8"), ParallelConfig(), "dots", 1)
    h100 = plan.parse_hardware("h100")
    got = {}
    for recipe, (step_s, tokens_per_gpu, mfu_percent) in PLANNER_TABLE.items():
        got[recipe] = plan.estimate(shape, lay, plan.Run(8, 8192, fp8=recipe), h100, 8)
        assert round(got[recipe].step_s, 2) == step_s
        assert round(got[recipe].tokens_per_s / 8) == tokens_per_gpu
        assert round(100 * got[recipe].mfu, 1) == mfu_percent
    assert round(100 * (got["tensorwise"].tokens_per_s / got["none"].tokens_per_s - 1)) == 36
    assert (h100.peak(1), plan.parse_hardware("b200").peak(1)) == (1979e12, 4500e12)


def test_an_unknown_recipe_is_refused_naming_the_setting():
    with pytest.raises(InputError, match=r"train\.fp8 = 'e4m3' is not one of none, tensorwise, rowwise"):
        train.TrainConfig(fp8="e4m3")


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused():
    """An A100 (no FP8 tensor cores) is refused up front, an H100 is not; a CPU runs FP8 widened (the tests)."""
    device = lambda kind: type("Device", (), {"platform": "gpu", "device_kind": kind})()
    with pytest.raises(InputError, match=r"train\.fp8 = 'rowwise' needs FP8 tensor cores .* A100-SXM4-80GB has none"):
        fp8.check("rowwise", device("NVIDIA A100-SXM4-80GB"))
    fp8.check("rowwise", device("NVIDIA H100 80GB HBM3"))
    fp8.check("tensorwise", jax.devices()[0])
