"""flashmask3 inside training stacks.

- `flashmask3.integrations.hf`: Hugging Face transformers, `attn_implementation=hf.NAME` ("fm3")
  after `hf.register()` (imports transformers, so it is not imported here).
- `flashmask3.flashmask_attention`: PaddlePaddle's FlashMask entry point, for FlashMask users.
- `backend="cute"` runs through `torch.library` custom ops (`flashmask3.optimized.ops`), so
  `torch.compile(fullgraph=True)` keeps attention in its graph.
"""
