"""Ground truth: mask semantics, the masks row by row, the 12 benchmark masks and pure-PyTorch attention."""

from . import masks
from .attention import reference_attention
from .mask import PARTIAL, SKIP, UNMASKED, BlockClasses, ColumnMask, Intervals
from .row_intervals import IntervalLimitError, row_intervals

__all__ = [
    "ColumnMask",
    "Intervals",
    "BlockClasses",
    "SKIP",
    "PARTIAL",
    "UNMASKED",
    "masks",
    "reference_attention",
    "row_intervals",
    "IntervalLimitError",
]
