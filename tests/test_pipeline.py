"""The pipeline schedule against the one-device layer scan: values and every gradient (float32) with the
bubbles poisoned with NaN in every schedule; the circular schedule's stack at rest in the stage groups'
order (no weights exchanged per step, checkpoints in layer order); the stage shift compiled to
collective-permutes; FSDP weights gathered (and gradients reduced) once per step; the bubble in the
compiled program's matmul FLOPs; remat bounding activation memory; compile cost independent of the number
of microbatches; the errors."""

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import require_devices
from layouts import CORPUS, MODEL, TRAIN
from meshpar import compiler, context, mesh as mesh_lib, rules as rules_lib, sharding
from meshpar.checkpoint import CheckpointConfig
from meshpar.pipeline import gpipe, order, schedule
from meshpar.run import Checkpoints, Outputs, run
from models.transformer import Transformer, TransformerConfig

D, F, T = 32, 64, 8


class Dense(nnx.Module):
    """A cheap residual layer that uses the model's helpers the way a Block does: x + tanh(x·w_in)·w_out."""

    def __init__(self, rngs: nnx.Rngs):
        init = lambda shape, logical: nnx.Param(jax.random.normal(rngs.params(), shape) * shape[0] ** -0.5,
                                                out_sharding=logical)
        self.w_in_DF = init((D, F), ("embed", "mlp"))
        self.w_out_FD = init((F, D), ("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        h_BTF = sharding.constrain(jnp.tanh(x_BTD @ sharding.gathered(self.w_in_DF, jnp.float32)),
                                   ("batch", "seq", "mlp"))
        return sharding.constrain(x_BTD + h_BTF @ sharding.gathered(self.w_out_FD, jnp.float32),
                                  ("batch", "resid_seq", "embed"))


def make_stack(kind: str, n_layers: int) -> nnx.Module:
    with nnx.use_eager_sharding(False):
        if kind == "transformer":
            cfg = TransformerConfig(vocab_size=256, d_model=D, n_layers=n_layers, n_heads=4, n_kv_heads=4, d_ff=F)
            return Transformer(cfg, rngs=nnx.Rngs(0)).blocks

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs: nnx.Rngs) -> Dense:
            return Dense(rngs)

        return stacked(nnx.Rngs(0))


@functools.cache
def weights(kind: str, n_layers: int) -> tuple[nnx.GraphDef, nnx.State]:
    """The stack's graph (abstract init) and weights drawn on the host: no compile, the same for every mesh."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make_stack(kind, n_layers)))
    rng = np.random.default_rng(0)

    def draw(variable: nnx.Variable) -> nnx.Variable:
        shape = variable.shape  # [L, ...]: norm scales [L, D] near 1, matrices scaled by their input size
        if len(shape) == 2:
            value = 1 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        return variable.replace(jnp.asarray(value, jnp.float32))

    return graphdef, jax.tree.map(draw, abstract, is_leaf=lambda v: isinstance(v, nnx.Variable))


@functools.cache
def inputs(kind: str, batch: int) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """The input x, the probe the loss weighs the output with, and what every layer also takes."""
    rng = np.random.default_rng(1)
    x, probe = (jnp.asarray(rng.standard_normal((batch, T, D)), jnp.float32) for _ in range(2))
    return x, probe, (jnp.arange(T),) if kind == "transformer" else ()  # a Block also takes the positions


class Case:
    """A stack's weights placed on a mesh by the parameter rules (layers over stage, embed over fsdp, …)."""

    def __init__(self, spec: str, kind: str = "dense", n_layers: int = 8, batch: int = 16):
        self.mesh, self.rules = mesh_lib.build(mesh_lib.parse(spec)), rules_lib.default()
        self.graphdef, state = weights(kind, n_layers)
        self.state = jax.device_put(state, sharding.state_shardings(state, self.mesh, self.rules))  # layer order
        self.x, self.probe, self.args = inputs(kind, batch)

    @functools.cache
    def at_rest(self, repeats: int) -> nnx.State:
        """The weights in the order the pipeline with R = `repeats` keeps them (`order.to_rest`)."""
        return order.to_rest(self.state, self.mesh, repeats)

    def pipelined(self, **kwargs):
        """jit(value_and_grad) of sum(probe ⊙ pipeline(stack, x)) over the weights at rest and x."""

        def loss(state, x):
            with context.use(context.Compute(self.mesh, self.rules)):
                y = gpipe.pipeline(nnx.merge(self.graphdef, state), x, *self.args, mesh=self.mesh, **kwargs)
            return jnp.sum(self.probe * y), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    def compiled(self, **kwargs):
        return self.pipelined(**kwargs).lower(self.at_rest(kwargs.get("repeats", 1)), self.x).compile()


