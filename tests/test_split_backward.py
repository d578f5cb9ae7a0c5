"""A layer's backward split in two (meshpar.pipeline.split_backward), against `jax.vjp` of the same layer: the
output, the input's gradient and every weight's gradient, for a dense block and a mixture of experts' block
(its carry a tuple with router statistics); and the weights' part is where the weight matmuls went."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from layouts import MODEL, TRAIN, max_relative_error, shared_run
from meshpar import context, plan, train
from meshpar.mesh import MeshConfig
from meshpar.moe import routing
from meshpar.pipeline.split_backward import Split
from meshpar.plan.memory import deferred_bytes_per_token
from meshpar.rules import ParallelConfig
from models.transformer import Block, Transformer
from test_moe import MOE


def leaf_names(w, leaves) -> list[str]:
    """The top-level names of the weights' leaves numbered `leaves` (flattening order)."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(w)[0]]
    return [paths[i].split("'")[1] for i in leaves]


@pytest.mark.parametrize("cfg", [MODEL, pytest.param(MOE, marks=pytest.mark.slow)], ids=["dense", "moe"])
def test_the_three_parts_compute_the_vjp(cfg):
    with nnx.use_eager_sharding(False):
        graphdef, w = nnx.split(Block(cfg, jnp.float32, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    if cfg.n_experts:
        x = (x, routing.RouterStats.zeros(2, cfg.n_experts))
    positions = jnp.arange(16)
    fn = lambda w, x, positions: nnx.merge(graphdef, w)(x, positions)
    y_ref, vjp = jax.vjp(lambda w, x: fn(w, x, positions), w, x)
    g = jax.tree.map(lambda a: jax.random.normal(jax.random.key(2), a.shape), y_ref)
    dw_ref, dx_ref = vjp(g)
    split = Split.of(fn, w, x, positions)

    @jax.jit
    def three_parts(w, x, positions, g):
        y, residuals = split.forward(w, x, positions)
        dx, boundary, early = split.input_grad(w, residuals, g)
        return y, dx, split.gradient(early, split.weight_grad(w, boundary))

    y, dx, dw = three_parts(w, x, positions, g)
    assert max_relative_error(y, y_ref) < 1e-5
    assert max_relative_error(dx, dx_ref) < 1e-5
    assert max_relative_error(dw, dw_ref) < 1e-5
    dots = [sum(eqn.primitive.name == "dot_general" for eqn in part) for part in split.eqns]
    assert leaf_names(w, split.early) == ["attn_norm", "mlp_norm"]  # a norm's scale: a product and a sum
    if not cfg.n_experts:  # q, k, v, o, gate, up, down: one matmul per weight in the weights' part
        assert dots[2] == 7 and dots[1] > 0


def test_a_nan_cotangent_reaches_every_gradient():
    """The parts pass values on and drop none: a NaN in the output's cotangent shows in dx and every dw."""
    with nnx.use_eager_sharding(False):
        graphdef, w = nnx.split(Block(MODEL, jnp.float32, nnx.Rngs(0)))
    x, positions = jnp.ones((1, 8, MODEL.d_model)), jnp.arange(8)
    split = Split.of(lambda w, x, positions: nnx.merge(graphdef, w)(x, positions), w, x, positions)
    residuals = split.forward(w, x, positions)[1]
    dx, boundary, early = split.input_grad(w, residuals, jnp.full(x.shape, jnp.nan))
    assert jnp.isnan(dx).all()
    assert all(jnp.isnan(leaf).any() for leaf in jax.tree.leaves(split.gradient(early, split.weight_grad(w, boundary))))


def test_a_shard_map_computing_a_weights_gradient_runs_early():
    """A shard_map whose backward yields a weight's gradient with the input's (as a mixture of experts'
    dispatch does) is one equation: that weight's gradient comes out of the input part, the others' out of
    the weights' part, and together they are `jax.vjp`'s."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec

    def fn(w, x, _):
        inner = jax.shard_map(lambda a, x: jnp.tanh(x @ a), mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
        return inner(w["inside"], x) @ w["outside"]

    keys = jax.random.split(jax.random.key(0), 4)
    w = {"inside": jax.random.normal(keys[0], (4, 4)), "outside": jax.random.normal(keys[1], (4, 3))}
    x, g = jax.random.normal(keys[2], (16, 4)), jax.random.normal(keys[3], (16, 3))
    split = Split.of(fn, w, x, ())
    assert split.early == (0,) and split.late == (1,)  # leaves in key order: inside, outside
    dx, boundary, early = split.input_grad(w, split.forward(w, x, ())[1], g)
    dw_ref, dx_ref = jax.vjp(lambda w, x: fn(w, x, ()), w, x)[1](g)
    assert max_relative_error(dx, dx_ref) < 1e-5
    assert max_relative_error(split.gradient(early, split.weight_grad(w, boundary)), dw_ref) < 1e-5
    assert not any(eqn.primitive.name == "shard_map" for eqn in split.eqns[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cfg", [MODEL, MOE], ids=["dense", "moe"])
def test_the_boundary_is_what_the_planner_holds(cfg, dtype):
    """On `expert=2,data=4`, as the schedule runs a layer: the weights' part reads, per token, what the
    planner holds in zero-bubble's ring (`plan.memory.deferred_bytes_per_token`), exactly, in either compute
    dtype (the norms' in float32). A mixture's experts' gradients come early, out of the dispatch's
    shard_map, so their rows are not in it."""
    cfg_train = dataclasses.replace(TRAIN, compute_dtype=dtype)
    layout = shared_run("expert=2,data=4", cfg_train, cfg)
    with nnx.use_eager_sharding(False):
        graphdef, w = nnx.split(Block(cfg, cfg_train.dtype, nnx.Rngs(0)))
    B, T = 8, 16
    x = jnp.zeros((B, T, cfg.d_model), cfg_train.dtype)
    if cfg.n_experts:
        x = (x, routing.RouterStats.zeros(B, cfg.n_experts))
    with context.use(train.compute_context(layout.sharded, cfg_train)):
        split = Split.of(lambda w, x, positions: nnx.merge(graphdef, w)(x, positions), w, x, jnp.arange(T))
    per_token = sum(v.aval.size * v.aval.dtype.itemsize for v in split.boundary) / (B * T)
    shape = plan.Shape.of_model(Transformer.factory(cfg), cfg.experts_per_token if cfg.n_experts else 0)
    lay = plan.Layout.of_run(MeshConfig(expert=2, data=4), ParallelConfig(pipeline_schedule="zero_bubble"),
                             cfg_train, "cpu")
    assert per_token == deferred_bytes_per_token(shape, lay, plan.Run.of(cfg_train, "cpu")), \
        " ".join(str(v.aval) for v in split.boundary)
    assert sorted(leaf_names(w, split.early)) == ["attn_norm", *(["mlp"] * 3 if cfg.n_experts else []), "mlp_norm"]
