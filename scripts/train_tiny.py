"""Train a tiny transformer on packed documents with a chosen attention backend.

    python scripts/train_tiny.py --backend reference --steps 20
    python scripts/train_tiny.py --backend cute --compare reference --device cuda   # on a Hopper GPU

Each step packs random "documents" (sequences of a repeating pattern per document, so the task is
learnable only by attending inside the document) into one sequence with a causal-document mask,
and trains next-token prediction. `--compare` trains a second model from the same initialization
with another backend and reports the largest loss difference along the curve.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from flashmask3.reference import ColumnMask

import flashmask3 as fm


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, backend: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.backend = heads, kv_heads, dim // heads, backend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: ColumnMask) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        x = x + self.proj(fm.attention(q, k, v, mask, backend=self.backend).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, backend: str, seqlen: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seqlen, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, backend) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, mask: ColumnMask) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def packed_batch(gen: torch.Generator, batch: int, seqlen: int, vocab: int, device) -> tuple[torch.Tensor, ColumnMask]:
    """Documents of random lengths, each repeating its own random period-4 pattern."""
    tokens = torch.empty(batch, seqlen, dtype=torch.long)
    ends = torch.empty(batch, seqlen, dtype=torch.int32)
    for b in range(batch):
        pos = 0
        while pos < seqlen:
            length = min(int(torch.randint(16, seqlen // 2, (1,), generator=gen)), seqlen - pos)
            pattern = torch.randint(0, vocab, (4,), generator=gen)
            tokens[b, pos : pos + length] = pattern.repeat(length // 4 + 1)[:length]
            ends[b, pos : pos + length] = pos + length
            pos += length
    mask = ColumnMask(ends.view(batch, 1, seqlen, 1).contiguous(), True, seqlen, segmented=True)
    return tokens.to(device), mask.to(device)


def train(backend: str, steps: int, seed: int, device: str, dtype: torch.dtype, args) -> list[float]:
    torch.manual_seed(seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, backend, args.seqlen)
    model = model.to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        tokens, mask = packed_batch(gen, args.batch, args.seqlen, args.vocab, device)
        logits = model(tokens[:, :-1], _drop_last_row(mask))
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _drop_last_row(mask: ColumnMask) -> ColumnMask:
    """The mask of the first S-1 tokens (inputs of next-token prediction)."""
    idx = mask.startend_row_indices[:, :, :-1].clamp(max=mask.seqlen_q - 1)
    return ColumnMask(idx.contiguous(), mask.causal, mask.seqlen_q - 1, mask.segmented)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference", choices=fm.BACKENDS)
    parser.add_argument("--compare", default=None, choices=fm.BACKENDS, help="a second backend from the same start")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seqlen", type=int, default=257)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        cuda = torch.device(args.device).type == "cuda"
    except RuntimeError:
        parser.error(f"--device must be cpu or cuda (or cuda:N), got {args.device!r}")
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but torch {torch.__version__} sees no CUDA GPU: use --device cpu")
    if "cute" in (args.backend, args.compare) and not cuda:
        parser.error("the cute backend runs on a Hopper GPU (sm_90): add --device cuda")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    result = {"backend": args.backend, "losses": train(args.backend, args.steps, args.seed, args.device, dtype, args)}
    line = f"{args.backend}: loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}"
    if args.compare:
        other = train(args.compare, args.steps, args.seed, args.device, dtype, args)
        result |= {
            "compare": args.compare,
            "compare_losses": other,
            "max_loss_diff": max(abs(a - b) for a, b in zip(result["losses"], other)),
        }
        line += f"; {args.compare}: {other[0]:.3f} -> {other[-1]:.3f}; max |diff| {result['max_loss_diff']:.2e}"
    print(line)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
