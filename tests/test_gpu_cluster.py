"""The GPU cluster a compile is asked for, read without XLA's GPU compiler (so `make test` holds it): targets
and topologies as the command line gives them, `launch.compile`'s options that contradict each other, and the
one-line errors where jax's CUDA plugin or cuDNN's wheel is missing. What the GPU program holds is
test_gpu_compile.py's and test_gpu_fit.py's (`make test-gpu-compile`)."""

import importlib.util
import re

import pytest

from launch import compile as compile_cli
from meshpar import gpu_flags
from meshpar.compiler import gpu
from meshpar.errors import InputError


def test_clusters_are_read_as_the_command_line_says():
    assert gpu.Cluster.parse("H100", "1x8x8").devices == 64
    assert gpu.Cluster.parse("b200", hosts=2, devices_per_host=4).describe() == "8 × NVIDIA B200 (2 hosts of 4)"
    for bad, words in (("2x8x8", "1xHOSTSxGPUS_PER_HOST"), ("8", "1xHOSTSxGPUS_PER_HOST")):
        with pytest.raises(InputError, match=words):
            gpu.Cluster.parse("h100", bad)
    with pytest.raises(InputError, match="unknown GPU target 'v100'; known: h100, h200, a100, b200"):
        gpu.Cluster.parse("v100")
    with pytest.raises(InputError, match="hosts = 0 must be >= 1"):
        gpu.Cluster.parse("h100", hosts=0)


@pytest.mark.parametrize("argv, message", [
    ("--hosts 2", "--hosts describes the GPU cluster of --target: give --target too"),
    ("--topology 1x2x8", "--topology describes the GPU cluster of --target: give --target too"),
    ("--target h100 --devices 8", "--devices counts fake CPU devices: with --target the cluster is --hosts and "),
    ("--target h100 --mesh auto --hardware a100", "--hardware names the planner's hardware without --target: with "
                                                  "--target it is h100"),
    ("--target h100 --topology 1x2x8 --devices-per-host 4", "--topology 1x2x8 gives the hosts and the GPUs per "
                                                            "host: drop --devices-per-host"),
    ("--mesh fsdp=8 --top 3", r"--top is for --mesh auto \(the planner's layouts\): give --mesh auto too"),
    ("--hardware a100", r"--hardware is for --mesh auto"),
])
def test_launch_compiles_contradicting_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        compile_cli.parse_args(argv.split())
    assert exit_.value.code == 2
    assert re.match(f"python -m launch.compile: error: {message}", capsys.readouterr().err.splitlines()[-1])


def test_launch_compiles_defaults_fill_only_what_is_not_given():
    args = compile_cli.parse_args(["--target", "b200", "--topology", "1x2x4", "--mesh", "auto"])
    assert (args.hosts, args.devices_per_host, args.hardware, args.top) == (1, 8, "h100", 5)
    assert gpu.Cluster.parse(args.target, args.topology, args.hosts, args.devices_per_host).devices == 8
    args = compile_cli.parse_args(["--mesh", "auto", "--hardware", "a100", "--top", "2"])
    assert (args.hardware, args.top, args.devices) == ("a100", 2, None)


def test_a_missing_plugin_or_cudnn_is_one_line_naming_the_pip_command(monkeypatch):
    cluster = gpu.Cluster.parse("h100")
    monkeypatch.setattr(gpu_flags, "cuda_installed", lambda: False)
    with pytest.raises(InputError, match=r"needs jax's CUDA plugin: pip install --no-deps jax-cuda12-plugin=="):
        gpu.devices(cluster)
    monkeypatch.setattr(gpu_flags, "cuda_installed", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nvidia.cudnn"
                        else find_spec(name, *a))
    with pytest.raises(InputError, match=r"cuDNN's library .* nvidia-cudnn-cu12==9\.28\.0\.42"):
        gpu.devices(cluster)
