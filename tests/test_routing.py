"""DeepSeek-V3's routing (meshpar.moe.routing): sigmoid scores, group-limited choice, routed scaling, the
selection bias and its loss-free balancing, the sequence-wise balance loss.

`route` is held to transformers' DeepseekV3TopkRouter on the same logits; the bias update and the
sequence-wise loss to their formulas (DeepSeek-V3 §2.1.2), written here over the routes a test records
layer by layer on one device; the bias after two steps is the same on a mesh with accumulation (and, slow,
through each pipeline schedule) as on one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import require_devices
from layouts import MeshRun, max_relative_error, tokens
from meshpar import checkpoint, context, moe, pipeline, rules as rules_lib, train
from meshpar.errors import InputError
from meshpar.moe import routing
from models.transformer import TransformerConfig

MODEL = TransformerConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=8,
                          experts_per_token=2, d_expert=48, router_score="sigmoid", expert_groups=4, topk_groups=2,
                          routed_scaling=2.5, selection_bias=True)
RATE, SEQ_COEF = 0.01, 0.01
TRAIN = train.TrainConfig(steps=4, global_batch=8, seq_len=16, lr=3e-3, warmup_steps=1, remat="none", grad_accum=2,
                          router_bias_update_rate=RATE, router_seq_aux_loss_coef=SEQ_COEF)
E, K = MODEL.n_experts, MODEL.experts_per_token


@pytest.mark.parametrize("groups, topk_groups, bias, scaling, norm", [
    (4, 2, True, 2.5, True), (2, 1, True, 1.0, True), (1, 1, False, 1.0, False)])
def test_route_equals_transformers_deepseek_v3_router(groups, topk_groups, bias, scaling, norm):
    """The chosen experts and their weights, against DeepseekV3TopkRouter given the logits themselves (its
    weight the identity): the bias only in the choice, the groups' two best scores, × the scaling after the
    normalisation. The biases and groups change some tokens' choice, so a route ignoring them would fail."""
    torch = pytest.importorskip("torch")  # absent from CI's newest-JAX leg
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    rng = np.random.default_rng(0)
    B, T = 3, 7
    logits_BTE = rng.standard_normal((B, T, E)).astype(np.float32) * 2
    bias_E = (rng.standard_normal(E) * 0.3).astype(np.float32) if bias else np.zeros(E, np.float32)
    router = deepseek.DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=E, n_routed_experts=E, num_experts_per_tok=K, n_group=groups, topk_group=topk_groups,
        routed_scaling_factor=scaling, norm_topk_prob=norm))
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.e_score_correction_bias.copy_(torch.tensor(bias_E))
        _, want_weights, want_experts = (t.numpy() for t in router(torch.tensor(logits_BTE)))
    routes = routing.route(jnp.asarray(logits_BTE), K, norm, "sigmoid", groups, topk_groups, scaling,
                           jnp.asarray(bias_E) if bias else None)
    experts, weights = (np.asarray(x).reshape(B * T, K) for x in (routes.experts_BTk, routes.weights_BTk))
    by_id = lambda x, ids: np.take_along_axis(x, np.argsort(ids, -1), -1)  # each token's experts in id order
    np.testing.assert_array_equal(by_id(experts, experts), by_id(want_experts, want_experts))
    np.testing.assert_allclose(by_id(weights, experts), by_id(want_weights, want_experts), rtol=1e-6)
    plain = np.sort(np.argsort(-logits_BTE.reshape(B * T, E), -1)[:, :K], -1)
    assert (groups == 1 and not bias) or (plain != np.sort(experts, -1)).any()


def sequence_loss_by_formula(logits_LBTE, experts_LBTk) -> float:
    """DeepSeek-V3 eq. 17-20 per sequence and layer, Σ_e f_e · P_e with f_e = E/(k·T) · (its assignments) and
    P_e the mean over the sequence of the sigmoid scores normalised per token; summed over layers, mean over
    sequences."""
    scores = 1 / (1 + np.exp(-logits_LBTE.astype(np.float64)))
    P_LBE = (scores / scores.sum(-1, keepdims=True)).mean(2)
    T = logits_LBTE.shape[2]
    counts_LBE = np.stack([[np.bincount(row.ravel(), minlength=E) for row in layer] for layer in experts_LBTk])
    f_LBE = E / (K * T) * counts_LBE
    return float((f_LBE * P_LBE).sum(-1).sum(0).mean())


