"""The text of a compiled XLA module, read: its collectives, its matmul FLOPs, its host-memory placement.

All numbers are per device, for one call of the compiled program. `collectives` reads the text of the
compiled XLA module (`compiled.as_text()`) and counts the collectives one execution of the ENTRY
computation runs: a collective inside a `while` body counts once per iteration, using the trip count
XLA records in the loop's `backend_config` (`"known_trip_count":{"n":"K"}`, written for `lax.scan`
and `fori_loop`); where XLA dropped it (XLA:GPU's loop peeling and double buffering do) it is read from
the loop itself: an induction variable XLA names, started at a constant and compared `LT` with a constant
in the condition; a loop with neither (e.g. `lax.while_loop` on a computed bound) has its body counted
ONCE, so its numbers are a lower bound. Every branch of a `conditional` is counted as if it ran (an upper
bound). Bytes are the size of the collective's result on one device (what it delivers); for async
pairs the `X-start` is counted as one X and `X-done` is ignored, with bytes taken from the start's
output part (see `output_shape`). The CPU backend emits only the sync forms.
"""

import functools
import math
import re
from collections import Counter
from typing import NamedTuple

from meshpar.errors import InputError

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

# Bits per element of each XLA primitive type. Sub-byte types take a whole byte unless the layout
# packs them (`E(4)` in the layout, see _ELEMENT_SIZE); token/opaque carry no data.
_ELEMENT_BITS = {
    "pred": 8, "s2": 8, "u2": 8, "s4": 8, "u4": 8, "f4e2m1fn": 8,
    "s8": 8, "u8": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
    "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64,
    "c128": 128,
    "token": 0, "opaque": 0,
}

# `/*index=5*/`: comments the printer puts inside long tuples (shapes and operand lists).
_COMMENT = re.compile(r"/\*.*?\*/")
# A double-quoted string (metadata, backend_config keys); removed before looking for attributes.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# One array shape: `f32[16,32]{1,0}`; dims may be bounded-dynamic (`<=8`); the layout is optional.
_ARRAY_SHAPE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{(?P<layout>[^}]*)\})?")
# A packed element size inside a layout: `{0:E(4)}`.
_ELEMENT_SIZE = re.compile(r"E\((\d+)\)")
# A computation header: `ENTRY %main.0_spmd (param.1: f32[128]) -> f32[128] {`.
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{$")
# An instruction: `ROOT %name = <shape> <opcode>(<operands>), <attributes>`.
_INSTRUCTION = re.compile(r"^(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s+=\s+(?P<rest>.*)$")
# The opcode right after the shape: `all-reduce(`.
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][a-z0-9\-]*)\(")
# Attributes naming called computations: `body=%b`, `to_apply=%add`, `branch_computations={%a, %b}`.
_CALLED = re.compile(
    r"\b(?P<attr>condition|body|to_apply|calls|select|scatter|true_computation|false_computation"
    r"|branch_computations|called_computations)=(?P<names>\{[^}]*\}|%?[\w.\-]+)"
)
_CALLED_NAME = re.compile(r"%?([\w.\-]+)")
# An operand: `%name`, after its shape where the printer gives one.
_OPERAND = re.compile(r"%([\w.\-]+)")
# XLA's record of a while loop's iteration count: `"known_trip_count":{"n":"5"}`.
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?\s*\}')
# Lines of the module outside computations: the header and the stack-frame index printed after it.
_MODULE_LINE = re.compile(r"^(HloModule\b.*|FileNames|FunctionNames|FileLocations|StackFrames|\d+\s.*)$")

class Array(NamedTuple):
    """One array of a shape: its element type, dims and bytes, and whether it lives in host memory (`S(5)`)."""
    dtype: str
    dims: tuple[int, ...]
    bytes: int
    host: bool


ShapeTree = Array | list["ShapeTree"]  # an array, or a list for a tuple


def _parse_shape(text: str, pos: int, line: str) -> tuple[ShapeTree, int]:
    """Parses the shape starting at `text[pos]`; returns its tree and the position after it."""
    if text.startswith("(", pos):
        elements: list[ShapeTree] = []
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " ,":
                pos += 1
            if text.startswith(")", pos):
                return elements, pos + 1
            element, pos = _parse_shape(text, pos, line)
            elements.append(element)
    array = _ARRAY_SHAPE.match(text, pos)
    if array is None or array["dtype"] not in _ELEMENT_BITS:
        raise InputError(f"cannot parse the shape in HLO line: {line.strip()!r}")
    dims = []
    for dim in filter(None, array["dims"].split(",")):
        dim = dim.strip().removeprefix("<=")  # a bounded dynamic dim occupies its bound
        if not dim.isdigit():
            raise InputError(f"cannot size dimension {dim!r} in HLO line: {line.strip()!r}")
        dims.append(int(dim))
    layout = array["layout"] or ""
    packed = _ELEMENT_SIZE.search(layout)
    bits = int(packed[1]) if packed else _ELEMENT_BITS[array["dtype"]]
    return Array(array["dtype"], tuple(dims), math.ceil(math.prod(dims) * bits / 8), "S(5)" in layout), array.end()


