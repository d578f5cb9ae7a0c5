"""Mixtures of experts (meshpar.moe): the dispatch against a loop over tokens, the router's losses against
their formulas, and every expert layout against one device.

The reference of the dispatch is `experts_by_loop`: every token, each of its k experts, one SwiGLU at a time,
an expert taking its first U assignments in token order at capacity (U from the formula, `capacity_by_formula`).
The router's losses and their gradients are also held to transformers' own functions. The layouts run the same
weights and batch as one device and compare the loss (with the load-balancing and z losses in it) and every
gradient.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_devices
from layouts import max_relative_error, param_bytes, shared_run
from meshpar import context, mesh as mesh_lib, rules as rules_lib, train
from meshpar.errors import InputError
from meshpar.moe import dispatch, routing
from models.transformer import TransformerConfig

MOE = TransformerConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=8,
                        experts_per_token=2, d_expert=48)
# Both router losses on, large enough to matter in the gradients.
TRAIN = train.TrainConfig(steps=4, global_batch=16, seq_len=16, lr=3e-3, warmup_steps=1, remat="none",
                          router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
TOLERANCE = 1e-5


def silu(x):
    return x / (1 + np.exp(-x))


def experts_by_loop(x_nD, experts_nK, weights_nK, w_gate, w_up, w_down, capacity_U=None):
    """Σ over each token's experts of weight · SwiGLU_e(x), one token at a time; an expert past its first
    `capacity_U` assignments (in token order) adds nothing. Also each token's dropped assignments [n]."""
    y_nD, taken, dropped_n = np.zeros_like(x_nD), np.zeros(w_gate.shape[0], int), np.zeros(len(x_nD), int)
    for i, x_D in enumerate(x_nD):
        for e, w in zip(experts_nK[i], weights_nK[i]):
            taken[e] += 1
            if capacity_U is not None and taken[e] > capacity_U:
                dropped_n[i] += 1
                continue
            y_nD[i] += w * ((silu(x_D @ w_gate[e]) * (x_D @ w_up[e])) @ w_down[e])
    return y_nD, dropped_n