def test_sequence_loss_is_its_formula():
    """Two layers' routes: the sequence-wise loss per sequence (not pooled), its value against the formula and
    its gradient against that of the formula with f constant (the counts have none). The load-balancing loss
    under sigmoid scores takes the scores normalised per token as its probabilities."""
    rng = np.random.default_rng(1)
    L, B, T = 2, 3, 5
    logits_LBTE = rng.standard_normal((L, B, T, E)).astype(np.float32) * np.float32([1, 3])[:, None, None, None]

    def pooled(logits_LBTE):
        stats = [routing.route(l, K, True, "sigmoid", 4, 2).stats for l in logits_LBTE]
        return sum(stats[1:], stats[0])

    loss = lambda logits_LBTE: routing.sequence_loss(pooled(logits_LBTE), B)
    experts_LBTk = np.stack([routing.route(jnp.asarray(l), K, True, "sigmoid", 4, 2).experts_BTk for l in logits_LBTE])
    assert float(loss(jnp.asarray(logits_LBTE))) == pytest.approx(sequence_loss_by_formula(logits_LBTE, experts_LBTk),
                                                                  rel=1e-6)
    scores = 1 / (1 + np.exp(-logits_LBTE.reshape(-1, E).astype(np.float64)))
    f_E = np.bincount(experts_LBTk.ravel(), minlength=E) / len(scores)
    balance = E * np.sum(f_E * (scores / scores.sum(-1, keepdims=True)).mean(0))
    assert float(routing.balance_loss(pooled(jnp.asarray(logits_LBTE)))) == pytest.approx(balance, rel=1e-6)
    f_LBE = E / (K * T) * jax.nn.one_hot(experts_LBTk, E).sum((2, 3))

    def by_formula(logits_LBTE):
        scores = jax.nn.sigmoid(logits_LBTE)
        return (f_LBE * (scores / scores.sum(-1, keepdims=True)).mean(2)).sum() / B

    grad, want = (np.asarray(jax.grad(fn)(jnp.asarray(logits_LBTE))) for fn in (loss, by_formula))
    assert np.abs(want).max() > 0 and max_relative_error(grad, want) < 1e-5


