"""Checkpoints: exact resume on the same mesh, resume onto other meshes, crash safety, clear errors,
exported parameters; damaged steps (a file truncated, altered or missing, or no checksums) named and
fallen back from, a full disk stopping the run with the previous step intact."""

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import require_devices
from layouts import CORPUS, MODEL, TRAIN, shared_run
from meshpar import checkpoint, mesh as mesh_lib, rules
from meshpar.data import DataConfig
from meshpar.errors import TrainingStopped
from meshpar.run import Checkpoints, Outputs, run
from models.transformer import Transformer

CONFIG = {"model": dataclasses.asdict(MODEL)}
EVERY = checkpoint.CheckpointConfig(every=2, keep=2)


def train_to(spec: str, steps: int, directory=None, model=MODEL, offload: str = "none", data=CORPUS,
             fp8: str = "none") -> list[dict]:
    """Train the test model to `steps` on the mesh `spec`, resuming from `directory` if it holds one."""
    mesh = mesh_lib.build(mesh_lib.parse(spec))
    # one schedule whatever step the run stops at: a resumed run goes on exactly where it left off
    cfg = dataclasses.replace(TRAIN, steps=steps, decay_steps=8, fp8=fp8,
                              remat="dots" if offload == "optimizer+params" else TRAIN.remat)
    parallel = rules.make(rules.ParallelConfig(offload=offload))
    result = run(Transformer.factory(model, cfg.dtype), cfg, data, mesh, parallel, outputs=Outputs(progress=False),
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


# concat in the slow tier: both packers resume by the same row plan, a pure function of the step
@pytest.mark.parametrize("packing", [pytest.param("concat", marks=pytest.mark.slow), "best_fit"])
def test_resume_with_packed_documents_is_exact(tmp_path, packing):
    """40 documents of 10 to 90 bytes packed into rows of 33 tokens: an epoch is about 2 steps of 16 rows,
    so a run stopped at step 3 resumes mid-epoch and both runs cross epochs. The resumed run's losses are
    the uninterrupted run's, bit for bit: the same packed batches, in the same order."""
    require_devices(8)
    rng = np.random.default_rng(0)
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        text = "".join(rng.choice(list("abcdefgh ij\n"), int(rng.integers(10, 91))))
        (tmp_path / "corpus" / f"{i:02d}.txt").write_text(text)
    data = DataConfig(source="text", path=str(tmp_path / "corpus"), packing=packing, eval_fraction=0.1)
    uninterrupted = [r["loss"] for r in train_to("fsdp=8", 6, data=data)]
    first = train_to("fsdp=8", 3, tmp_path / "ckpt", data=data)
    resumed = train_to("fsdp=8", 6, tmp_path / "ckpt", data=data)
    assert [r["loss"] for r in first + resumed] == uninterrupted


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
    saved, other = shared_run("single"), shared_run("single", model=dataclasses.replace(MODEL, d_ff=256))
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
    source = shared_run("fsdp=8")
    params = source.state["model"]
    checkpoint.export_params(tmp_path / "export", params, CONFIG)
    target = shared_run("data=2,model=4")
    loaded = checkpoint.load_params(tmp_path / "export", target.sharded.abstract["model"],
                                    target.sharded.shardings["model"])
    w = loaded["blocks"]["mlp"]["w_up_DF"][...]
    assert w.sharding.spec == target.sharded.shardings["model"]["blocks"]["mlp"]["w_up_DF"].get_value().spec
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="holds no exported parameters"):
        checkpoint.load_params(tmp_path / "empty", params, target.sharded.shardings["model"])


def test_resume_between_offloaded_and_device_state(uninterrupted, tmp_path):
    """Host-offloaded state (meshpar.offload) is saved and restored like any other, onto any mesh."""
    first = train_to("fsdp=8", 2, tmp_path, offload="optimizer")
    middle = train_to("data=2,model=4", 4, tmp_path)
    last = train_to("fsdp=8", 6, tmp_path, offload="optimizer+params")
    np.testing.assert_allclose([r["loss"] for r in first + middle + last], uninterrupted["fsdp=8"], rtol=1e-4)


def random_state(step: int) -> dict:
    """1 MiB of incompressible float32 values, different at each step."""
    return {"w": np.random.default_rng(step).standard_normal((256, 1024)).astype(np.float32)}