@functools.cache
def case(spec: str, kind: str = "dense", n_layers: int = 8, batch: int = 16) -> Case:
    require_devices(8)
    return Case(spec, kind, n_layers, batch)


def plain_scan(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, *args: jax.Array) -> jax.Array:
    """The layers in order by `lax.scan`, written here: no meshpar.layers, no pipeline, no mesh context."""
    return jax.lax.scan(lambda h, layer: (nnx.merge(graphdef, layer)(h, *args), None), x, state)[0]


@functools.cache
def reference(kind: str, n_layers: int, batch: int):
    """Output and gradients (layer order) of the plain scan on one device, of the loss `Case.pipelined` takes."""
    graphdef, state = weights(kind, n_layers)
    x, probe, args = inputs(kind, batch)

    def loss(state, x):
        y = plain_scan(graphdef, state, x, *args)
        return jnp.sum(probe * y), y

    one_device = jax.devices()[0]
    return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jax.device_put(state, one_device), jax.device_put(x, one_device)))


def relative_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)) / (np.max(np.abs(b)) + 1e-30))


# (model, mesh, P, M, R, remat); L = 8 unless P·R = 16. Every P in {2, 4, 8}, M in {1, P, 2P}, R in
# {1, 2}, remat policy and mesh appears; M < P with R > 1 exercises the circular schedule's wait.
CASES = [
    ("transformer", "stage=4,data=2", 4, 4, 1, "none"),
    ("transformer", "stage=2,fsdp=2,model=2", 2, 4, 2, "full"),
    ("dense", "stage=2,data=2,fsdp=2", 2, 1, 1, "none"),
    ("dense", "stage=2,data=2,fsdp=2", 4, 8, 2, "dots"),  # two stages per device group
    ("dense", "stage=4,data=2", 4, 1, 2, "none"),
    ("dense", "stage=4,data=2", 4, 8, 1, "dots"),
    ("dense", "stage=8", 8, 8, 1, "none"),
    ("dense", "stage=8", 8, 16, 2, "full"),
]


@pytest.mark.parametrize("kind,spec,P,M,R,remat", CASES,
                         ids=[f"{k}-{m}-P{s}-M{mb}-R{r}-{rm}" for k, m, s, mb, r, rm in CASES])
def test_matches_one_device(kind, spec, P, M, R, remat):
    """With every bubble slot poisoned with NaN: a bubble value reaching the result or a gradient shows."""
    n_layers, batch = max(8, P * R), max(16, 4 * M)
    c = case(spec, kind, n_layers, batch)
    (_, y), (grads, grad_x) = c.pipelined(stages=P, microbatches=M, repeats=R, remat=remat,
                                          poison_bubbles=True)(c.at_rest(R), c.x)
    grads = order.to_layers(grads, c.mesh, R)
    (_, y_ref), (grads_ref, grad_x_ref) = reference(kind, n_layers, batch)
    leaves = jax.tree.leaves((y, grad_x, grads))
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)
    assert relative_error(y, y_ref) < 1e-5
    assert relative_error(grad_x, grad_x_ref) < 1e-5
    errors = jax.tree.map(relative_error, grads, grads_ref)
    assert len(jax.tree.leaves(errors)) == len(jax.tree.leaves(grads_ref))
    assert max(jax.tree.leaves(errors)) < 1e-5, errors


