"""Checkpoints: exact resume on the same mesh, resume onto other meshes, crash safety, clear errors,
exported parameters."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import require_devices
from layouts import CORPUS, MODEL, TRAIN, MeshRun
from meshpar import checkpoint, mesh as mesh_lib, rules
from meshpar.run import Checkpoints, Outputs, run
from models.transformer import Transformer

CONFIG = {"model": dataclasses.asdict(MODEL)}
EVERY = checkpoint.CheckpointConfig(every=2, keep=2)


def train_to(spec: str, steps: int, directory=None, model=MODEL, offload: str = "none") -> list[dict]:
    """Train the test model to `steps` on the mesh `spec`, resuming from `directory` if it holds one."""
    mesh = mesh_lib.build(mesh_lib.parse(spec))
    # one schedule whatever step the run stops at: a resumed run goes on exactly where it left off
    cfg = dataclasses.replace(TRAIN, steps=steps, decay_steps=8,
                              remat="dots" if offload == "optimizer+params" else TRAIN.remat)
    parallel = rules.make(rules.ParallelConfig(offload=offload))
    result = run(Transformer.factory(model, cfg.dtype), cfg, CORPUS, mesh, parallel, outputs=Outputs(progress=False),
                 checkpoints=Checkpoints(directory and str(directory), EVERY, {"model": dataclasses.asdict(model)}))
    return result.records


@pytest.fixture(scope="module")
def uninterrupted():
    require_devices(8)
    return {spec: [r["loss"] for r in train_to(spec, 6)] for spec in ("fsdp=8", "data=8")}


def test_resume_on_the_same_mesh_is_exact(uninterrupted, tmp_path):
    first = train_to("fsdp=8", 3, tmp_path)
    assert [r["step"] for r in first] == [1, 2, 3]
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [2, 3]  # every 2 steps and the last
    resumed = train_to("fsdp=8", 6, tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]  # --steps counts from the start of training
    assert [r["loss"] for r in first + resumed] == uninterrupted["fsdp=8"]  # bit for bit


@pytest.mark.parametrize(("before", "after"), [("fsdp=8", "data=2,model=4"), ("data=8", "data=2,fsdp=4")])
def test_resume_onto_another_mesh(uninterrupted, tmp_path, before, after):
    first = train_to(before, 3, tmp_path)
    resumed = train_to(after, 6, tmp_path)
    np.testing.assert_allclose([r["loss"] for r in first + resumed], uninterrupted[before], rtol=1e-4)


def test_only_the_latest_checkpoints_are_kept(tmp_path):
    require_devices(8)
    train_to("fsdp=8", 7, tmp_path)
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [6, 7]


KILLED_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp
    from flax import nnx
    from meshpar.checkpoint import CheckpointConfig, Checkpointer

    state = nnx.State({"w": jnp.full((64, 1024, 1024), 1.0)})  # 256 MiB: its write takes a while
    ckpt = Checkpointer(sys.argv[1], CheckpointConfig(every=1, keep=5))
    ckpt.save(1, state, {"data": {}})
    ckpt.wait()
    ckpt.save(2, nnx.State({"w": state["w"] + 1}), {"data": {}})  # returns while the files are written
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_process_killed_mid_save_keeps_the_last_good_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(directory)], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())  # the save was cut off
    ckpt = checkpoint.Checkpointer(directory)
    assert ckpt.latest_step() == 1
    like = jax.tree.map(lambda _: jax.ShapeDtypeStruct((64, 1024, 1024), np.float32), {"w": 0})
    from flax import nnx

    abstract = nnx.State(like)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state, meta = ckpt.restore(abstract, jax.tree.map(lambda _: device, abstract))
    assert meta["step"] == 1 and float(state["w"][0, 0, 0]) == 1.0
    ckpt.close()
    assert [p.name for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name] == []  # cleaned


def test_a_checkpoint_of_another_model_is_refused_by_field(tmp_path):
    require_devices(8)
    train_to("fsdp=8", 2, tmp_path)
    bigger = dataclasses.replace(MODEL, n_layers=3, d_ff=256)
    with pytest.raises(ValueError, match=r"checkpoint of a different model: model.d_ff: 128 in the checkpoint, "
                                         r"256 now; model.n_layers: 2 in the checkpoint, 3 now"):
        train_to("fsdp=8", 4, tmp_path, model=bigger)
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [2]  # the saved checkpoint is untouched


def test_a_checkpoint_whose_shapes_differ_is_refused_by_path(tmp_path):
    saved, other = MeshRun("single"), MeshRun("single", model=dataclasses.replace(MODEL, d_ff=256))
    ckpt = checkpoint.Checkpointer(tmp_path)
    ckpt.save(1, saved.state, {"data": {}})
    ckpt.wait()
    with pytest.raises(ValueError, match=r"does not fit this model: model.blocks.mlp.w_down_FD: \(2, 128, 64\) in the "
                                         r"checkpoint, \(2, 256, 64\) now"):
        ckpt.restore(other.sharded.abstract, other.sharded.shardings)


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"is not a checkpoint directory \(it holds notes.txt\)"):
        checkpoint.Checkpointer(tmp_path)
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        checkpoint.Checkpointer(tmp_path / "file")


def test_a_directory_with_only_a_save_cut_off_starts_afresh(tmp_path):
    """A process killed during its first save leaves only orbax's temporary directory: nothing to resume,
    and a restarted job must not be refused for it (tests/test_faults.py kills one there)."""
    (tmp_path / "4.orbax-checkpoint-tmp-1732000000").mkdir()
    ckpt = checkpoint.Checkpointer(tmp_path)
    assert ckpt.cut_off == ["4.orbax-checkpoint-tmp-1732000000"] and ckpt.latest_step() is None
    ckpt.close()


def test_exported_parameters_load_onto_any_mesh(tmp_path):
    require_devices(8)
    source = MeshRun("fsdp=8")
    params = source.state["model"]
    checkpoint.export_params(tmp_path / "export", params, CONFIG)
    target = MeshRun("data=2,model=4")
    loaded = checkpoint.load_params(tmp_path / "export", target.sharded.abstract["model"],
                                    target.sharded.shardings["model"])
    w = loaded["blocks"]["mlp"]["w_up_DF"][...]
    assert w.sharding.spec == target.sharded.shardings["model"]["blocks"]["mlp"]["w_up_DF"].get_value().spec
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="holds no exported parameters"):
        checkpoint.load_params(tmp_path / "empty", params, target.sharded.shardings["model"])


def test_resume_between_pipelined_and_unpipelined_meshes(uninterrupted, tmp_path):
    """The layers stay stacked [L, ...] on disk whatever the pipeline does with them."""
    first = train_to("fsdp=8", 2, tmp_path)
    middle = train_to("stage=2,data=4", 4, tmp_path)
    last = train_to("data=8", 6, tmp_path)
    np.testing.assert_allclose([r["loss"] for r in first + middle + last], uninterrupted["fsdp=8"], rtol=1e-4)


def test_resume_between_offloaded_and_device_state(uninterrupted, tmp_path):
    """Host-offloaded state (meshpar.offload) is saved and restored like any other, onto any mesh."""
    first = train_to("fsdp=8", 2, tmp_path, offload="optimizer")
    middle = train_to("data=2,model=4", 4, tmp_path)
    last = train_to("fsdp=8", 6, tmp_path, offload="optimizer+params")
    np.testing.assert_allclose([r["loss"] for r in first + middle + last], uninterrupted["fsdp=8"], rtol=1e-4)
