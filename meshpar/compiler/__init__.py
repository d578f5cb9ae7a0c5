"""What the compiler says: the collectives and matmul FLOPs of a compiled module (`hlo`), its memory and
report (`compiled`), will-it-fit, the real step compiled for abstract state (`fit`), on fake CPU devices or
for a described GPU cluster with no GPU (`gpu`: `Cluster`, `devices`), and what a GPU program runs
(`gpu_program`: kernels, collectives by dtype and overlap, a roofline step time)."""

from meshpar.compiler.compiled import compile_report, flops_per_device, memory_per_device
from meshpar.compiler.fit import compile_step
from meshpar.compiler.gpu import Cluster, devices as gpu_devices
from meshpar.compiler.hlo import collectives, matmul_flops

__all__ = ["Cluster", "collectives", "compile_report", "compile_step", "flops_per_device", "gpu_devices",
           "matmul_flops", "memory_per_device"]