def arrays(tree: ShapeTree) -> list[Array]:
    """The arrays of a shape, in order."""
    return [tree] if isinstance(tree, Array) else [a for t in tree for a in arrays(t)]


def total_bytes(tree: ShapeTree) -> int:
    return sum(a.bytes for a in arrays(tree))


def output_shape(opcode: str, shape: ShapeTree) -> ShapeTree:
    """The part of a collective's result that is its output.

    Sync forms and `all-reduce-start` return the output itself. Every other `X-start` returns a
    tuple (operands, outputs, scratch...) — `(f32[128], f32[1024])` for all-gather-start,
    `(f32[128], f32[128], u32[], u32[])` for collective-permute-start, `((f32[128]), f32[16], s32[])`
    for the async-wrapped reduce-scatter/all-to-all — so the output is element 1.
    """
    if opcode.endswith("-start") and opcode != "all-reduce-start":
        if not isinstance(shape, list) or len(shape) < 2:
            raise InputError(f"{opcode} result is not an (operands, outputs, ...) tuple")
        return shape[1]
    return shape


class Instruction(NamedTuple):
    name: str
    opcode: str
    shape: ShapeTree
    operands: tuple[str, ...]  # the names of the instructions it reads
    attributes: str  # the text after the operands
    calls: tuple[tuple[str, int], ...]  # (called computation, times per execution of this instruction)
    literal: str = ""  # a constant's value, as printed


def _operands_end(rest: str, pos: int) -> int:
    """The position of the `)` closing the operand list that opens before `rest[pos]`."""
    depth = 1
    while depth:
        if pos == len(rest):
            raise InputError(f"unclosed operand list in HLO: {rest[:200]!r}")
        depth += {"(": 1, ")": -1}.get(rest[pos], 0)
        pos += 1
    return pos - 1