@pytest.mark.parametrize("R", [1, 2])
def test_bubbles_are_poisoned_and_never_reach_the_result(R):
    c = case("stage=4,data=2")
    P, M = 4, 2  # R = 2: M < P, the circular schedule waits for microbatches to come round

    @jax.jit
    def forward(state, x):
        with context.use(context.Compute(c.mesh, c.rules)):
            return gpipe.run(nnx.merge(c.graphdef, state), x, mesh=c.mesh, stages=P, microbatches=M, repeats=R,
                           remat="none", poison_bubbles=True)

    y, final_state, io = jax.device_get(forward(c.at_rest(R), c.x))
    # the last iteration is a bubble for every stage but the last: its outputs are NaN, shifted on
    assert np.isnan(final_state[1:]).all() and np.isfinite(final_state[0]).all()
    assert np.isnan(io[1:]).all()  # the I/O copies of stages other than 0 are poison, never read
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, io[0].swapaxes(0, 1).reshape(y.shape))


@pytest.mark.parametrize("R", [1, 2])
def test_stage_shift_is_the_only_collective_inside_the_loop(R):
    """R = 2 too: each stage's chunks lie on its devices at rest, so no weight (or gradient) is exchanged
    between stages in the step (stored contiguously they were: an all-to-all each way per weight)."""
    c = case("stage=4,data=2")
    P, M = 4, 4
    counts = compiler.collectives(c.compiled(stages=P, microbatches=M, repeats=R).as_text())
    n = schedule.iterations(P, M, R)
    microbatch_bytes = (c.x.shape[0] // M) // c.mesh.shape["data"] * T * D * 4
    # forward: stage s → s+1 each iteration; backward: the transposed permute, s+1 → s
    assert counts["collective-permute"] == {"count": 2 * n, "bytes": 2 * n * microbatch_bytes}
    # once per step, after the loop: the weight gradients over data; the result leaving stage 0 and x's
    # gradient over stage (no fsdp on this mesh: stage weights are never gathered)
    assert set(counts) == {"collective-permute", "all-reduce"} and counts["all-reduce"]["count"] == 2


def test_stack_at_rest_holds_each_stage_groups_chunks():
    """Position (g, r, j) of the stack at rest holds layer (r·p + g)·J + j (p = 2 stage groups, J = L/(p·R));
    each array keeps its sharding, the conversion is one all-to-all over stage, `to_layers` undoes it."""
    c = case("stage=2,data=2,fsdp=2")
    assert order.to_rest(c.state, c.mesh, 1) is c.state  # R = 1: contiguous blocks are the stages' layers
    for R in (2, 4):
        rest = order.to_rest(c.state, c.mesh, R)
        layers = np.arange(8).reshape(R, 2, -1).swapaxes(0, 1).reshape(-1)
        for ordered, at_rest in zip(jax.tree.leaves(c.state), jax.tree.leaves(rest), strict=True):
            np.testing.assert_array_equal(np.asarray(at_rest), np.asarray(ordered)[layers])
            assert at_rest.sharding == ordered.sharding
        for ordered, back in zip(jax.tree.leaves(c.state), jax.tree.leaves(order.to_layers(rest, c.mesh, R))):
            np.testing.assert_array_equal(np.asarray(back), np.asarray(ordered))
        w = c.state["w_in_DF"][...]
        for to_rest in (True, False):
            hlo = order.swap_chunks.lower(w, w.sharding, 0, R, to_rest).compile().as_text()
            assert compiler.collectives(hlo) == {"all-to-all": {"count": 1, "bytes": w.nbytes // 4}}
    with pytest.raises(ValueError, match=r"L = 8 stacked layers are not divisible by P = 2 stages × R = 8 repeats"):
        order.to_rest(c.state, c.mesh, 8)


@pytest.mark.slow  # 18 s: `make test-slow`
def test_checkpoints_hold_layer_order(tmp_path):
    """A run with R = 2 saves its layers in order: it resumes on one device and back again, with the losses
    of a run that was never interrupted (init, save and restore convert the order at rest)."""
    require_devices(8)
    model = dataclasses.replace(MODEL, n_layers=4)
    cfg = dataclasses.replace(TRAIN, decay_steps=6)  # one schedule whatever step a run stops at

    def train_to(spec: str, steps: int, directory=None) -> list[float]:
        mesh = mesh_lib.build(mesh_lib.parse(spec), jax.devices()[:1] if spec == "" else None)
        rules = rules_lib.make(rules_lib.ParallelConfig(microbatches=2, pipeline_repeats=2))
        result = run(Transformer.factory(model, cfg.dtype), dataclasses.replace(cfg, steps=steps), CORPUS, mesh, rules,
                     outputs=Outputs(progress=False),
                     checkpoints=Checkpoints(directory and str(directory), CheckpointConfig(every=2, keep=2),
                                             {"model": dataclasses.asdict(model)}))
        return [record["loss"] for record in result.records]

    pipelined = "stage=2,data=4"
    resumed = train_to(pipelined, 2, tmp_path) + train_to("", 4, tmp_path) + train_to(pipelined, 6, tmp_path)
    np.testing.assert_allclose(resumed, train_to(pipelined, 6), rtol=1e-4)


@pytest.mark.parametrize("spec,R", [("stage=2,fsdp=2,model=2", 1), ("stage=2,data=2,fsdp=2", 2)])
def test_weights_gathered_and_gradients_reduced_once_per_step(spec, R):
    c = case(spec, batch=32)
    counts = {M: compiler.collectives(c.compiled(stages=2, microbatches=M, repeats=R).as_text()) for M in (2, 8)}
    assert counts[2]["all-gather"] == counts[8]["all-gather"]
    # each weight once: its stage's share (/ stage, / model where mlp is split) made whole over fsdp
    weights = c.state["w_in_DF"][...], c.state["w_out_FD"][...]
    per_device = sum(w.nbytes // c.mesh.shape["stage"] // c.mesh.shape["model"] for w in weights)
    assert counts[2]["all-gather"] == {"count": len(weights), "bytes": per_device}
    assert "all-to-all" not in counts[2]  # R = 2: each stage's chunks lie on its devices at rest
    if c.mesh.shape["model"] == 1:  # (tensor parallelism all-reduces inside every layer, per microbatch)
        # one all-reduce of the weight gradients over data × fsdp (with the loss), one over stage (the
        # result leaving stage 0 and x's gradient): neither runs inside the loop
        assert counts[2]["all-reduce"] == counts[8]["all-reduce"]
        assert counts[2]["all-reduce"]["count"] == 2


def test_remat_bounds_activation_memory():
    c = case("stage=4,data=2", batch=64)
    temp = {remat: c.compiled(stages=4, microbatches=4, remat=remat).memory_analysis().temp_size_in_bytes
            for remat in ("none", "dots", "full")}
    # full keeps each iteration's stage input; dots also the projections (x·w_in, h·w_out): the policy
    # must still see them under the stage and shard vmaps; none keeps everything
    assert temp["full"] < temp["dots"] < temp["none"], temp


def _hlo_instructions(hlo: str) -> int:
    return len(re.findall(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = ", hlo, re.MULTILINE))


def _stablehlo_ops(mlir: str) -> int:
    return len(re.findall(r"^\s*(?:%[^=]+ = )?\"?[a-z_]+\.[a-z_.]+", mlir, re.MULTILINE))


def test_compile_cost_does_not_grow_with_microbatches():
    c = case("stage=4,data=2", batch=64)

    def measure(M):
        start = time.perf_counter()
        lowered = c.pipelined(stages=4, microbatches=M).lower(c.state, c.x)
        compiled = lowered.compile()
        return time.perf_counter() - start, _stablehlo_ops(lowered.as_text()), _hlo_instructions(compiled.as_text())

    for attempt in range(2):  # the machine is shared: measure again once before blaming the program
        (t2, ops2, instructions2), (t16, ops16, instructions16) = measure(2), measure(16)
        if t16 < 2 * t2 + 0.5:
            break
    assert ops2 == ops16  # the traced program is the same; only shapes and the trip count differ
    assert abs(instructions2 - instructions16) <= 0.02 * instructions2  # XLA simplifies tiny shapes
    assert t16 < 2 * t2 + 0.5, (t2, t16)


@pytest.mark.parametrize("kwargs,batch,message", [
    (dict(stages=4, microbatches=2, repeats=4), 16, r"L = 8 stacked layers .* P = 4 stages × R = 4 repeats"),
    (dict(stages=3, microbatches=2), 16, r"L = 8 stacked layers .* P = 3 stages"),
    (dict(stages=4, microbatches=3), 16, r"batch B = 16 .* M = 3 microbatches"),
    (dict(stages=4, microbatches=4), 12, r"B/M = 12/4 = 3 rows .* data=2 = 2"),
    (dict(stages=2, microbatches=2), 16, r"P = 2 stages cannot be split over mesh axis stage=4"),
    (dict(stages=4, microbatches=2, remat="some"), 16, r"remat policy 'some'"),
])
def test_errors(kwargs, batch, message):
    c = case("stage=4,data=2")
    with context.use(context.Compute(c.mesh, c.rules)), pytest.raises(ValueError, match=message):
        gpipe.pipeline(nnx.merge(c.graphdef, c.state), jnp.zeros((batch, T, D)), mesh=c.mesh, **kwargs)


def test_microbatch_must_divide_over_data_and_fsdp():
    c = case("stage=2,data=2,fsdp=2")
    with context.use(context.Compute(c.mesh, c.rules)), pytest.raises(ValueError, match=r"data=2 × fsdp=2 = 4"):
        gpipe.pipeline(nnx.merge(c.graphdef, c.state), c.x, mesh=c.mesh, stages=2, microbatches=8)


@functools.cache
def unpipelined_flops(n_layers: int, batch: int) -> int:
    graphdef, state = weights("dense", n_layers)
    x = jax.ShapeDtypeStruct((batch, T, D), jnp.float32)
    return compiler.matmul_flops(jax.jit(functools.partial(plain_scan, graphdef)).lower(state, x).compile().as_text())


@pytest.mark.parametrize("M", [1, 4, 8, 16])
@pytest.mark.parametrize("R", [1, 2])
def test_bubble_fraction(M, R):
    """The formula, and the bubble in the compiled forward pass: 1 − (the unpipelined stack's matmul FLOPs
    / 8 devices) / one device's. Every iteration computes, bubbles included, so the device's FLOPs are
    n iterations × L/(R·P) layers on one microbatch: the bubble is 1 − R·M/n, n = `iterations`. The
    README's table is this test's; stated tolerance 0.001 (measured: equal to float precision)."""
    P = 4
    if R == 1 or M >= P:
        assert schedule.bubble_fraction(P, M, R) == pytest.approx((P - 1) / (R * M + P - 1))
    else:  # the circular schedule waits for microbatches to come round: R·P stage steps each, in sequence
        assert schedule.bubble_fraction(P, M, R) == pytest.approx(1 - R * M / ((R - 1) * P + M + P - 1))
        assert schedule.bubble_fraction(P, M, R) > (P - 1) / (R * M + P - 1)
    assert schedule.bubble_fraction(P, 1) == pytest.approx((P - 1) / P)  # naive model parallelism

    c = case("stage=4,data=2", batch=64)

    def forward(state, x):
        with context.use(context.Compute(c.mesh, c.rules)):
            return gpipe.pipeline(nnx.merge(c.graphdef, state), x, mesh=c.mesh, stages=P, microbatches=M, repeats=R)

    pipelined = compiler.matmul_flops(jax.jit(forward).lower(c.at_rest(R), c.x).compile().as_text())
    measured = 1 - unpipelined_flops(8, 64) / c.mesh.size / pipelined
    assert measured == pytest.approx(schedule.bubble_fraction(P, M, R), abs=1e-3)
