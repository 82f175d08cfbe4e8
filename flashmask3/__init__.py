"""flashmask3: mask-aware attention for long-context training on Hopper GPUs.

    import flashmask3 as fm
    mask = fm.masks.build("causal_document", seqlen=8192)
    out = fm.attention(q, k, v, mask)            # q, k, v: [B, S, H, D]
"""

import os as _os

# In a source checkout the subpackages live in top-level folders (reference/, optimized/, ...);
# an installed wheel maps them into this package. Make both layouts importable.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "reference", "mask.py")) and _root not in __path__:
    __path__.append(_root)

from .api import BACKENDS, attention  # noqa: E402
from .reference import ColumnMask, masks  # noqa: E402

__all__ = ["attention", "ColumnMask", "masks", "BACKENDS"]