def layer_routes(run: MeshRun, state, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Each MoE layer's router logits [L, B, T, E] and chosen experts [L, B, T, k] for batch `step`, recorded
    from `moe.route` as the layers run one by one, outside the step, on one device."""
    model = nnx.merge(run.sharded.graphdef, jax.tree.map(jnp.asarray, state)).model
    inputs_BT = jnp.asarray(tokens(step, run.cfg)[:, :-1])
    seen, route = [], moe.route

    def recording(logits_BTE, *args):
        routes = route(logits_BTE, *args)
        seen.append((np.asarray(logits_BTE), np.asarray(routes.experts_BTk)))
        return routes

    block_def, stacked = nnx.split(model.blocks)
    with context.use(train.compute_context(run.sharded, run.cfg)), pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "route", recording)
        carry = model.stack_input(inputs_BT)
        for i in range(MODEL.n_layers):
            carry = nnx.merge(block_def, jax.tree.map(lambda a: a[i], stacked))(carry, jnp.arange(inputs_BT.shape[1]))
    return tuple(np.stack(x) for x in zip(*seen))


def bias_LE(state) -> np.ndarray:
    return np.asarray(state["model"]["blocks"]["mlp"]["selection_bias_E"][...])


@functools.cache
def trained(spec: str, cfg: train.TrainConfig = TRAIN,
            parallel: rules_lib.ParallelConfig = rules_lib.ParallelConfig()) -> list:
    """The states (host arrays, in layer order) and metrics of two steps from the shared initial state."""
    run = MeshRun(spec, cfg, MODEL, parallel)
    step, state, out = train.make_step(run.sharded, run.tokens_sharding, cfg), run.state, []
    for i in range(2):
        state, metrics = step(state, run.batch(i))
        out.append((jax.tree.map(np.asarray, pipeline.to_layers(state, run.mesh, parallel.pipeline_repeats)),
                    {k: float(v) for k, v in metrics.items()}))
    return out


def test_bias_update_is_the_formula_and_the_same_on_a_mesh():
    """Two steps with grad_accum = 2: after each, every layer's bias moved by rate · sign(mean load − load_e),
    the loads counted here from the layer's routes over the whole batch, exactly; on data × expert × model
    the same biases, and on fsdp with the optimizer's state in host memory. The step's sequence-wise loss is its
    formula over the same routes."""
    require_devices(8)
    single, reference = MeshRun("single", TRAIN, MODEL), trained("single")
    state = jax.tree.map(np.asarray, single.state)
    for i, (after, metrics) in enumerate(reference):
        logits_LBTE, experts_LBTk = layer_routes(single, state, i)
        loads_LE = np.stack([np.bincount(e.ravel(), minlength=E) for e in experts_LBTk]).astype(np.float32)
        want_LE = bias_LE(state) + RATE * np.sign(loads_LE.mean(-1, keepdims=True) - loads_LE)
        assert len(np.unique(loads_LE)) > 2  # uneven loads: the update moves biases both ways
        assert metrics["grad_norm"] < np.linalg.norm(loads_LE)  # the loads are no gradient: clipping never sees them
        np.testing.assert_array_equal(bias_LE(after), want_LE.astype(np.float32))
        assert metrics["router_seq_aux_loss"] == pytest.approx(sequence_loss_by_formula(logits_LBTE, experts_LBTk),
                                                               rel=1e-5)
        state = after
    offloaded = rules_lib.ParallelConfig(offload="optimizer")  # the biases stay on the devices, moved by the step
    skipping = dataclasses.replace(TRAIN, on_nonfinite="skip")  # (where a step is not finite, as it was)
    for mesh in (trained("data=2,expert=2,model=2"), trained("fsdp=2,expert=2,model=2", skipping, offloaded)):
        for (after, metrics), (want, want_metrics) in zip(mesh, reference):
            np.testing.assert_array_equal(bias_LE(after), bias_LE(want))
            assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)


def test_selection_bias_is_not_trained_and_is_checkpointed(tmp_path):
    """The optimizer holds no moments for the biases; a saved state's biases come back from its checkpoint."""
    state = trained("single")[-1][0]
    assert not any("selection_bias" in str(path) for path, _ in nnx.to_flat_state(state["opt"]))
    run = MeshRun("single", TRAIN, MODEL)
    saver = checkpoint.Checkpointer(tmp_path)
    saver.save(2, jax.device_put(state, run.sharded.shardings), {})
    saver.wait()
    restored, _ = checkpoint.Checkpointer(tmp_path).restore(run.sharded.abstract, run.sharded.shardings)
    assert np.abs(bias_LE(state)).max() > 0
    np.testing.assert_array_equal(bias_LE(jax.tree.map(np.asarray, restored)), bias_LE(state))


@pytest.mark.parametrize("fields, named", [
    ({"router_score": "tanh"}, "model.router_score"), ({"expert_groups": 3}, "model.expert_groups"),
    ({"expert_groups": 8}, "model.expert_groups"), ({"topk_groups": 5}, "model.topk_groups"),
    ({"topk_groups": 1, "experts_per_token": 3}, "model.experts_per_token"),
    ({"routed_scaling": 0.0}, "model.routed_scaling")])
def test_routing_settings_are_checked(fields, named):
    with pytest.raises(InputError, match=named):
        dataclasses.replace(MODEL, **fields)


def test_training_settings_are_checked():
    """A negative rate or coefficient; the sequence-wise loss under DPO and inside a slot pipeline."""
    require_devices(8)
    for fields, named in (({"router_bias_update_rate": -1.0}, "train.router_bias_update_rate"),
                          ({"router_seq_aux_loss_coef": -1.0}, "train.router_seq_aux_loss_coef"),
                          ({"objective": "dpo"}, "train.router_seq_aux_loss_coef")):
        with pytest.raises(InputError, match=named):
            dataclasses.replace(TRAIN, **fields)
    run = MeshRun("stage=2,data=2,expert=2", TRAIN, MODEL, rules_lib.ParallelConfig(microbatches=2,
                                                                                   pipeline_schedule="1f1b"))
    with pytest.raises(InputError, match="train.router_seq_aux_loss_coef"):
        train.make_step(run.sharded, run.tokens_sharding, TRAIN)(run.state, run.batch(0))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_bias_update_through_pipelines(schedule):
    """Each schedule's backward pass carries the loads as the biases' gradient, bubbles left out: the same
    biases after two steps as one device."""
    require_devices(8)
    cfg = TRAIN if schedule == "gpipe" else dataclasses.replace(TRAIN, router_seq_aux_loss_coef=0.0)
    parallel = rules_lib.ParallelConfig(microbatches=2, pipeline_schedule=schedule)
    for (after, metrics), (want, want_metrics) in zip(trained("stage=2,expert=2,model=2", cfg, parallel),
                                                      trained("single", cfg)):
        np.testing.assert_array_equal(bias_LE(after), bias_LE(want))
        assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)


@pytest.mark.slow
def test_lora_keeps_the_selection_bias():
    """A LoRA run trains its adapters only: the biases, part of the frozen base, stay as they were."""
    cfg = dataclasses.replace(TRAIN, lora_rank=4, lora_targets="q,v,experts")
    (after, _), _ = trained("single", cfg)
    np.testing.assert_array_equal(bias_LE(after), np.zeros((MODEL.n_layers, E), np.float32))
