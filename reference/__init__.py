"""Ground truth: mask semantics, the 12 benchmark masks and pure-PyTorch attention."""

from . import masks
from .attention import reference_attention
from .mask import PARTIAL, SKIP, UNMASKED, BlockClasses, ColumnMask, Intervals

__all__ = [
    "ColumnMask",
    "Intervals",
    "BlockClasses",
    "SKIP",
    "PARTIAL",
    "UNMASKED",
    "masks",
    "reference_attention",
]
