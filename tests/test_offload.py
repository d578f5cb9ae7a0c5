"""Host offload (meshpar.offload): the same losses with the optimizer state, and the weights, in host memory;
the bytes that leave the devices for host memory against the ZeRO-Offload formula (tiny here; llama_8b in
test_fit.py); the streamed update's device bytes (one layer's states at most);
activation offload's residuals against `full` remat; the settings it refuses."""

import dataclasses
import functools

import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from conftest import require_devices
from layouts import MODEL, MeshRun, TRAIN, max_relative_error, shared_run
from meshpar import context, plan, remat, rules as rules_lib, train
from meshpar.compiler import hlo
from meshpar.errors import InputError
from meshpar.mesh import MeshConfig
from meshpar.plan.layout import local_elements
from models.transformer import Transformer

STEPS = 10
DOTS = dataclasses.replace(TRAIN, remat="dots")  # optimizer+params refuses remat=none; both sides use dots


@functools.cache
def layout(spec: str, offload: str = "none") -> MeshRun:
    require_devices(8)
    return shared_run(spec, DOTS, parallel=rules_lib.ParallelConfig(offload=offload))


@functools.cache
def losses(spec: str, offload: str = "none") -> list[float]:
    return layout(spec, offload).losses(STEPS)


def moments_and_weights(lay: MeshRun, only_layers: bool = False) -> tuple[float, float]:
    """The ZeRO-Offload formula per device: Adam moments 8Ψ/N_opt and float32 weights 4Ψ/N_params, with Ψ/N
    the parameters per device under the `optimizer` / `params` rules (ZeRO stage, fsdp, model, stage); of the
    stacked layers only with `only_layers`."""
    shape = plan.Shape.of_model(Transformer.factory(MODEL))
    lay_ = plan.Layout.of_run(MeshConfig(**lay.mesh.shape), lay.rules.parallel, lay.cfg, "cpu")
    return (8 * local_elements(shape, lay_, "optimizer", only_layers),
            4 * local_elements(shape, lay_, "params", only_layers))


@pytest.mark.parametrize("spec,offload", [
    ("data=8", "optimizer"),
    ("data=2,fsdp=2,model=2", "optimizer"),
    ("fsdp=8", "optimizer+params"),
    pytest.param("stage=2,fsdp=2,model=2", "optimizer+params", marks=pytest.mark.slow),  # 15 s: `make test-slow`
])
def test_same_losses_and_the_offloaded_bytes_leave_the_devices(spec, offload):
    assert np.max(np.abs(np.subtract(losses(spec, offload), losses(spec)))) <= 1e-6
    on_device, offloaded = layout(spec).report()["memory_per_device"], layout(spec, offload).report()["memory_per_device"]
    moments, weights = moments_and_weights(layout(spec))
    expected = moments + (weights if offload == "optimizer+params" else 0)
    assert offloaded["host_arguments_bytes"] == pytest.approx(expected, rel=0.05)
    assert on_device["arguments_bytes"] - offloaded["arguments_bytes"] == offloaded["host_arguments_bytes"]
    assert on_device["host_arguments_bytes"] == 0
    # the new state goes back to host memory, in the donated buffers
    assert offloaded["host_outputs_bytes"] == offloaded["host_alias_bytes"] == offloaded["host_arguments_bytes"]
    expected_kind = {"moment": "pinned_host", "weight": "pinned_host" if offload == "optimizer+params" else "device",
                     "scalar": "device"}
    lay = layout(spec, offload)  # the state as init_state makes it: born in host memory
    assert memory_kinds(train.init_state(lay.make_model, lay.tx, lay.sharded, lay.cfg.seed)) == expected_kind
    # the update writes each layer's new states over the donated stacks: beside the step without offload it
    # holds one layer's share at most, not a second stack of new moments (and weights)
    moments, weights = moments_and_weights(layout(spec), only_layers=True)
    layers_here = MODEL.n_layers / layout(spec).mesh.shape["stage"]
    one_layer = (moments + (weights if offload == "optimizer+params" else 0)) / layers_here
    assert offloaded["temp_bytes"] - on_device["temp_bytes"] <= one_layer


def test_the_update_streams_a_layer_at_a_time():
    """Offloaded, the step has two more loops over the L layers than without: the gradient norm's and the
    update's (meshpar.offload.update), besides the forward and backward layer scans."""
    loops = lambda lay: hlo.loop_trip_counts(lay.step_hlo()).count(MODEL.n_layers)
    assert loops(layout("fsdp=8", "optimizer+params")) == loops(layout("fsdp=8")) + 2


def memory_kinds(state: nnx.State) -> dict[str, str]:
    """Where each kind of state variable lives: weights, optimizer moments, scalars (step counts)."""
    kinds = {}
    for _, variable in nnx.to_flat_state(state):
        kind = "scalar" if not variable.shape else "weight" if isinstance(variable, nnx.Param) else "moment"
        kinds.setdefault(kind, set()).add(variable[...].sharding.memory_kind)
    return {kind: found.pop() if len(found) == 1 else found for kind, found in kinds.items()}


def residual_bytes(lay: MeshRun, remat: str) -> tuple[int, int]:
    """(device, host) bytes of what the backward pass keeps from the forward pass, as JAX lists them."""
    cfg = dataclasses.replace(TRAIN, remat=remat)
    graphdef, params, rest = nnx.split(nnx.merge(lay.sharded.graphdef, lay.state).model, nnx.Param, ...)

    def loss(params, tokens):
        with context.use(train.compute_context(lay.sharded, cfg)):
            return train.default_loss(cfg)(nnx.merge(graphdef, params, rest), tokens)

    sizes = [(int(np.prod(aval.shape)) * aval.dtype.itemsize, "host" in str(aval))
             for aval, _ in saved_residuals(loss, params, lay.batch(0))]
    return sum(b for b, host in sizes if not host), sum(b for b, host in sizes if host)


def test_activation_offload_keeps_on_the_devices_what_full_remat_keeps():
    lay = layout("fsdp=8")
    device, host = residual_bytes(lay, "offload")
    full, dots = residual_bytes(lay, "full"), residual_bytes(lay, "dots")
    assert device == full[0] and full[1] == dots[1] == 0  # on the devices exactly what full remat keeps
    assert host == dots[0] - full[0] > 0  # what dots keeps beyond full, in host memory
    offloaded = dataclasses.replace(TRAIN, remat="offload")
    loss, grads = shared_run("fsdp=8", offloaded).loss_and_grads()
    loss_ref, grads_ref = shared_run("fsdp=8").loss_and_grads()  # TRAIN: remat none
    assert abs(loss - loss_ref) <= 1e-6 * abs(loss_ref)
    assert max_relative_error(grads, grads_ref) < 1e-5


def test_refused_and_auto():
    with pytest.raises(InputError, match=r"parallel.offload = 'disk' is not one of none, optimizer, optimizer\+params"):
        rules_lib.ParallelConfig(offload="disk")
    weights = rules_lib.ParallelConfig(offload="optimizer+params")
    lay = layout("fsdp=8")
    sharded = dataclasses.replace(lay.sharded, rules=rules_lib.make(weights))
    with pytest.raises(InputError, match=r"'optimizer\+params' with train.remat = 'none'"):
        train.compute_context(sharded, TRAIN)
    assert remat.candidates("auto", "gpu", weights) == ("dots", "full")
    assert remat.candidates("auto", "gpu", rules_lib.ParallelConfig(offload="optimizer")) == ("none", "dots", "full")
