"""flashmask3: mask-aware attention for long-context training on Hopper GPUs.

    import flashmask3 as fm
    mask = fm.masks.build("causal_document", seqlen=8192)
    mask = fm.ColumnMask.causal_document(cu_seqlens)   # or from packing metadata
    out = fm.attention(q, k, v, mask)                  # q, k, v: [B, S, H, D]
    out = fm.attention(q, k, v, causal=True)           # FlashAttention's forms
    out = fm.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)
"""

import os as _os

# In a source checkout the subpackages live in top-level folders (reference/, optimized/, ...);
# an installed wheel maps them into this package. Make both layouts importable.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "reference", "mask.py")) and _root not in __path__:
    __path__.append(_root)

from .api import BACKENDS, attention, varlen_attention  # noqa: E402
from .reference import ColumnMask, masks  # noqa: E402

__all__ = ["attention", "varlen_attention", "ColumnMask", "masks", "BACKENDS"]
