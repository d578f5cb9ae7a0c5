"""A model as the planner sees it: each parameter's shape and logical axes, read from the model itself.

The planner never restates the model: `Shape.of_model` builds it abstractly (nothing is allocated) and
keeps, per parameter, its shape and the logical names it declares (`embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `vocab`, `layers`, and a mixture of experts' `experts`, `expert_mlp`). The dimensions the
formulas need are the sizes of those names: D = embed, N = heads, K = kv_heads, H = head_dim, F = mlp, V =
vocab, L = layers, E = experts, Fe = expert_mlp. Which device holds which part of a tensor then follows from
the same rules the training step uses (`meshpar.plan.layout`). The one figure no parameter shape holds, a
mixture's k (the experts each token is routed to), is given beside them: a token computes with k of the E
experts, so its FLOPs count the experts' weights k/E times (the active parameters). So are the layers'
attention windows, which no weight shows.

Layers that differ (`layer_pattern`) stack as periods: one entry of the `layers` axis holds a period's
layers, each with its attention, a dense MLP (`mlp`) or experts. The planner's "layer" is that entry;
`period`, `mlp_layers` and `moe_layers` count what it holds, read from the weights.

Frozen weights (a LoRA run's base, `meshpar.frozen`) are tensors like the others, marked `frozen`, held in
`frozen_bytes` per element: they take no gradient and no optimizer state, and their matmuls no weight-gradient
FLOPs (4 per parameter and token, not 6); the adapters are trained tensors of their own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from flax import nnx

import numpy as np

from meshpar import sharding
from meshpar.frozen import WEIGHTS, Frozen
from meshpar.errors import InputError
from meshpar.mfu import palm_flops_per_token

Tensor = tuple[str, tuple[int, ...], tuple[str | None, ...]]  # (path, shape, logical axes)


@dataclasses.dataclass(frozen=True)
class Shape:
    tensors: tuple[Tensor, ...]
    experts_per_token: int = 0  # k of a mixture of experts (not read for a dense model)
    windows: tuple[int, ...] = ()  # each layer of a period's sliding window (0: full attention); (): all full
    frozen: tuple[bool, ...] = ()  # per tensor, whether it is frozen (module docstring); (): none is
    frozen_bytes: int = 4  # bytes per element of a frozen tensor

    @classmethod
    def of(cls, abstract_params: nnx.State, experts_per_token: int = 0, windows: tuple[int, ...] = ()) -> Shape:
        """From a (possibly abstract) state of weights, trained or frozen, that declare their logical axes."""
        flat = nnx.to_flat_state(nnx.state(abstract_params, WEIGHTS))
        frozen = tuple(isinstance(v, Frozen) for _, v in flat)
        itemsize = next((np.dtype(v.dtype).itemsize for _, v in flat if isinstance(v, Frozen)), 4)
        tensors = tuple((sharding.path_name(path), tuple(v.shape), sharding.logical_axes(v, path)) for path, v in flat)
        return cls(tensors, experts_per_token, windows, frozen if any(frozen) else (), itemsize)

    @classmethod
    def of_model(cls, make_model: Callable[[nnx.Rngs], nnx.Module], experts_per_token: int = 0,
                 windows: tuple[int, ...] = ()) -> Shape:
        """From a model factory (`rngs → model`), built abstractly: nothing is allocated."""
        with nnx.use_eager_sharding(False):  # meshpar, not Flax, resolves logical names
            return cls.of(nnx.state(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))), WEIGHTS), experts_per_token,
                          windows)

    def __post_init__(self):
        # Derived once: the planner's search asks for them hundreds of thousands of times.
        sizes: dict[str, int] = {}
        for _, shape, names in self.tensors:
            for dim, name in zip(shape, names):
                sizes.setdefault(name, dim)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_elements", tuple((math.prod(shape), names) for _, shape, names in self.tensors))
        if self.frozen and len(self.frozen) != len(self.tensors):
            raise InputError(f"{len(self.frozen)} frozen flags for {len(self.tensors)} tensors")
        count = lambda names: sum(1 for _, _, n in self.tensors if n == names)
        object.__setattr__(self, "_counts", (max(1, count(("layers", "embed", "heads", "head_dim"))),
                                             count(("layers", "embed", "mlp")) // 2,  # gate and up
                                             count(("layers", "experts", "embed", "expert_mlp")) // 2))
        if self.windows and len(self.windows) != self.period:
            raise InputError(f"{len(self.windows)} windows for a period of {self.period} layers")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise InputError(f"the model has {self.experts} experts (its 'experts' axis): give experts_per_token, the "
                             f"experts each token is routed to, between 1 and {self.experts} (got "
                             f"{self.experts_per_token})")

    def size(self, logical: str) -> int:
        """The size of the logical axis `logical` (1 if no parameter names it)."""
        return self._sizes.get(logical, 1)

    @property
    def vocab(self) -> int:
        return self.size("vocab")

    @property
    def d_model(self) -> int:
        return self.size("embed")

    @property
    def layers(self) -> int:
        return self.size("layers")

    @property
    def period(self) -> int:
        """The layers one entry of the `layers` axis holds (a `layer_pattern`'s period; 1: all alike)."""
        return self._counts[0]

    @property
    def mlp_layers(self) -> int:
        """Of those, the layers with an `mlp`-wide MLP: dense ones, or a mixture's shared experts."""
        return self._counts[1]

    @property
    def moe_layers(self) -> int:
        """Of those, the layers with experts."""
        return self._counts[2]

    def attention_keys(self, keys: float) -> float:
        """The keys a query sees in one entry's layers together, `keys` where nothing bounds them (each
        window W: at most W)."""
        return sum(min(keys, w) if w else keys for w in self.windows or (0,) * self.period)

    @property
    def heads(self) -> int:
        return self.size("heads")

    @property
    def kv_heads(self) -> int:
        return self.size("kv_heads")

    @property
    def head_dim(self) -> int:
        return self.size("head_dim")

    @property
    def d_ff(self) -> int:
        """The dense MLP's width (a mixture's shared experts'; 0 where no parameter names `mlp`)."""
        return self._sizes.get("mlp", 0)

    @property
    def experts(self) -> int:
        """E: a mixture's experts per layer (0: a dense model)."""
        return self._sizes.get("experts", 0)

    @property
    def expert_width(self) -> int:
        """Fe: an expert's SwiGLU width (0: a dense model)."""
        return self._sizes.get("expert_mlp", 0)

    def elements(self) -> tuple[tuple[int, tuple[str | None, ...]], ...]:
        """(elements, logical axes) of every parameter, stacked layer tensors whole."""
        return self._elements

    def is_frozen(self, i: int) -> bool:
        """Whether tensor `i` (of `tensors`) is frozen."""
        return bool(self.frozen) and self.frozen[i]

    @property
    def params(self) -> int:
        return sum(n for n, _ in self.elements())

    @property
    def trained_params(self) -> int:
        return sum(n for i, (n, _) in enumerate(self.elements()) if not self.is_frozen(i))

    @property
    def layer_params(self) -> int:
        return sum(n for n, names in self.elements() if "layers" in names) // self.layers

    def is_matmul(self, names: tuple[str | None, ...]) -> bool:
        """Whether a parameter with these logical axes takes part in a matmul: it maps `embed`, or an unnamed
        axis (a LoRA adapter's rank: both A and B; a router's experts), to another axis (a projection, the output
        head); not a norm scale or a bias (an expert's [E, D] either), and not the embedding table unless it is
        the output head too (tied)."""
        if names == ("vocab", "embed"):
            return not any(other == ("embed", "vocab") for *_, other in self.tensors)
        return ("embed" in names or None in names) and len([n for n in names if n not in ("layers", "experts")]) > 1

    def _matmul(self, frozen: bool | None = None) -> int:
        """Parameters that take part in a token's matmuls (of the experts, the k active); only the frozen (True)
        or trained (False) ones where asked."""
        return sum(n * self.experts_per_token // self.experts if "experts" in names else n
                   for i, (n, names) in enumerate(self.elements())
                   if self.is_matmul(names) and frozen in (None, self.is_frozen(i)))

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a token's matmuls (`is_matmul`; of the experts, the k active): PaLM's N."""
        return self._matmul()

    def model_flops_per_token(self, seq_len: int) -> float:
        """PaLM's 6Ψ + 12·L·N·H·T (`meshpar.mfu`), less a frozen weight's gradient (2 per parameter: its
        matmuls run forward and for their input's gradient only); in a layer with a sliding window W < T, each
        query sees W keys, not T."""
        keys = self.attention_keys(seq_len) / self.period  # a layer's on average
        return (palm_flops_per_token(self.matmul_params, self.layers * self.period, self.heads, self.head_dim, keys)
                - 2 * self._matmul(frozen=True))
