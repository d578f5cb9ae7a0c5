"""A model as the planner sees it: each parameter's shape and logical axes, read from the model itself.

The planner never restates the model: `Shape.of_model` builds it abstractly (nothing is allocated) and
keeps, per parameter, its shape and the logical names it declares (`embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `vocab`, `layers`, a mixture of experts' `experts`, `expert_mlp`, latent attention's
`latent`). The dimensions the formulas need are the sizes of those names: D = embed, N = heads, K = kv_heads
(latent attention: N, its keys and values expanded per head), H = head_dim (the widest: latent attention's
query and key; its narrower values are padded to it in the kernels), F = mlp, V = vocab, L = layers,
E = experts, Fe = expert_mlp. Which device holds which part of a tensor then follows from
the same rules the training step uses (`meshpar.plan.layout`). The one figure no parameter shape holds, a
mixture's k (the experts each token is routed to), is given beside them: a token computes with k of the E
experts, so its FLOPs count the experts' weights k/E times (the active parameters). So are the layers'
attention windows, which no weight shows.

Layers that differ (`layer_pattern`) stack as periods: one entry of the `layers` axis holds a period's
layers, each with its attention, a dense MLP (`mlp`) or experts. The planner's "layer" is that entry;
`period`, `mlp_layers` and `moe_layers` count what it holds, read from the weights. Leading layers that differ
(`layer_prefix`) stack apart, on `lead_layers`: `lead` counts them (with `lead_windows`, their windows); they are
no entry of `layers`, and their weights no stage splits. Multi-token prediction's modules (`model.mtp_depth`)
stack after the stack, on `mtp_layers`: `mtp` counts them; each is a layer, and runs the shared output head
once more.

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
    lead_windows: tuple[int, ...] = ()  # each prefix layer's sliding window (0: full attention); (): all full

    @classmethod
    def of(cls, abstract_params: nnx.State, experts_per_token: int = 0, windows: tuple[int, ...] = (),
           lead_windows: tuple[int, ...] = ()) -> Shape:
        """From a (possibly abstract) state of weights, trained or frozen, that declare their logical axes."""
        flat = nnx.to_flat_state(nnx.state(abstract_params, WEIGHTS))
        frozen = tuple(isinstance(v, Frozen) for _, v in flat)
        itemsize = next((np.dtype(v.dtype).itemsize for _, v in flat if isinstance(v, Frozen)), 4)
        tensors = tuple((sharding.path_name(path), tuple(v.shape), sharding.logical_axes(v, path)) for path, v in flat)
        return cls(tensors, experts_per_token, windows, frozen if any(frozen) else (), itemsize, lead_windows)

    @classmethod
    def of_model(cls, make_model: Callable[[nnx.Rngs], nnx.Module], experts_per_token: int = 0,
                 windows: tuple[int, ...] = (), lead_windows: tuple[int, ...] = ()) -> Shape:
        """From a model factory (`rngs → model`), built abstractly: nothing is allocated."""
        with nnx.use_eager_sharding(False):  # meshpar, not Flax, resolves logical names
            return cls.of(nnx.state(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))), WEIGHTS), experts_per_token,
                          windows, lead_windows)

    def __post_init__(self):
        # Derived once: the planner's search asks for them hundreds of thousands of times.
        sizes: dict[str, int] = {}
        for _, shape, names in self.tensors:
            for dim, name in zip(shape, names):
                sizes.setdefault(name, dim)
                if name == "head_dim":  # the widest: latent attention's values are narrower than its keys
                    sizes[name] = max(sizes[name], dim)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_elements", tuple((math.prod(shape), names) for _, shape, names in self.tensors))
        if self.frozen and len(self.frozen) != len(self.tensors):
            raise InputError(f"{len(self.frozen)} frozen flags for {len(self.tensors)} tensors")
        count = lambda names: sum(1 for _, _, n in self.tensors if n == names)
        object.__setattr__(self, "_counts", (max(1, count(("layers", "heads", "head_dim", "embed"))),  # attention's o
                                             count(("layers", "embed", "mlp")) // 2,  # gate and up
                                             count(("layers", "experts", "expert_embed", "expert_mlp")) // 2,
                                             # attention's output projection, one per layer of any attention
                                             count(("lead_layers", "heads", "head_dim", "embed"))
                                             * sizes.get("lead_layers", 0)))
        if self.windows and len(self.windows) != self.period:
            raise InputError(f"{len(self.windows)} windows for a period of {self.period} layers")
        if self.lead_windows and len(self.lead_windows) != self.lead:
            raise InputError(f"{len(self.lead_windows)} windows for a prefix of {self.lead} layers")
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

    @property
    def lead(self) -> int:
        """The layers before the stack (`layer_prefix`; 0: none), on their own `lead_layers` axis."""
        return self._counts[3]

    def lead_keys(self, keys: float) -> float:
        """The keys a query sees in the prefix's layers together (`attention_keys` of the stack's entry)."""
        return sum(min(keys, w) if w else keys for w in self.lead_windows or (0,) * self.lead)

    def attention_keys(self, keys: float) -> float:
        """The keys a query sees in one entry's layers together, `keys` where nothing bounds them (each
        window W: at most W)."""
        return sum(min(keys, w) if w else keys for w in self.windows or (0,) * self.period)

    @property
    def mtp(self) -> int:
        """Multi-token prediction's modules after the stack (`model.mtp_depth`; 0: none), on `mtp_layers`."""
        return self._sizes.get("mtp_layers", 0)

    @property
    def head_params(self) -> int:
        """The output head's elements (D·V: tied or not, the head matmul's weights)."""
        return self.d_model * self.vocab

    @property
    def heads(self) -> int:
        return self.size("heads")

    @property
    def kv_heads(self) -> int:
        """K; latent attention (no `kv_heads` axis: keys and values expanded from a `latent`) has one per head."""
        return self.size("kv_heads") if "kv_heads" in self._sizes or "latent" not in self._sizes else self.heads

    @property
    def head_dim(self) -> int:
        """H, a query's and a key's width: the widest `head_dim` (latent attention's values are narrower, and the
        kernels pad them to it)."""
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
        """Whether a parameter with these logical axes takes part in a matmul: it maps `embed` (an expert's
        `expert_embed`), a `latent` (latent attention's), or an unnamed axis (a LoRA adapter's rank: both A and
        B; a router's experts), to another axis (a projection, the output head); not a norm scale or a bias (an
        expert's [E, D] either), and not the embedding table unless it is the output head too (tied)."""
        if names == ("vocab", "embed"):
            return not any(other == ("embed", "vocab") for *_, other in self.tensors)
        stacked = ("layers", "lead_layers", "mtp_layers", "experts")
        return (any(n in names for n in ("embed", "expert_embed", "latent", None))
                and len([n for n in names if n not in stacked]) > 1)

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
        query sees W keys, not T. Multi-token prediction's modules are layers too, and each runs the head again."""
        layers = self.layers * self.period + self.lead + self.mtp
        keys = (self.layers * self.attention_keys(seq_len) + self.lead_keys(seq_len) + self.mtp * seq_len) / layers
        return (palm_flops_per_token(self.matmul_params + self.mtp * self.head_params, layers, self.heads,
                                     self.head_dim, keys)
                - 2 * self._matmul(frozen=True))
