"""Hugging Face checkpoint directories ↔ meshpar's transformer parameters: lazy sharded import, export.

A Hugging Face directory holds `config.json` and its weights as safetensors: `model.safetensors`, or
shards listed by `model.safetensors.index.json`. Which tensors it holds and how each maps to a meshpar
parameter is its family's (`models.hf.families`).

Import is lazy: every parameter is made with `jax.make_array_from_callback`, whose callback reads from
the memory-mapped files only the block one device owns (layer by layer, and expert by expert, for the
stacked arrays), so a sharded parameter is never whole on one device nor on the host. Export goes the other
way, one parameter (one layer, or one expert of one layer, of it) at a time on the host, and writes float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import ml_dtypes  # noqa: F401  registers numpy's "bfloat16", which safetensors' numpy reader needs for BF16
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from meshpar.errors import InputError
from meshpar.rules import Rules
from meshpar.sharding import state_shardings
from models import rope
from models.hf import deepseek, fp8_blocks, mxfp4
from models.hf.families import FAMILIES, STACKED, Family, Tensor, config_from_hf, config_to_hf, family_of, tensors
from models.transformer import Transformer, TransformerConfig

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# Export shards: transformers' own default is larger; 2 GB keeps one shard's host buffer small.
MAX_SHARD_BYTES = 2 * 10**9
# MXFP4: `mxfp4.Packed`, from two uint8 tensors; FP8_BLOCKS: `fp8_blocks.BlockScaled`, F8_E4M3 and its scales
_READABLE_DTYPES = ("F32", "F16", "BF16", "F64", "MXFP4", "FP8_BLOCKS")
# Two meshpar parameters interleaved column by column in one Hugging Face tensor (gpt-oss's gate_up_proj)
FUSED = ("even", "odd")
# Old Llama checkpoints store the rotary frequencies as a buffer; they follow from the config.
_DERIVED_SUFFIX = ".rotary_emb.inv_freq"


# ---------------------------------------------------------------------------------------------- config

def load_config(hf_dir: str | Path) -> TransformerConfig:
    """The TransformerConfig of a Hugging Face model directory's `config.json` (`families.config_from_hf`), with
    multi-token prediction modules only where the weights hold the first (transformers' save_pretrained writes
    `num_nextn_predict_layers`, 1 by default, and never their tensors)."""
    cfg = config_from_hf(read_config_json(hf_dir))
    if cfg.mtp_depth and f"model.layers.{cfg.n_layers}.eh_proj.weight" not in _weight_map(Path(hf_dir)):
        return dataclasses.replace(cfg, mtp_depth=0)
    return cfg


def read_config_json(hf_dir: str | Path) -> dict:
    """A Hugging Face model directory's `config.json`, as it is."""
    path = Path(hf_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{path} is not JSON: {err}") from None


def _family(hf_dir: Path) -> Family:
    """The family of a model directory (its config.json's model_type), which names its tensors."""
    model_type = read_config_json(hf_dir).get("model_type")
    if model_type not in FAMILIES:
        raise InputError(f"{hf_dir / 'config.json'}: model_type = {model_type!r} is not one meshpar can convert: "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type]


# ---------------------------------------------------------------------------------------------- layouts

def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of one layer of a meshpar parameter of (per-layer) `shape`."""
    if kind == "same":
        return shape
    if kind == "transpose":
        return shape[::-1]
    if kind == "heads_in":
        D, X, H = shape
        return X * H, D
    if kind == "heads_bias":
        X, H = shape
        return (X * H,)
    if kind in FUSED:
        return *shape[:-1], 2 * shape[-1]
    N, H, D = shape
    return D, N * H


def _from_hf(kind: str, part, box: list[tuple[int, int]], shape: tuple[int, ...]) -> np.ndarray:
    """The block `box` (a [start, stop) per dimension) of one layer of a meshpar parameter, read from the
    Hugging Face tensor `part` (anything sliceable: a safetensors slice), in float32."""
    s = [slice(a, b) for a, b in box]
    if kind == "same":
        out = part[tuple(s)]
    elif kind == "transpose":
        out = part[s[1], s[0]].T
    elif kind == "heads_in":  # rows x·H + h of W [X·H, D]: read whole heads, then take the head-dim slice
        (d0, d1), (x0, x1), _ = box
        H = shape[2]
        out = part[x0 * H:x1 * H, s[0]].T.reshape(d1 - d0, x1 - x0, H)[:, :, s[2]]
    elif kind == "heads_bias":  # entries x·H + h of b [X·H]
        (x0, x1), _ = box
        H = shape[1]
        out = part[x0 * H:x1 * H].reshape(x1 - x0, H)[:, s[1]]
    elif kind in FUSED:  # columns 2f (even) or 2f + 1 (odd) of [..., 2F]
        f0, f1 = box[-1]
        out = part[(*s[:-1], slice(2 * f0, 2 * f1))][..., FUSED.index(kind)::2]
    else:  # heads_out: columns n·H + h of W [D, N·H]
        (n0, n1), _, (d0, d1) = box
        H = shape[1]
        out = part[s[2], n0 * H:n1 * H].T.reshape(n1 - n0, H, d1 - d0)[:, s[1], :]
    return np.ascontiguousarray(out, dtype=np.float32)


def _to_hf(kind: str, w: np.ndarray) -> np.ndarray:
    """One layer of a meshpar parameter in the Hugging Face layout (of a FUSED kind: its half, as it is)."""
    if kind in ("same", *FUSED):
        return w
    if kind == "transpose":
        return np.ascontiguousarray(w.T)
    if kind == "heads_in":  # [D, X, H] → [X·H, D]
        return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)
    if kind == "heads_bias":  # [X, H] → [X·H]
        return w.reshape(-1)
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)  # heads_out: [N, H, D] → [D, N·H]


def _interleaved(halves: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """One Hugging Face tensor [..., 2F] of two FUSED parts [..., F]: the even part in columns 2f, the odd in 2f + 1."""
    shape = halves[0][1].shape
    out = np.empty((*shape[:-1], 2 * shape[-1]), np.float32)
    for kind, w in halves:
        out[..., FUSED.index(kind)::2] = w
    return out


# ---------------------------------------------------------------------------------------------- import

def _open(path: Path):
    """A safetensors file, memory-mapped; its tensors are read as numpy arrays."""
    try:
        return safe_open(path, framework="np")
    except (SafetensorError, OSError) as err:
        raise InputError(f"cannot read {path} as safetensors: {err}") from None


def _part(files: dict, weight_map: dict[str, Path], name: str, block: int | None = None):
    """A tensor of the checkpoint as a lazy slice: safetensors', or, where it is stored as MXFP4 blocks and
    scales, `mxfp4.Packed`'s, or as FP8 in blocks of `block` with their scales, `fp8_blocks.BlockScaled`'s."""
    scales = name + fp8_blocks.SUFFIX
    if name in weight_map and scales in weight_map:
        if block is None:
            raise InputError(f"{name} has {scales} beside it, and config.json has no quantization_config saying "
                             f"how it is quantised")
        return fp8_blocks.BlockScaled(name, weight_map[name], files[weight_map[scales]].get_slice(scales), block)
    if name in weight_map:
        return files[weight_map[name]].get_slice(name)
    blocks, scales = (name + suffix for suffix in mxfp4.SUFFIXES)
    return mxfp4.Packed(name, files[weight_map[blocks]].get_slice(blocks), files[weight_map[scales]].get_slice(scales))


def _tensor_names(weight_map: dict[str, Path]) -> set[str]:
    """The checkpoint's tensors: an MXFP4 one (`mxfp4.packed_names`) by its own name, not its two parts', and
    an FP8 block-quantised one without its scales (`fp8_blocks.scaled_names`)."""
    packed = mxfp4.packed_names(weight_map)
    scales = {name + fp8_blocks.SUFFIX for name in fp8_blocks.scaled_names(weight_map)}
    return (set(weight_map) - scales - {name + suffix for name in packed for suffix in mxfp4.SUFFIXES}) | packed


def _weight_map(hf_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it."""
    if (hf_dir / SINGLE_FILE).is_file():
        with _open(hf_dir / SINGLE_FILE) as f:
            return {name: hf_dir / SINGLE_FILE for name in f.keys()}
    if (hf_dir / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise InputError(f"{hf_dir / INDEX_FILE} is not a safetensors index (no weight_map): {err}") from None
        absent = sorted({f for f in weight_map.values() if not (hf_dir / f).is_file()})
        if absent:
            raise InputError(f"{hf_dir / INDEX_FILE} lists shards that are not there: {', '.join(absent)}")
        return {name: hf_dir / file for name, file in weight_map.items()}
    raise InputError(f"{hf_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE} (PyTorch .bin checkpoints: "
                     f"re-save them with transformers' save_pretrained, which writes safetensors)")


def stacked_ranges(cfg: TransformerConfig, tensor: Tensor) -> dict[str, range]:
    """The indices each stacked axis of `tensor`'s parameter takes (`families.STACKED`): every entry of its
    layer stack, every expert."""
    return dict(zip(STACKED, (range(tensor.entries), range(cfg.n_experts))))


def hf_names(tensor: Tensor, ranges: dict[str, range]) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face tensors of `tensor`'s placeholders over `ranges` (indices on the leading axes of the
    meshpar parameter), each with its index ((): one tensor, the whole parameter)."""
    indices = itertools.product(*(ranges[p] for p in tensor.stacked))
    hf = lambda p, i: tensor.layer(i) if p == "l" else i
    return [(tensor.name.format(**{p: hf(p, i) for p, i in zip(tensor.stacked, index)}), index) for index in indices]


def import_params(hf_dir: str | Path, cfg: TransformerConfig, mesh: Mesh, rules: Rules) -> nnx.State:
    """The parameters of a Hugging Face checkpoint of the model `cfg`, laid out on `mesh` by `rules`, in float32.

    Each device reads only its own block of each tensor (float32, bfloat16 and float16 files alike, MXFP4
    experts and FP8 block-quantised weights, dequantised: `mxfp4`, `fp8_blocks`).
    Missing or unexpected tensors and wrong shapes are refused, naming the tensor.
    """
    hf_dir = Path(hf_dir)
    weight_map = _weight_map(hf_dir)
    _, abstract = Transformer.abstract(cfg)
    shardings = dict(nnx.to_flat_state(state_shardings(abstract, mesh, rules)))
    rows = tensors(cfg, _family(hf_dir))
    copies = deepseek.mtp_copies(cfg)
    expected = {name for t in rows for name, _ in hf_names(t, stacked_ranges(cfg, t))} | {c for c, _ in copies}
    present = _tensor_names(weight_map)
    missing = sorted(expected - present)
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()  # tied: the embedding is the head
    unexpected = sorted(n for n in present - expected - ignored if not n.endswith(_DERIVED_SUFFIX))
    if missing:
        raise InputError(f"{hf_dir}: tensor {missing[0]} is missing ({len(missing)} missing in all"
                         f"{': ' + ', '.join(missing[1:4]) + ' …' if len(missing) > 1 else ''}); is config.json "
                         f"the one of these weights?")
    if unexpected:
        raise InputError(f"{hf_dir}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all), which "
                         f"meshpar's model of config.json has no parameter for")
    flat = dict(nnx.to_flat_state(abstract))
    with contextlib.ExitStack() as stack:
        files = {f: stack.enter_context(_open(f)) for f in set(weight_map.values())}
        read = functools.partial(_part, files, weight_map, block=fp8_blocks.block_size(read_config_json(hf_dir)))
        for t in rows:
            layer_shape = flat[t.path].shape[len(t.stacked):]
            for name, _ in hf_names(t, stacked_ranges(cfg, t)):
                part = read(name)
                if tuple(part.get_shape()) != _hf_shape(t.kind, layer_shape):
                    raise InputError(f"{hf_dir}: tensor {name} has shape {tuple(part.get_shape())}, the model "
                                     f"of config.json needs {_hf_shape(t.kind, layer_shape)}")
                if part.get_dtype() not in _READABLE_DTYPES:
                    raise InputError(f"{hf_dir}: tensor {name} is {part.get_dtype()}; readable are "
                                     f"{', '.join(_READABLE_DTYPES)} (a quantised checkpoint?)")
        for copy, source in copies:
            _check_copy(read(copy), read(source), f"{hf_dir}: tensor {copy} differs from {source}, which meshpar's "
                                                  f"multi-token prediction modules share with the model")
        for t in rows:
            variable = flat[t.path]
            read_block = functools.partial(_read_block, read, t, tuple(variable.shape))
            flat[t.path] = variable.replace(
                jax.make_array_from_callback(variable.shape, shardings[t.path].get_value(), read_block))
    return nnx.from_flat_state(flat)


def _check_copy(copy, source, message: str, rows: int = 8192) -> None:
    """Refuse with `message` a 2-D tensor `copy` unequal to `source`, compared a block of `rows` at a time."""
    shape = tuple(source.get_shape())
    block = lambda part, r: part[r:min(r + rows, shape[0]), :]  # safetensors' slices do not clip
    if tuple(copy.get_shape()) != shape or any(not np.array_equal(block(copy, r), block(source, r))
                                              for r in range(0, shape[0], rows)):
        raise InputError(message)


def _read_block(read: Callable, t: Tensor, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` of a meshpar parameter of `shape`: what one device holds, read tensor by tensor over
    its stacked leading axes (layers, experts)."""
    box = [s.indices(n)[:2] for s, n in zip(index, shape)]
    n = len(t.stacked)
    ranges = {p: range(*bounds) for p, bounds in zip(t.stacked, box[:n])}
    blocks = [rope.halves_from_pairs(_from_hf(t.kind, read(name), box[n:], shape[n:]), t.rope)
              for name, _ in hf_names(t, ranges)]
    return np.stack(blocks).reshape(*(len(r) for r in ranges.values()), *blocks[0].shape) if n else blocks[0]


# ---------------------------------------------------------------------------------------------- export

@functools.partial(jax.jit, static_argnums=2)
def _replicated(x, index, to: NamedSharding):
    return jax.lax.with_sharding_constraint(x[index], to)


def on_host(x: jax.Array, index: tuple[int, ...]) -> np.ndarray:
    """One parameter, or its entry `index` on the stacked leading axes (a layer; an expert of a layer), whole
    on the host, in float32. Every process must call it."""
    if x.is_fully_addressable:  # one process: copy its shards
        return np.asarray(x[index], dtype=np.float32)
    # several processes: replicate it on every device (a collective), then copy one device's
    whole = _replicated(x, index, NamedSharding(x.sharding.mesh, P()))
    return np.asarray(whole.addressable_data(0), dtype=np.float32)


def export(params: nnx.State, cfg: TransformerConfig, out_dir: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES,
           model_type: str | None = None) -> list[Path]:
    """Write `params` as a Hugging Face directory of the family `model_type` (default: the one the model's
    options name, `families.family_of`): config.json and float32 safetensors, split into shards of at most
    `max_shard_bytes` with an index when larger (as transformers does). Tensors come to the host one at a
    time and stay there until their shard is written, by process 0; every process must call this. Returns
    the files written."""
    out_dir = Path(out_dir)
    hf_config = config_to_hf(cfg, model_type)  # refuses a family that cannot hold the model before writing
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(params)}
    rows = tensors(cfg, family_of(cfg, model_type))
    whole = [(t.name, t, ()) for t in rows if not t.stacked]
    per_layer = [(name, t, index) for l in range(cfg.n_layers + cfg.mtp_depth) for t in rows
                 if t.stacked and (i := t.index_of(l)) is not None
                 for name, index in hf_names(t, {**stacked_ranges(cfg, t), "l": range(i, i + 1)})]
    parts = {}  # Hugging Face tensor → its meshpar parts (two for a FUSED one), in transformers' order:
    for name, t, index in whole[:1] + per_layer + whole[1:]:  # embedding, layer by layer, norm, head
        parts.setdefault(name, []).append((t, index))
    parts |= {copy: parts[source] for copy, source in deepseek.mtp_copies(cfg)}
    sizes = {name: sum(4 * math.prod(flat[t.path].shape[len(t.stacked):]) for t, _ in tensor)
             for name, tensor in parts.items()}
    shards, room = [], 0
    for name in parts:
        if not shards or sizes[name] > room:
            shards.append([])
            room = max_shard_bytes
        shards[-1].append(name)
        room -= sizes[name]
    files = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                    for i in range(len(shards))]
    writer = jax.process_index() == 0
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for file, shard in zip(files, shards):
        host = {}  # one shard's tensors: at most max_shard_bytes
        for name in shard:
            layers = [(t.kind, rope.pairs_from_halves(on_host(flat[t.path], index), t.rope))
                      for t, index in parts[name]]
            if writer:
                host[name] = _to_hf(*layers[0]) if len(layers) == 1 else _interleaved(layers)
        if writer:
            save_file(host, out_dir / file, metadata={"format": "pt"})  # transformers checks the format
    if len(files) > 1:
        files.append(INDEX_FILE)
        if writer:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
            (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / f for f in ("config.json", *files)]
