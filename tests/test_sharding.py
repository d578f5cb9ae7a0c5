"""meshpar.sharding with the default rules: specs, state shardings, the sharding table, activations."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar import context, mesh as mesh_lib, rules, sharding, train
from meshpar.rules import Rules
from models.transformer import Transformer, TransformerConfig

from conftest import require_devices

RULES = rules.default()
PARAMS, ACTS = RULES.table("params"), RULES.table("activations")
TINY = TransformerConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512)


def make_mesh(text: str):
    require_devices(8)
    return mesh_lib.build(mesh_lib.parse(text), jax.devices()[:8])


@pytest.fixture(scope="module")
def dfm():
    """data=2, fsdp=2, model=2: every default rule splits something."""
    return make_mesh("data=2,fsdp=2,model=2")


@pytest.fixture(scope="module")
def fsdp8():
    return make_mesh("fsdp=8")


def abstract_state(**params):
    """The abstract state of a module holding `name=(shape, logical axes)` parameters."""

    class Holder(nnx.Module):
        def __init__(self):
            for name, (shape, logical) in params.items():
                setattr(self, name, nnx.Param(jnp.zeros(shape), out_sharding=logical))

    with nnx.use_eager_sharding(False):
        return nnx.state(nnx.eval_shape(Holder))


# --- spec_for -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("logical", "shape", "table", "expected"), [
    (("embed", "mlp"), (8, 16), PARAMS, P("fsdp", "model")),
    (("layers", "embed", "heads", "head_dim"), (2, 8, 4, 16), PARAMS, P(None, "fsdp", "model", None)),
    (("vocab", "embed"), (256, 128), PARAMS, P("model", "fsdp")),
    (("batch", "seq", "embed"), (8, 4, 16), ACTS, P(("data", "fsdp"), None, None)),
    (("batch", "seq", "heads", None), (8, 4, 4, 16), ACTS, P(("data", "fsdp"), None, "model", None)),
    ((None, None), (3, 5), PARAMS, P(None, None)),
    ((), (), PARAMS, P()),
])
def test_spec_for_default_rules(dfm, logical, shape, table, expected):
    assert sharding.spec_for(logical, shape, table, dfm.shape, "x") == expected


def test_spec_for_drops_size_one_axes(fsdp8):
    # batch → (data, fsdp): data is 1, so only fsdp is left, as a plain name
    assert sharding.spec_for(("batch", "seq", "embed"), (8, 4, 16), ACTS, fsdp8.shape, "x") == P("fsdp", None, None)
    # heads/mlp → model (size 1), seq → sequence (size 1): nothing splits them
    assert sharding.spec_for(("embed", "heads", "head_dim"), (8, 3, 5), PARAMS, fsdp8.shape, "x") == P("fsdp", None, None)
    assert sharding.spec_for(("batch", "seq", "mlp"), (8, 3, 5), ACTS, fsdp8.shape, "x") == P("fsdp", None, None)
    one = mesh_lib.build(mesh_lib.MeshConfig(), jax.devices()[:1])
    assert sharding.spec_for(("batch", "seq", "vocab"), (3, 5, 7), ACTS, one.shape, "x") == P(None, None, None)


def test_spec_for_unknown_logical_name(dfm):
    known = ", ".join(sorted(PARAMS))  # every name the rules map: embed, expert_mlp, experts, head_dim, …
    assert {"embed", "heads", "latent", "vocab"} <= set(PARAMS)
    with pytest.raises(ValueError, match=rf"^thing: unknown logical axis 'bogus' on dimension 1 of shape \(4, 4\); "
                                         rf"known: {known}$"):
        sharding.spec_for(("embed", "bogus"), (4, 4), PARAMS, dfm.shape, "thing")


def test_spec_for_unknown_logical_name_even_when_nothing_is_split():
    one = mesh_lib.build(mesh_lib.MeshConfig(), jax.devices()[:1])
    with pytest.raises(ValueError, match=r"unknown logical axis 'bogus'"):
        sharding.spec_for(("bogus",), (4,), PARAMS, one.shape, "thing")


def test_spec_for_wrong_number_of_names(dfm):
    with pytest.raises(ValueError, match=r"^thing: 2 logical axes \('embed', 'mlp'\) for shape \(4, 4, 4\)$"):
        sharding.spec_for(("embed", "mlp"), (4, 4, 4), PARAMS, dfm.shape, "thing")


def test_spec_for_not_divisible_names_dimension_size_and_axis(dfm, fsdp8):
    with pytest.raises(ValueError, match=r"^thing: dimension 1 \('embed'\) of size 12 in shape \(4, 12\) is not "
                                         r"divisible by mesh axes fsdp=8$"):
        sharding.spec_for(("mlp", "embed"), (4, 12), PARAMS, fsdp8.shape, "thing")
    with pytest.raises(ValueError, match=r"dimension 0 \('batch'\) of size 6 in shape \(6, 3\) is not divisible "
                                         r"by mesh axes data=2 × fsdp=2$"):
        sharding.spec_for(("batch", None), (6, 3), ACTS, dfm.shape, "thing")
    with pytest.raises(ValueError, match=r"dimension 0 \('vocab'\) of size 257 .* by mesh axes model=2$"):
        sharding.spec_for(("vocab", "embed"), (257, 8), PARAMS, dfm.shape, "thing")


def one_table(table):
    return Rules(params=table, grads=table, optimizer=table, activations=table)


def test_spec_for_one_mesh_axis_twice_in_one_array(dfm):
    twice = one_table((("rows", ("fsdp",)), ("cols", ("fsdp",)), ("other", ("model",))))
    with pytest.raises(ValueError, match=r"^thing: mesh axis 'fsdp' would split dimension 0 \('rows'\) and "
                                         r"dimension 2 \('cols'\) of shape \(4, 4, 4\); one mesh axis can split "
                                         r"one dimension only$"):
        sharding.spec_for(("rows", "other", "cols"), (4, 4, 4), twice.table("params"), dfm.shape, "thing")
    # the same table is fine for an array that uses each name once
    assert sharding.spec_for(("rows", "other"), (4, 4), twice.table("params"), dfm.shape, "x") == P("fsdp", "model")


# --- state_specs / state_shardings ------------------------------------------------------------------------


def test_state_specs_name_the_parameter_with_an_unknown_logical_name(dfm):
    state = abstract_state(w=((4, 4), ("embed", "bogus")))
    with pytest.raises(ValueError, match=r"^parameter 'w': unknown logical axis 'bogus' on dimension 1 of "
                                         r"shape \(4, 4\); known: embed, expert_embed, expert_mlp, experts"):
        sharding.state_specs(state, dfm, RULES)


def test_state_specs_name_a_nested_parameter_that_does_not_divide(fsdp8):
    class Inner(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.zeros((12, 16)), out_sharding=("embed", "mlp"))

    class Outer(nnx.Module):
        def __init__(self):
            self.layer = Inner()

    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(Outer))
    with pytest.raises(ValueError, match=r"^parameter 'layer/kernel': dimension 0 \('embed'\) of size 12 in shape "
                                         r"\(12, 16\) is not divisible by mesh axes fsdp=8$"):
        sharding.state_specs(state, fsdp8, RULES)


def test_state_specs_name_the_parameter_using_one_mesh_axis_twice(dfm):
    twice = one_table((("rows", ("fsdp",)), ("cols", ("fsdp",))))
    state = abstract_state(ok=((4,), ("rows",)), w=((4, 4), ("rows", "cols")))
    with pytest.raises(ValueError, match=r"^parameter 'w': mesh axis 'fsdp' would split dimension 0 \('rows'\) "
                                         r"and dimension 1 \('cols'\)"):
        sharding.state_specs(state, dfm, twice)


def test_state_specs_reject_a_parameter_without_logical_names(dfm):
    class Plain(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((4, 4)))

    with pytest.raises(ValueError, match=r"^parameter 'w' of shape \(4, 4\) has no logical axes: declare them"):
        sharding.state_specs(nnx.state(nnx.eval_shape(Plain)), dfm, RULES)


@pytest.fixture(scope="module")
def tiny_sharded():
    require_devices(8)
    tx = train.optimizer(train.TrainConfig())
    make = lambda rngs: Transformer(TINY, rngs=rngs)  # noqa: E731
    return {text: train.sharded_abstract(make, tx, make_mesh(text), RULES) for text in ("fsdp=8", "data=2,fsdp=2,model=2")}


def test_state_specs_of_the_transformer(tiny_sharded):
    sharded = tiny_sharded["data=2,fsdp=2,model=2"]
    specs = sharding.state_specs(sharded.abstract, sharded.mesh, RULES)
    model = specs["model"]
    assert model["embed_VD"].get_value() == P("model", "fsdp")
    assert model["head_DV"].get_value() == P("fsdp", "model")
    assert model["blocks"]["attn"]["wq_DNH"].get_value() == P(None, "fsdp", "model", None)
    assert model["blocks"]["attn"]["wo_NHD"].get_value() == P(None, "model", None, "fsdp")
    assert model["blocks"]["mlp"]["w_down_FD"].get_value() == P(None, "model", "fsdp")
    assert model["final_norm"]["scale"].get_value() == P("fsdp")
    # the optimizer moments follow their parameters; the step counters are scalars
    mu = specs["opt"]["opt_state"][1][0].mu
    assert mu["blocks"]["attn"]["wq_DNH"].get_value() == P(None, "fsdp", "model", None)
    assert specs["opt"]["step"].get_value() == P()


def test_state_shardings_are_named_shardings_on_the_mesh(tiny_sharded):
    sharded = tiny_sharded["fsdp=8"]
    shardings = sharding.state_shardings(sharded.abstract, sharded.mesh, RULES)
    flat = dict(nnx.to_flat_state(shardings))
    assert flat.keys() == dict(nnx.to_flat_state(sharded.abstract)).keys()
    for variable in flat.values():
        assert isinstance(variable.get_value(), NamedSharding)
        assert variable.get_value().mesh == sharded.mesh
    embed = shardings["model"]["embed_VD"].get_value()
    assert embed.spec == P(None, "fsdp")
    assert embed.shard_shape((256, 128)) == (256, 16)
    assert shardings["opt"]["step"].get_value().is_fully_replicated


# --- sharding_table ---------------------------------------------------------------------------------------


def table_rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["path", "shape", "logical", "spec", "shard", "bytes/device"]
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in lines[1:])}


def test_sharding_table_of_the_tiny_model_on_fsdp8(tiny_sharded):
    sharded = tiny_sharded["fsdp=8"]
    rows = table_rows(sharding.sharding_table(sharded.abstract, sharded.mesh, RULES))
    paths = ["/".join(str(k) for k in path) for path, _ in nnx.to_flat_state(sharded.abstract)]
    assert list(rows) == paths + ["total"]

    assert rows["model/embed_VD"] == ["(256, 128)", "('vocab', 'embed')", "(None, 'fsdp')", "(256, 16)", "16,384"]
    assert rows["model/blocks/mlp/w_down_FD"] == [
        "(2, 512, 128)", "('layers', 'mlp', 'embed')", "(None, None, 'fsdp')", "(2, 512, 16)", "65,536"]
    assert rows["opt/opt_state/1/0/nu/blocks/attn/wq_DNH"][-2:] == ["(2, 16, 8, 16)", "16,384"]
    assert rows["opt/step"][-2:] == ["()", "4"]

    per_row = [int(cells[-1].replace(",", "")) for path, cells in rows.items() if path != "total"]
    total = int(rows["total"][-1].replace(",", ""))
    assert total == sum(per_row)
    # params + two AdamW moments, each an eighth per device in float32, plus three 4-byte counters
    params = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(sharded.abstract["model"], nnx.Param)))
    assert total == 3 * params * 4 // 8 + 3 * 4


def test_sharding_table_shard_shapes_match_the_shardings(tiny_sharded):
    sharded = tiny_sharded["data=2,fsdp=2,model=2"]
    rows = table_rows(sharding.sharding_table(sharded.abstract, sharded.mesh, RULES))
    shardings = dict(nnx.to_flat_state(sharded.shardings))
    for path, variable in nnx.to_flat_state(sharded.abstract):
        name = "/".join(str(k) for k in path)
        expected = shardings[path].get_value().shard_shape(variable.shape)
        assert rows[name][3] == str(expected)
        assert int(rows[name][4].replace(",", "")) == math.prod(expected) * np.dtype(variable.dtype).itemsize
    assert rows["model/blocks/attn/wq_DNH"][3] == "(2, 64, 4, 16)"


# --- constrain / gathered / batch_sharding ----------------------------------------------------------------


def test_constrain_is_the_identity_outside_a_step(dfm):
    x = jnp.ones((8, 4, 16))
    assert sharding.constrain(x, ("batch", "seq", "mlp")) is x
    # no check either: a name no table knows passes untouched
    assert sharding.constrain(x, ("nonsense",)) is x
    with context.use(context.Compute(dfm, RULES)):
        pass
    assert sharding.constrain(x, ("batch", "seq", "mlp")) is x


def test_the_compute_context_is_reset_after_an_error(dfm):
    x = jnp.ones((8, 4))
    with pytest.raises(RuntimeError), context.use(context.Compute(dfm, RULES)):
        raise RuntimeError
    assert sharding.constrain(x, ("bogus", "bogus")) is x


@pytest.mark.parametrize(("text", "logical", "expected"), [
    ("data=2,fsdp=2,model=2", ("batch", "seq", "mlp"), P(("data", "fsdp"), None, "model")),
    ("data=2,fsdp=2,model=2", ("batch", "seq", "embed"), P(("data", "fsdp"), None, None)),
    ("data=2,sequence=2,model=2", ("batch", "seq", "heads"), P("data", "sequence", "model")),
    ("fsdp=8", ("batch", "seq", "embed"), P("fsdp", None, None)),
])
def test_constrain_inside_jit_follows_the_activation_table(text, logical, expected):
    mesh = make_mesh(text)
    x = jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16)

    def f(x):
        return sharding.constrain(x * 2, logical)

    with context.use(context.Compute(mesh, RULES)):
        y = jax.jit(f)(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, expected), 3)
    assert not y.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_constrain_checks_the_activation(dfm):
    with context.use(context.Compute(dfm, RULES)), pytest.raises(
            ValueError, match=r"activation \('batch', 'seq', 'mlp'\): dimension 0 \('batch'\) of size 6"):
        jax.jit(lambda x: sharding.constrain(x, ("batch", "seq", "mlp")))(jnp.ones((6, 4, 16)))


def test_gathered_casts_and_lays_out_by_the_activation_rules(dfm):
    state = abstract_state(w_DF=((8, 16), ("embed", "mlp")))
    w = nnx.Param(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), out_sharding=("embed", "mlp"),
                  eager_sharding=False)
    at_rest = sharding.state_shardings(state, dfm, RULES)["w_DF"].get_value()
    assert at_rest.spec == P("fsdp", "model")
    w_rest = nnx.Param(jax.device_put(w[...], at_rest), out_sharding=("embed", "mlp"), eager_sharding=False)

    outside = sharding.gathered(w, jnp.bfloat16)
    assert outside.dtype == jnp.bfloat16 and outside.shape == (8, 16)

    def f(value):
        param = nnx.Param(value, out_sharding=("embed", "mlp"), eager_sharding=False)
        with context.use(context.Compute(dfm, RULES)):
            return sharding.gathered(param, jnp.bfloat16)

    out = jax.jit(f)(w_rest[...])
    assert out.dtype == jnp.bfloat16
    # embed is whole in compute (the FSDP all-gather); mlp stays split over model
    assert out.sharding.is_equivalent_to(NamedSharding(dfm, P(None, "model")), 2)
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32), np.asarray(w[...]))


def test_gathered_uses_the_trailing_names_of_a_layer_slice(dfm):
    def f(value):  # a [D, F] slice of a [L, D, F] parameter, as inside the layer scan
        param = nnx.Param(value, out_sharding=("layers", "embed", "mlp"), eager_sharding=False)
        with context.use(context.Compute(dfm, RULES)):
            return sharding.gathered(param, jnp.bfloat16)

    out = jax.jit(f)(jnp.ones((8, 16)))
    assert out.sharding.is_equivalent_to(NamedSharding(dfm, P(None, "model")), 2)


@pytest.mark.parametrize(("parallel", "passed_through"), [
    (rules.ParallelConfig(zero_stage=3), True),  # the partitioner gathers it for the matmul
    (rules.ParallelConfig(zero_stage=0), True),  # nothing to gather
    (rules.ParallelConfig(zero_stage=2), False),  # the gradient is split where the weight is not
])
def test_gathered_passes_a_weight_through_when_there_is_nothing_to_cast_or_lay_out(dfm, parallel, passed_through):
    """No cast and the gradient at the layout at rest: the weight itself, with no custom VJP (whose output
    the backward pass would keep, a copy of each layer's weights)."""
    def f(value):
        param = nnx.Param(value, out_sharding=("embed", "mlp"), eager_sharding=False)
        with context.use(context.Compute(dfm, rules.make(parallel))):
            return sharding.gathered(param, jnp.float32)

    primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(f)(jnp.ones((8, 16))).jaxpr.eqns}
    assert ("custom_vjp_call" not in primitives) == passed_through