def _parse_instruction(line: str) -> Instruction:
    match = _INSTRUCTION.match(line.strip())
    if match is None:
        raise InputError(f"cannot parse HLO line: {line.strip()!r}")
    rest = _COMMENT.sub("", match["rest"])
    shape, pos = _parse_shape(rest, 0, line)
    op = _OPCODE.match(rest, pos)
    if op is None:
        raise InputError(f"cannot find the opcode in HLO line: {line.strip()!r}")
    opcode, end = op["opcode"], _operands_end(rest, op.end())
    operands, attributes = tuple(_OPERAND.findall(rest[op.end():end])), rest[end + 1:]
    literal = rest[op.end():end] if opcode == "constant" else ""
    # A -done (or -update) continues the computation its -start ran; following it would count twice.
    if opcode.endswith(("-done", "-update")):
        return Instruction(match["name"], opcode, shape, operands, attributes, (), literal)
    trip_count = _TRIP_COUNT.search(attributes)
    body_runs = int(trip_count[1]) if trip_count else 1
    calls = []
    for attr in _CALLED.finditer(_STRING.sub('""', attributes)):
        runs = 1
        if opcode == "while" and attr["attr"] == "body":
            runs = body_runs
        elif opcode == "while" and trip_count:
            runs = body_runs + 1  # the condition is evaluated once more than the body runs
        calls += [(name, runs) for name in _CALLED_NAME.findall(attr["names"])]
    return Instruction(match["name"], opcode, shape, operands, attributes, tuple(calls), literal)


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Splits module text into computations, each its instructions in the printed (for a scheduled module,
    the executed) order; returns them and the ENTRY computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current = None
    lines = [line for line in hlo_text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("HloModule"):
        raise InputError("HLO text must start with an `HloModule` line")
    for line in lines:
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                current.append(_parse_instruction(line))
        elif header := _COMPUTATION.match(line.strip()):
            current = computations[header["name"]] = []
            if header["entry"]:
                entry = header["name"]
        elif not _MODULE_LINE.match(line.strip()):
            raise InputError(f"unexpected HLO line outside a computation: {line.strip()!r}")
    if current is not None:
        raise InputError("HLO text ends inside a computation (missing `}`)")
    if entry is None:
        raise InputError("HLO text has no ENTRY computation")
    for instructions in computations.values():
        for instruction in instructions:
            if undefined := [name for name, _ in instruction.calls if name not in computations]:
                raise InputError(f"HLO calls an undefined computation: {undefined[0]!r}")
    for name, instructions in computations.items():
        defined = {i.name: i for i in instructions}
        computations[name] = [_with_read_trip_count(i, defined, computations) for i in instructions]
    return computations, entry


_INDUCTION = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"?(\d+)"?')
_LESS_THAN = re.compile(r"\bdirection=LT\b")


def _with_read_trip_count(loop: Instruction, defined: dict[str, Instruction],
                          computations: dict[str, list[Instruction]]) -> Instruction:
    """A `while` without XLA's trip count, its body's runs read from the loop (module docstring)."""
    induction = _INDUCTION.search(loop.attributes)
    if loop.opcode != "while" or _TRIP_COUNT.search(loop.attributes) or induction is None:
        return loop
    init = defined.get(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple":
        return loop
    start = defined.get(init.operands[int(induction[1])])
    while start is not None and start.opcode in ("copy", "bitcast") and start.operands:
        start = defined.get(start.operands[0])
    names = _CALLED.findall(_STRING.sub('""', loop.attributes))
    cond = next((_CALLED_NAME.findall(n)[0] for attr, n in names if attr == "condition"), None)
    body = next((_CALLED_NAME.findall(n)[0] for attr, n in names if attr == "body"), None)
    inside = [i for c in [cond, *(callee for i in computations.get(cond, []) for callee, _ in i.calls)]
              for i in computations.get(c, [])]
    bounds = [i.literal for i in inside if i.opcode == "constant" and i.literal.lstrip("-").isdigit()]
    compares = [i for i in inside if i.opcode == "compare" and _LESS_THAN.search(i.attributes)]
    if start is None or start.opcode != "constant" or not start.literal.lstrip("-").isdigit() \
            or len(bounds) != 1 or len(compares) != 1:
        return loop
    runs = max(0, int(bounds[0]) - int(start.literal))
    return loop._replace(calls=tuple((c, runs if c == body else runs + 1) for c, _ in loop.calls))


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Count and result bytes per device of each collective one run of the ENTRY computation does."""
    computations, entry = parse_module(hlo_text)
    # Per computation name (memoised): (kind, "count" | "bytes") -> total for one execution of it.
    totals: dict[str, Counter[tuple[str, str]]] = {}

    def run_once(name: str) -> Counter[tuple[str, str]]:
        if name not in totals:
            total: Counter[tuple[str, str]] = Counter()
            for instruction in computations[name]:
                if (kind := instruction.opcode.removesuffix("-start")) in COLLECTIVES:
                    total[kind, "count"] += 1
                    total[kind, "bytes"] += total_bytes(output_shape(instruction.opcode, instruction.shape))
                for callee, runs in instruction.calls:
                    for key, value in run_once(callee).items():
                        total[key] += runs * value
            totals[name] = total
        return totals[name]

    total = run_once(entry)
    return {
        kind: {"count": total[kind, "count"], "bytes": total[kind, "bytes"]}
        for kind in COLLECTIVES
        if total[kind, "count"]
    }


def loop_trip_counts(hlo_text: str) -> list[int]:
    """The iteration counts XLA records for the module's `while` loops (those that have one: `lax.scan`,
    `fori_loop`), in the order of the text."""
    return [int(n) for n in _TRIP_COUNT.findall(hlo_text)]


def host_entry_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes of the entry computation's arguments and outputs placed in host memory (memory space 5,
    `S(5)` in `entry_computation_layout`), and of the donated host arguments that outputs reuse."""
    header = _COMMENT.sub("", hlo_text.split("\n", 1)[0])
    start = header.find("entry_computation_layout={")
    if start < 0:
        return {"arguments": 0, "outputs": 0, "alias": 0}
    layout = header[start + len("entry_computation_layout={"):]
    args, outs = layout.split(")->", 1)
    end = re.search(r"\}\s*,\s*[a-z_]+=", outs)
    placed = lambda part: [(array.bytes, array.host) for m in _ARRAY_SHAPE.finditer(part)
                           for array in [_parse_shape(m.group(0), 0, header)[0]]]
    args_placed, outs_placed = placed(args), placed(outs[:end.start()] if end else outs)
    aliased = {int(param) for param in re.findall(r"\{\d*\}:\s*\((\d+),", header.split("entry_computation_layout")[0])}
    return {"arguments": sum(b for b, host in args_placed if host),
            "outputs": sum(b for b, host in outs_placed if host),
            "alias": sum(b for i, (b, host) in enumerate(args_placed) if host and i in aliased)}


_LHS_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{(?P<dims>[\d,]*)\}")


def dot_flops(dot: Instruction, defined: dict[str, Instruction]) -> int:
    """2 · output elements · contracted size of a `dot` (`defined`: its computation's instructions by name)."""
    lhs = arrays(defined[dot.operands[0]].shape)[0].dims
    contracting = _LHS_CONTRACTING.search(dot.attributes)
    contracted = math.prod(lhs[int(i)] for i in contracting["dims"].split(",") if i) if contracting else 1
    return 2 * math.prod(arrays(dot.shape)[0].dims) * contracted


def matmul_flops(hlo_text: str) -> int:
    """Matmul FLOPs per device of one run of a compiled module (its `dot` instructions, as XLA:CPU emits
    them), each loop body counted as many times as it runs (the trip counts `collectives` reads). XLA's
    `cost_analysis()`, behind `flops_per_device`, counts a while body once: for a program that is a loop
    (the pipeline schedule, the layer scan) its FLOPs are one iteration's."""
    computations, entry = parse_module(hlo_text)

    @functools.cache
    def total(name: str) -> int:
        defined = {instruction.name: instruction for instruction in computations[name]}
        return sum((dot_flops(i, defined) if i.opcode == "dot" else 0)
                   + sum(runs * total(callee) for callee, runs in i.calls) for i in computations[name])

    return total(entry)
