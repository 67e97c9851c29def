"""Decoder-only Transformer assembled from the configured parts."""
import torch
from torch import Tensor, nn

from blocklab.model.attention import AttentionContext, KVCache, build_mask
from blocklab.model.block import Block
from blocklab.model.config import ModelConfig
from blocklab.model.init import apply_init
from blocklab.model.norm import build_norm, has_final_norm
from blocklab.model.position import build_position


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = build_position(cfg.pos.name, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.attn.causal,
                                  **cfg.position_options())
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        final = has_final_norm(cfg.norm.placement)
        self.final_norm = build_norm(cfg.norm.type, cfg.d_model, cfg.norm.eps, cfg.bias) if final else nn.Identity()
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        apply_init(self, cfg)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # shared (tied) tensors counted once

    def new_cache(self) -> KVCache:
        return KVCache(window=self.cfg.attn.window)

    def forward(self, idx: Tensor, positions: Tensor | None = None, valid: Tensor | None = None,
                cache: KVCache | None = None, need_weights: bool = False):
        """idx (B, T) token ids; positions (B|1, T) position ids (default: continue from the cache,
        or 0..T-1); valid (B, T) False at padding. With a cache, idx holds only the new tokens.
        Returns logits (B, T, vocab), and with need_weights also a list of per-layer (B, H, T, Tk)."""
        batch, length = idx.shape
        device = idx.device
        offset = cache.next_index if cache is not None else 0
        if positions is None:
            start = cache.positions[:, -1:] + 1 if cache is not None and cache.positions is not None else 0
            positions = start + torch.arange(length, device=device)[None]
        q_index = torch.arange(offset, offset + length, device=device)
        if cache is not None:
            positions = positions.expand(batch, length)  # the cache keeps one row per sequence
        k_index, k_positions, key_valid = q_index, positions, valid
        if cache is not None:
            if valid is None:
                valid = torch.ones(batch, length, dtype=torch.bool, device=device)
            if cache.index is not None:
                k_index = torch.cat((cache.index, q_index))
                k_positions = torch.cat((cache.positions, positions), dim=1)
                key_valid = torch.cat((cache.valid, valid), dim=1)
            else:
                key_valid = valid
        if key_valid is not None and bool(key_valid.all()):
            key_valid = None  # no padding: keep SDPA's fast causal path
        mask, is_causal = build_mask(q_index, k_index, self.cfg.attn.causal, self.cfg.attn.window,
                                     key_valid, self.pos.bias(positions, k_positions))
        ctx = AttentionContext(positions, self.pos, mask, is_causal, cache, need_weights)
        x = self.drop(self.pos.embed(self.tok_emb(idx), positions))
        for block in self.blocks:
            x = block(x, ctx)
        if cache is not None:
            cache.index, cache.positions, cache.valid = k_index, k_positions, (
                key_valid if key_valid is not None else torch.ones(batch, k_index.numel(), dtype=torch.bool, device=device))
            cache.trim()
        logits = self.head(self.final_norm(x))
        if need_weights:
            return logits, [block.attn.last_weights for block in self.blocks]
        return logits