@pytest.mark.parametrize(("parallel", "constrained"), [
    (rules.ParallelConfig(), False), (rules.ParallelConfig(sequence_parallel=True), True)])
def test_relayout_constrains_only_where_the_layouts_differ(dfm, parallel, constrained):
    from models.transformer import REGION_INPUT, RESIDUAL

    def f(x):
        with context.use(context.Compute(dfm, rules.make(parallel))):
            return sharding.relayout(x, RESIDUAL, REGION_INPUT)

    primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(f)(jnp.ones((4, 8, 16))).jaxpr.eqns}
    assert ("sharding_constraint" in primitives) == constrained


@pytest.mark.parametrize(("text", "expected"), [
    ("data=2,fsdp=4", P(("data", "fsdp"), None)),
    ("fsdp=8", P("fsdp", None)),
    ("data=8", P("data", None)),
    ("data=2,sequence=2,model=2", P("data", None)),
    ("model=8", P(None, None)),
])
def test_batch_sharding_splits_rows_by_the_batch_rule(text, expected):
    mesh = make_mesh(text)
    tokens = sharding.batch_sharding(mesh, RULES, (16, 129))
    assert tokens.mesh == mesh
    assert tokens.spec == expected


def test_batch_sharding_names_a_batch_the_mesh_does_not_divide():
    with pytest.raises(ValueError, match=r"^token batch of shape \(12, 129\): dimension 0 \('batch'\) of size 12 "
                                         r"in shape \(12, 129\) is not divisible by mesh axes data=2 × fsdp=4$"):
        sharding.batch_sharding(make_mesh("data=2,fsdp=4"), RULES, (12, 129))