def restore_random(ckpt: checkpoint.Checkpointer, step: int | None = None) -> tuple[np.ndarray, int]:
    from flax import nnx

    abstract = nnx.State({"w": jax.ShapeDtypeStruct((256, 1024), np.float32)})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state, meta = ckpt.restore(abstract, jax.tree.map(lambda _: device, abstract), step=step)
    return np.asarray(state["w"]), meta["step"]


def save_random(directory: Path, steps: range) -> None:
    from flax import nnx

    ckpt = checkpoint.Checkpointer(directory, checkpoint.CheckpointConfig(every=1, keep=5))
    for step in steps:
        ckpt.save(step, nnx.State(random_state(step)), {"data": {}})
    ckpt.wait()
    ckpt.close()


def spoil(step_dir: Path, how: str) -> str:
    """Damage `step_dir` `how`; the name of the file damaged (its largest, an array file)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = largest.read_bytes()
    if how == "truncated":
        largest.write_bytes(data[: len(data) // 2])
    elif how == "altered":  # same length: one byte flipped
        largest.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    elif how == "missing":
        largest.unlink()
    else:  # written without checksums, or they were lost
        (step_dir / checkpoint.CHECKSUMS).unlink()
        return checkpoint.CHECKSUMS
    return str(largest.relative_to(step_dir))


@pytest.mark.parametrize("how", ["truncated", "altered", "missing", "unsealed"])
def test_a_damaged_step_is_named_and_resuming_falls_back_to_the_intact_one(tmp_path, capsys, how):
    save_random(tmp_path, range(1, 3))
    assert subprocess.run(["sha256sum", "--check", "--quiet", checkpoint.CHECKSUMS], cwd=tmp_path / "2").returncode == 0
    name = spoil(tmp_path / "2", how)
    kept = sorted(str(p.relative_to(tmp_path / "2")) for p in (tmp_path / "2").rglob("*"))
    ckpt = checkpoint.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=rf"step 2 is damaged: {re.escape(name)}"):
        restore_random(ckpt, step=2)
    assert ckpt.latest_intact() == 1
    err = capsys.readouterr().err
    assert f"step 2 is damaged: {name}" in err and "Moved aside to 2.damaged; trying the step before" in err, err
    w, step = restore_random(ckpt)
    assert step == 1 and np.array_equal(w, random_state(1)["w"])
    ckpt.close()
    # the damaged step is kept whole, aside, and the intact one untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.damaged"]
    assert sorted(str(p.relative_to(tmp_path / "2.damaged")) for p in (tmp_path / "2.damaged").rglob("*")) == kept
    assert checkpoint.damage(tmp_path / "1") == []


def test_when_every_step_is_damaged_resuming_is_refused_and_all_are_kept(tmp_path):
    save_random(tmp_path, range(1, 3))
    spoil(tmp_path / "1", "altered")
    spoil(tmp_path / "2", "missing")
    ckpt = checkpoint.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"no intact checkpoint: step 2 \(state/.* is missing\), step 1 \(state/.* is "
                                         r"altered or truncated"):
        ckpt.latest_intact()
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.damaged", "2.damaged"]
    assert checkpoint.Checkpointer(tmp_path).latest_intact() is None  # a directory of damaged steps opens


def test_resuming_past_a_damaged_step_ends_as_the_uninterrupted_run(uninterrupted, tmp_path, capsys):
    first = train_to("fsdp=8", 3, tmp_path)  # checkpoints at steps 2 and 3
    spoil(tmp_path / "3", "altered")
    resumed = train_to("fsdp=8", 6, tmp_path)
    assert "step 3 is damaged" in capsys.readouterr().err
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]  # from step 2, with its data position
    assert [r["loss"] for r in first[:2] + resumed] == uninterrupted["fsdp=8"]  # bit for bit
    assert "3.damaged" in {p.name for p in tmp_path.iterdir()}


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (the test runs as root, as CI does)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    assert mounted.returncode == 0, f"a full disk is tested on a tmpfs, which needs root: {mounted.stderr}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_stops_the_run_with_the_previous_step_intact(tmp_path):
    require_devices(8)
    # one checkpoint of the test model takes ~1.4 MB: the first fits, the second does not
    with small_disk(tmp_path / "disk", "2m") as disk:
        with pytest.raises(TrainingStopped, match=r"saving step 4 to .* failed: No space left on device. The run "
                                                  r"stopped; the checkpoint of step 2 is intact: make room and run "
                                                  r"again to resume"):
            train_to("fsdp=8", 6, disk)
        assert checkpoint.damage(disk / "2") == []
        assert [p.name for p in disk.iterdir() if p.name.isdigit()] == ["2"]
