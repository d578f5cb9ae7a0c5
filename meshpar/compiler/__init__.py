"""What the compiler says: the collectives and matmul FLOPs of a compiled module (`hlo`), its memory and
report (`compiled`), and will-it-fit, the real step compiled for abstract state (`fit`)."""

from meshpar.compiler.compiled import compile_report, flops_per_device, memory_per_device
from meshpar.compiler.hlo import collectives, matmul_flops

__all__ = ["collectives", "compile_report", "flops_per_device", "matmul_flops", "memory_per_device"]