def capacity_by_formula(c, n, k, E):
    """U = ⌈c·n·k/E⌉, at most n·k (meshpar.moe.dispatch), in integers: n the tokens of ONE device (each
    device routes its own), c the decimal it was written as."""
    c = Fraction(str(c))
    return min(n * k, -(-c.numerator * n * k // (c.denominator * E)))


def assert_group_equals_the_loop(y_btD, dropped_b, x_btD, experts_btk, weights_btk, w, capacity):
    """One device's rows against the loop over its tokens alone: the outputs, and the drops row by row at
    U = `capacity_by_formula` (which the dispatch must have used). Returns the assignments dropped."""
    b, t, D = x_btD.shape
    K, E = experts_btk.shape[-1], w[0].shape[0]
    U = None
    if capacity:
        U = capacity_by_formula(capacity, b * t, K, E)
        assert dispatch.expert_capacity(b * t, K, E, capacity) == U
    expected_nD, dropped_n = experts_by_loop(x_btD.reshape(-1, D), experts_btk.reshape(-1, K),
                                             weights_btk.reshape(-1, K), *w, U)
    np.testing.assert_allclose(np.asarray(y_btD).reshape(-1, D), expected_nD, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(dropped_b), dropped_n.reshape(b, t).sum(1))
    return int(dropped_n.sum())


def assert_reported_drops(experts_BTk, dropped_B, dropped, capacity, E):
    """The step's `dropped_fraction` (routing.metrics) for these routes and the dispatch's drops per row is the
    loop's count over all assignments: exactly 0 dropless, more than 0 at the capacities tested."""
    counts_BE = jax.nn.one_hot(experts_BTk, E).sum((1, 2))
    zeros_B = jnp.zeros(dropped_B.shape)
    stats = routing.RouterStats(counts_BE, counts_BE, zeros_B, dropped_B, zeros_B)
    fraction = float(routing.metrics(stats)["dropped_fraction"])
    assert fraction == pytest.approx(dropped / experts_BTk.size, rel=1e-6)
    assert (fraction == 0.0) == (not capacity)


def random_routes(b, t, D, E, F, K, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, D), np.float32)
    experts = np.stack([rng.permutation(E)[:K] for _ in range(b * t)]).reshape(b, t, K).astype(np.int32)
    experts[0, :, 0] = 3  # one expert much in demand, so that capacity drops
    weights = rng.random((b, t, K)).astype(np.float32)
    w = [rng.standard_normal(s, np.float32) * 0.3 for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, experts, weights, w


# U = c·n·k/E on an integer (0.5 · 24 · 2 / 8 = 3) and between two (1.25 · 24 · 2 / 8 = 7.5: the ceiling is 8)
@pytest.mark.parametrize("capacity", [0.0, 0.5, 1.25])
def test_dispatch_on_one_device_equals_the_loop(capacity):
    b, t, D, E, F, K = 2, 12, 8, 8, 16, 2
    x, experts, weights, w = random_routes(b, t, D, E, F, K)
    y, dropped_b = jax.jit(dispatch.experts_ffn, static_argnums=6)(x, experts, weights, *w, capacity)
    dropped = assert_group_equals_the_loop(y, dropped_b, x, experts, weights, w, capacity)
    assert_reported_drops(experts, dropped_b, dropped, capacity, E)


@pytest.mark.parametrize("c, n, k, E, U", [
    (0.5, 24, 2, 8, 3), (1.25, 24, 2, 8, 8), (1.0, 10, 3, 8, 4), (0.01, 5, 1, 4, 1),
    (1.1, 50, 8, 8, 55),  # c·n·k/E = 55 exactly, 55.00000000000001 in floats
    (100.0, 6, 2, 8, 12),  # at most n·k
])
def test_expert_capacity_is_the_ceiling_of_c_n_k_over_E(c, n, k, E, U):
    assert capacity_by_formula(c, n, k, E) == U
    assert dispatch.expert_capacity(n, k, E, c) == U


def dispatch_on_each_device(spec, capacity, x, experts, weights, w):
    """The dispatch on a mesh, each device's rows (the batch is split over data, fsdp and expert) held to the loop
    over that device's tokens on their own, capacity counted per device; the step's dropped fraction held to
    the loop's drops."""
    mesh = mesh_lib.build(mesh_lib.parse(spec))
    rules = rules_lib.make(rules_lib.ParallelConfig(expert_capacity=capacity))

    def run(*args):
        with context.use(context.Compute(mesh, rules)):
            return dispatch.experts_ffn(*args, capacity)

    y, dropped_b = jax.jit(run)(x, experts, weights, *w)
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    rows = len(x) // shards
    dropped = sum(assert_group_equals_the_loop(y[part], dropped_b[part], x[part], experts[part], weights[part], w,
                                               capacity)
                  for part in (slice(s * rows, (s + 1) * rows) for s in range(shards)))
    assert_reported_drops(experts, dropped_b, dropped, capacity, w[0].shape[0])


EXPERT_MESHES = ["expert=4,data=2", "expert=2,fsdp=2,model=2", "expert=8"]


@pytest.mark.parametrize("spec", EXPERT_MESHES)
@pytest.mark.parametrize("capacity", [0.0, 0.5])
def test_dispatch_over_the_expert_axis_equals_the_loop_on_each_device(spec, capacity):
    """Random routes, one expert in demand (so that capacity drops), on each device's own tokens."""
    require_devices(8)
    b, t, D, E, F, K = 8, 6, 8, 8, 16, 2
    x, experts, weights, w = random_routes(b, t, D, E, F, K, seed=1)
    dispatch_on_each_device(spec, capacity, x, experts, weights, w)


@pytest.mark.parametrize("spec", EXPERT_MESHES)
@pytest.mark.parametrize("sources", ["every", "one"])
def test_dropless_dispatch_of_every_token_to_one_expert_shard_equals_the_loop(spec, sources):
    """The dropless buffers' worst case: all of a device's tokens choose experts of the last expert shard, so
    it sends the full r = n · min(k, El) rows to that shard; from every device at once (that shard receives
    ep · r rows, none of them padding), or from one device among randomly routed ones. With El < k (expert=8)
    a token's experts span k shards: each of them takes r = n rows."""
    require_devices(8)
    b, t, D, E, F, K = 8, 6, 8, 8, 16, 2
    x, experts, weights, w = random_routes(b, t, D, E, F, K, seed=2)
    sizes = mesh_lib.parse(spec)
    ep = sizes.expert
    El, rows = E // ep, b // (ep * sizes.data * sizes.fsdp)
    # k experts from the last shard's first on, wrapping around when El < k; in descending ids (the dispatch sorts)
    experts[slice(0, b) if sources == "every" else slice(rows, 2 * rows)] = [(E - El + i) % E for i in range(K)][::-1]
    sent_to_last = np.isin(experts[rows:2 * rows], np.arange(E - El, E)).sum()  # the second device's
    assert sent_to_last == rows * t * min(K, El)  # r: the buffer's bound is reached
    dispatch_on_each_device(spec, 0.0, x, experts, weights, w)


def test_router_losses_are_their_formulas_pooled_over_layers():
    """Two layers' logits: E · Σ f·P with f and P over both layers' tokens together (transformers' pooling),
    not the mean of per-layer losses; and the mean of logsumexp²."""
    rng = np.random.default_rng(0)
    E, K = 4, 2
    logits = [rng.standard_normal((3, 5, E)).astype(np.float32) * s for s in (1.0, 3.0)]
    stats = sum((routing.route(jnp.asarray(l), K, True).stats for l in logits[1:]),
                routing.route(jnp.asarray(logits[0]), K, True).stats)
    flat = np.concatenate([l.reshape(-1, E) for l in logits])
    probs = np.exp(flat) / np.exp(flat).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :K]
    f = np.bincount(chosen.ravel(), minlength=E) / len(flat)
    assert float(routing.balance_loss(stats)) == pytest.approx(E * np.sum(f * probs.mean(0)), rel=1e-6)
    lse = np.log(np.exp(flat).sum(-1))
    assert float(routing.z_loss(stats)) == pytest.approx(np.mean(lse**2), rel=1e-6)
    per_layer = np.mean([E * np.sum(np.bincount(np.argsort(-p, -1)[:, :K].ravel(), minlength=E) / len(p) * p.mean(0))
                         for p in np.split(probs, 2)])
    assert abs(per_layer - float(routing.balance_loss(stats))) > 1e-3  # the pooling is not the per-layer mean


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_losses_and_their_gradients_equal_transformers(family):
    """The load-balancing loss's gradient reaches the router only through the mean probabilities P (the counts
    f have none), the z-loss's through every logit: both, pooled over two layers, against transformers' own
    functions (the family's load_balancing_loss_func; Switch Transformers' router_z_loss_func over the layers'
    logits concatenated, as that model pools them) on the same float32 logits, values and gradients."""
    torch = pytest.importorskip("torch")  # absent from CI's newest-JAX leg
    transformers_moe = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    switch = pytest.importorskip("transformers.models.switch_transformers.modeling_switch_transformers")
    L, B, T, E, K = 2, 3, 5, 8, 2
    rng = np.random.default_rng(0)
    logits_LBTE = rng.standard_normal((L, B, T, E)).astype(np.float32) * np.float32([1, 3])[:, None, None, None]

    def losses(logits_LBTE):
        stats = [routing.route(logits_BTE, K, True).stats for logits_BTE in logits_LBTE]
        pooled = sum(stats[1:], stats[0])
        return routing.balance_loss(pooled), routing.z_loss(pooled)

    values = losses(jnp.asarray(logits_LBTE))
    grads = [np.asarray(jax.grad(lambda l, i=i: losses(l)[i])(jnp.asarray(logits_LBTE))) for i in range(2)]
    logits_t = torch.tensor(logits_LBTE, requires_grad=True)
    expected = (transformers_moe.load_balancing_loss_func(tuple(l.reshape(-1, E) for l in logits_t), E, K),
                switch.router_z_loss_func(torch.cat(tuple(logits_t), dim=1)))
    for value, grad, want in zip(values, grads, expected):
        (want_grad,) = torch.autograd.grad(want, logits_t)
        assert float(value) == pytest.approx(want.item(), rel=1e-5)
        assert np.abs(want_grad.numpy()).max() > 0
        assert max_relative_error(grad, want_grad.numpy()) < 1e-5


@pytest.fixture(scope="module")
def single():
    layout = shared_run("single", TRAIN, MOE)
    return layout, layout.loss_and_grads()


LAYOUTS = [
    pytest.param("expert=8", rules_lib.ParallelConfig(), id="ep8"),
    pytest.param("data=2,expert=4", rules_lib.ParallelConfig(), id="dp2-ep4"),
    pytest.param("expert=2,fsdp=2,model=2", rules_lib.ParallelConfig(), id="ep2-fsdp2-tp2"),
    pytest.param("expert=2,sequence=2,data=2", rules_lib.ParallelConfig(context_attention="ring"), id="ep2-ring-cp2"),
    pytest.param("expert=2,sequence=2,data=2", rules_lib.ParallelConfig(context_attention="ulysses"),
                 id="ep2-ulysses-cp2"),
    pytest.param("expert=2,data=2,model=2", rules_lib.ParallelConfig(sequence_parallel=True), id="ep2-tp2-sp"),
    pytest.param("stage=2,expert=2,data=2", rules_lib.ParallelConfig(microbatches=2), id="gpipe2-ep2"),
    pytest.param("data=2,expert=4", rules_lib.ParallelConfig(expert_capacity=4.0), id="dp2-ep4-capacity"),
    # a row's drops summed over its positions' devices (once refused by shard_map: they differed per device)
    pytest.param("expert=2,sequence=2,data=2", rules_lib.ParallelConfig(context_attention="ring", expert_capacity=4.0),
                 id="ep2-ring-cp2-capacity"),
]


@pytest.mark.parametrize("spec, parallel", LAYOUTS)
def test_expert_layouts_equal_one_device(single, spec, parallel):
    """Loss (cross-entropy + both router losses) and every gradient as on one device, dropless, and at a
    capacity (4 = E / k: no expert can be over it) that drops nothing."""
    require_devices(8)
    _, (loss, grads) = single
    layout = shared_run(spec, TRAIN, MOE, parallel)
    got_loss, got_grads = layout.loss_and_grads()
    assert got_loss == pytest.approx(loss, rel=TOLERANCE)
    assert max_relative_error(got_grads, grads) < TOLERANCE


def test_expert_weights_are_split_and_the_step_dispatches_by_all_to_all(single):
    """On data=2,expert=4 each device holds 2 of the 8 experts (and on expert=2,fsdp=2,model=2 half of them,
    half of D and half of F); the step's program swaps rows with all-to-alls, which a data-parallel mesh
    does not run; the router's statistics are in its metrics."""
    require_devices(8)
    layout = shared_run("data=2,expert=4", TRAIN, MOE)
    E, D, F, L = MOE.n_experts, MOE.d_model, MOE.expert_width, MOE.n_layers
    w_gate = layout.state["model"]["blocks"]["mlp"]["w_gate_EDF"][...]
    assert w_gate.sharding.shard_shape(w_gate.shape) == (L, E // 4, D, F)
    tp = shared_run("expert=2,fsdp=2,model=2", TRAIN, MOE).state["model"]["blocks"]["mlp"]["w_down_EFD"][...]
    assert tp.sharding.shard_shape(tp.shape) == (L, E // 2, F // 2, D // 2)
    expert_bytes = lambda run: sum(x.addressable_shards[0].data.nbytes for k, x in
                                   run.state["model"]["blocks"]["mlp"].items() if k != "w_router_DE")
    assert expert_bytes(layout) * 4 == expert_bytes(single[0])
    assert param_bytes(layout) == param_bytes(single[0])  # the global state is the same
    assert layout.report()["collectives"].get("all-to-all", {}).get("count", 0) > 0
    assert "all-to-all" not in shared_run("data=8", TRAIN, MOE).report()["collectives"]
    _, metrics = layout.compiled_step[0](jax.tree.map(lambda x: x.copy(), layout.state), layout.batch(0))
    assert set(routing.ROUTER_METRICS) <= set(metrics)
    assert float(metrics["dropped_fraction"]) == 0.0
    assert 0 < float(metrics["expert_share_min"]) <= 1 / 8 <= float(metrics["expert_share_max"]) < 1


def test_capacity_drops_are_reported():
    require_devices(8)
    layout = shared_run("data=2,expert=4", TRAIN, MOE, rules_lib.ParallelConfig(expert_capacity=0.5))
    _, metrics = layout.compiled_step[0](jax.tree.map(lambda x: x.copy(), layout.state), layout.batch(0))
    assert 0.5 <= float(metrics["dropped_fraction"]) < 1  # at most half the assignments fit


def test_accumulation_with_experts_equals_one_device_on_the_same_microbatches():
    """grad_accum = 2: each microbatch's router losses weigh 1/2. A microbatch takes the same block of every
    batch shard's rows (no row moves), so one device gets the rows in that order: then its microbatches are
    the mesh's and the loss and gradients are the same (the cross-entropy does not depend on the order)."""
    require_devices(8)
    cfg = train.TrainConfig(**{**TRAIN.__dict__, "grad_accum": 2})
    layout = shared_run("data=2,expert=4", cfg, MOE)
    got_loss, got_grads = layout.loss_and_grads()
    shards, A, B = 8, cfg.grad_accum, cfg.global_batch
    b = B // (shards * A)
    order = [s * (B // shards) + a * b + i for a in range(A) for s in range(shards) for i in range(b)]
    single = shared_run("single", cfg, MOE)
    loss, grads = train.loss_and_grads(single.sharded, single.tokens_sharding, cfg)(
        single.state, jax.device_put(single.batch(0)[np.array(order)], single.tokens_sharding))
    assert got_loss == pytest.approx(float(loss), rel=TOLERANCE)
    assert max_relative_error(got_grads, jax.tree.map(np.asarray, grads)) < TOLERANCE


def test_what_cannot_run_is_refused_up_front():
    require_devices(8)
    few = TransformerConfig(**{**MOE.__dict__, "n_experts": 4})
    with pytest.raises(InputError, match=r"'experts'\) of size 4 .* not divisible by mesh axes expert=8"):
        shared_run("expert=8", TRAIN, few)
    with pytest.raises(InputError, match="experts_per_token = 9 must be between 1 and model.n_experts = 8"):
        TransformerConfig(**{**MOE.__dict__, "experts_per_token": 9})
    with pytest.raises(InputError, match="expert_capacity = -1.0 must be >= 0"):
        rules_lib.ParallelConfig(expert_capacity=-1.0)
