"""A layer's backward split in two (meshpar.pipeline.split_backward), against `jax.vjp` of the same layer: the
output, the input's gradient and every weight's gradient, for a dense block and a mixture of experts' block
(its carry a tuple with router statistics); and the weights' part is where the weight matmuls went."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from layouts import MODEL, max_relative_error
from meshpar.moe import routing
from meshpar.pipeline.split_backward import Split
from models.transformer import Block
from test_moe import MOE


@pytest.mark.parametrize("cfg", [MODEL, MOE], ids=["dense", "moe"])
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
        dx, boundary = split.input_grad(w, residuals, g)
        return y, dx, split.weight_grad(w, boundary)

    y, dx, dw = three_parts(w, x, positions, g)
    assert max_relative_error(y, y_ref) < 1e-5
    assert max_relative_error(dx, dx_ref) < 1e-5
    assert max_relative_error(dw, dw_ref) < 1e-5
    dots = [sum(eqn.primitive.name == "dot_general" for eqn in part) for part in split.eqns]
    if not cfg.n_experts:  # q, k, v, o, gate, up, down: one matmul per weight in the weights' part
        assert dots[2] == 7 and dots[1] > 0


def test_a_nan_cotangent_reaches_every_gradient():
    """The parts pass values on and drop none: a NaN in the output's cotangent shows in dx and every dw."""
    with nnx.use_eager_sharding(False):
        graphdef, w = nnx.split(Block(MODEL, jnp.float32, nnx.Rngs(0)))
    x, positions = jnp.ones((1, 8, MODEL.d_model)), jnp.arange(8)
    split = Split.of(lambda w, x, positions: nnx.merge(graphdef, w)(x, positions), w, x, positions)
    residuals = split.forward(w, x, positions)[1]
    dx, boundary = split.input_grad(w, residuals, jnp.full(x.shape, jnp.nan))
    assert jnp.isnan(dx).all()
    assert all(jnp.isnan(leaf).any() for leaf in jax.tree.leaves(split.weight_grad(w, boundary)))
