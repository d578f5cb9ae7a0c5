"""`DataConfig`: which corpus to load, how to pack it into rows, and how much of it to hold out."""

from __future__ import annotations

from dataclasses import dataclass

from meshpar.errors import InputError

SOURCES = ("stdlib", "text", "bin", "prepared")
PACKINGS = ("none", "concat", "best_fit", "pairs")
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class DataConfig:
    """Which token source to load and how."""

    source: str = "stdlib"
    path: str = ""
    token_dtype: str = "uint16"  # of a `bin` file; a prepared directory names its own
    max_bytes: int = 16_000_000
    eval_fraction: float = 0.01  # the held-out tail of the documents (see `split`)
    packing: str = "none"  # random windows, documents packed into rows, or DPO's pairs (`meshpar.data.packing`)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise InputError(f"unknown data source {self.source!r}; valid sources: {', '.join(SOURCES)}")
        if self.source in ("text", "bin", "prepared") and not self.path:
            raise InputError(f"data source {self.source!r} needs a path")
        if self.token_dtype not in TOKEN_DTYPES:
            raise InputError(f"token_dtype {self.token_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        if self.max_bytes <= 0:
            raise InputError(f"max_bytes must be positive, got {self.max_bytes}")
        if not 0 < self.eval_fraction < 0.5:
            raise InputError(f"data.eval_fraction = {self.eval_fraction} must be in (0, 0.5)")
        if self.packing not in PACKINGS:
            raise InputError(f"data.packing = {self.packing!r} is not one of {', '.join(PACKINGS)}")

    def describe(self) -> str:
        """The source as messages name it: `stdlib`, or the path and its kind."""
        if self.source == "stdlib":
            return "stdlib"
        kind = {"bin": f"bin, {self.token_dtype}", "text": "text", "prepared": "prepared"}[self.source]
        return f"{self.path} ({kind})"
