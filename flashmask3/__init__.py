"""flashmask3: mask-aware attention for long-context training on Hopper GPUs.

import flashmask3 as fm
mask = fm.masks.build("causal_document", seqlen=8192)
mask = fm.ColumnMask.causal_document(cu_seqlens)   # or from packing metadata
out = fm.attention(q, k, v, mask)                  # q, k, v: [B, S, H, D]
out = fm.attention(q, k, v, causal=True)           # FlashAttention's forms
out = fm.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)
out = fm.flashmask_attention(q, k, v, startend_row_indices, causal=True)  # PaddlePaddle's form
mask = fm.prepare_mask(host_mask, "cuda", batch=1, q_heads=16, kv_heads=4, head_dim=128)  # data loader
"""

from .api import BACKENDS, attention, varlen_attention
from .integrations.paddle import flashmask_attention
from .optimized.plans import prepare_mask
from .reference import ColumnMask, masks

__all__ = ["attention", "varlen_attention", "flashmask_attention", "prepare_mask", "ColumnMask", "masks", "BACKENDS"]
