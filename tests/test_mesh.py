"""meshpar.mesh: MeshConfig validation, `--mesh` parsing, -1 filling, describe, and the built jax Mesh."""

import dataclasses

import jax
import pytest
from jax.sharding import AxisType, Mesh

from meshpar.mesh import AXES, MeshConfig, build, describe, parse

from conftest import require_devices


def sizes(**given):
    """All six axes, the unnamed ones 1."""
    return {axis: given.get(axis, 1) for axis in AXES}


def test_axes_are_ordered_outer_to_inner():
    assert AXES == ("data", "stage", "fsdp", "expert", "sequence", "model")


# --- MeshConfig ---------------------------------------------------------------------------------------


def test_config_defaults_to_ones_and_is_frozen():
    config = MeshConfig()
    assert config.sizes() == sizes()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data = 2


@pytest.mark.parametrize("size", [0, -2])
def test_size_below_one_is_rejected(size):
    with pytest.raises(ValueError, match=rf"mesh axis 'fsdp' has size {size}: sizes are integers >= 1"):
        MeshConfig(fsdp=size)


def test_non_integer_size_is_rejected():
    with pytest.raises(ValueError, match=r"mesh axis 'model' has size 2\.0"):
        MeshConfig(model=2.0)


def test_two_fill_axes_are_rejected():
    with pytest.raises(ValueError, match=r"mesh axes \['data', 'fsdp'\] are all -1: at most one axis"):
        MeshConfig(data=-1, fsdp=-1)


# --- resolve --------------------------------------------------------------------------------------------


def test_resolve_fills_minus_one():
    assert MeshConfig(data=2, fsdp=-1).resolve(8) == MeshConfig(data=2, fsdp=4)
    assert MeshConfig(model=-1).resolve(8) == MeshConfig(model=8)
    assert MeshConfig(data=8, fsdp=-1).resolve(8) == MeshConfig(data=8, fsdp=1)


def test_resolve_keeps_a_mesh_that_fits():
    config = MeshConfig(data=2, fsdp=2, model=2)
    assert config.resolve(8) == config


def test_resolve_minus_one_that_cannot_fill():
    with pytest.raises(ValueError, match=r"mesh axis 'fsdp' = -1 cannot fill 8 devices: the other axes multiply "
                                         r"to 3, which does not divide 8"):
        MeshConfig(data=3, fsdp=-1).resolve(8)


@pytest.mark.parametrize(("config", "product", "text"), [
    (MeshConfig(data=3), 3, "data=3"),
    (MeshConfig(data=2, fsdp=2), 4, "data=2,fsdp=2"),
    (MeshConfig(fsdp=16), 16, "fsdp=16"),
    (MeshConfig(), 1, "data=1"),
])
def test_resolve_rejects_a_product_that_is_not_the_device_count(config, product, text):
    with pytest.raises(ValueError, match=rf"mesh {text} has {product} devices, but 8 are present"):
        config.resolve(8)


# --- parse ----------------------------------------------------------------------------------------------


def test_parse_names_some_axes_and_leaves_the_rest_one():
    assert parse("data=2,fsdp=4") == MeshConfig(data=2, fsdp=4)
    assert parse(" model = 2 , sequence=2 ").sizes() == sizes(model=2, sequence=2)
    assert parse("data=2,stage=2,fsdp=2,sequence=1,model=1") == MeshConfig(data=2, stage=2, fsdp=2)
    assert parse("data=-1,model=2") == MeshConfig(data=-1, model=2)
    assert parse("") == MeshConfig()


def test_parse_unknown_axis():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tensor' in 'data=2,tensor=4': the axes are "
                                         r"data, stage, fsdp, expert, sequence, model"):
        parse("data=2,tensor=4")


@pytest.mark.parametrize(("text", "message"), [
    ("data2", r"malformed mesh item 'data2' in 'data2': expected AXIS=SIZE"),
    ("=2", r"malformed mesh item '=2' in '=2': expected AXIS=SIZE"),
    ("fsdp=4,model", r"malformed mesh item 'model' in 'fsdp=4,model'"),
    ("data=x", r"mesh axis 'data' has size 'x' in 'data=x': not an integer"),
    ("data=", r"mesh axis 'data' has size '' in 'data=': not an integer"),
    ("data=1.5", r"mesh axis 'data' has size '1.5' in 'data=1.5': not an integer"),
    ("data=2,fsdp=2,data=2", r"mesh axis 'data' is given twice in 'data=2,fsdp=2,data=2'"),
])
def test_parse_malformed(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


@pytest.mark.parametrize(("text", "message"), [
    ("data=0", r"mesh axis 'data' has size 0"),
    ("model=-2", r"mesh axis 'model' has size -2"),
    ("data=-1,fsdp=-1", r"mesh axes \['data', 'fsdp'\] are all -1"),
])
def test_parse_validates_sizes(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


# --- describe ------------------------------------------------------------------------------------------


def test_describe_lists_axes_larger_than_one():
    assert describe(MeshConfig(data=2, fsdp=4)) == "data=2,fsdp=4"
    assert describe(sizes(stage=2, model=4)) == "stage=2,model=4"
    assert describe(MeshConfig()) == "data=1"
    assert describe(MeshConfig(fsdp=-1)) == "fsdp=-1"


def test_describe_round_trips_through_parse():
    for config in (MeshConfig(data=2, fsdp=4), MeshConfig(stage=2, sequence=2, model=2), MeshConfig()):
        assert parse(describe(config)) == config


# --- build ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight():
    require_devices(8)
    return jax.devices()[:8]


@pytest.mark.parametrize("text", ["data=2,fsdp=4", "fsdp=8", "data=2,stage=2,model=2", "sequence=2,model=4"])
def test_build_has_six_named_axes_of_the_sizes_asked(eight, text):
    mesh = build(parse(text), eight)
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == ("data", "stage", "fsdp", "expert", "sequence", "model")
    assert dict(mesh.shape) == parse(text).sizes()  # size-1 axes are kept
    assert mesh.devices.shape == tuple(parse(text).sizes().values())
    assert mesh.axis_types == (AxisType.Auto,) * 6
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in eight)


def test_build_fills_minus_one_from_the_devices_given(eight):
    assert dict(build(parse("data=2,fsdp=-1"), eight).shape) == sizes(data=2, fsdp=4)
    assert dict(build(parse("data=-1"), eight[:4]).shape) == sizes(data=4)
    one = build(MeshConfig(), eight[:1])
    assert dict(one.shape) == sizes() and one.size == 1


def test_build_defaults_to_all_devices(eight):
    mesh = build(MeshConfig(fsdp=-1))
    assert mesh.size == jax.device_count()
    assert mesh.shape["fsdp"] == jax.device_count()


def test_build_rejects_a_mesh_that_does_not_match_the_devices(eight):
    with pytest.raises(ValueError, match=r"mesh data=3 has 3 devices, but 8 are present"):
        build(MeshConfig(data=3), eight)
    with pytest.raises(ValueError, match=r"mesh data=2,fsdp=4 has 8 devices, but 4 are present"):
        build(MeshConfig(data=2, fsdp=4), eight[:4])
    with pytest.raises(ValueError, match=r"'fsdp' = -1 cannot fill 8 devices"):
        build(parse("data=3,fsdp=-1"), eight)
