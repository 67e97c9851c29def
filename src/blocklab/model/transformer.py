"""The architectures (`model.arch`), a registry: decoder-only (default), the original encoder-decoder and
encoder-only (BERT)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blocklab.model.abacus import AbacusEmbedding, abacus_size
from blocklab.model.architectures import ARCHITECTURES
from blocklab.model.block import Block
from blocklab.model.cache import DecodingCache
from blocklab.model.ffn import dropout_layer
from blocklab.model.init import apply_init
from blocklab.model.mask import AttentionContext, cross_attention_context, self_attention_context
from blocklab.model.norm import PLACEMENTS, apply_norm, build_norm, embedding_recipe
from blocklab.model.param import Readout
from blocklab.model.patterns import Pattern, build_pattern
from blocklab.model.position import build_position

if TYPE_CHECKING:
    from blocklab.model.config import ModelConfig


def _final_norm(cfg: ModelConfig) -> nn.Module:
    # Pre-norm stacks leave the residual stream unnormalized, so the output gets one last norm.
    norm = build_norm(cfg.norm.type, cfg.d_model, cfg.norm.eps, cfg.bias, cfg.norm.affine, **cfg.norm.options) \
        if PLACEMENTS[cfg.norm.placement].final_norm else None
    return nn.Identity() if norm is None else norm


def layer_patterns(cfg: ModelConfig) -> list[Pattern]:
    """Each layer's pattern, one object per distinct pattern (layers with the same share it, and its context)."""
    made, patterns = {}, []
    for layer in range(cfg.n_layers):
        attn = cfg.layer(layer).attn
        key = (attn.pattern_name, repr(sorted(attn.pattern_args.items())))
        if key not in made:
            made[key] = build_pattern(attn)
        patterns.append(made[key])
    return patterns


@ARCHITECTURES.register("decoder")
class Transformer(nn.Module):
    """Decoder-only language model."""

    is_encoder_decoder = False
    # Bidirectional over one stream: a masked-token task only (tasks check it: Task.masked).
    is_encoder_only = False
    generates = True  # continues a prompt token by token (generate, decoding speed)
    # forward(at=...) computes the output layer only at the positions given (what a masked loss reads); a model
    # without it (a plugin architecture) gives logits everywhere and the loss picks its positions from them.
    selects_positions = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        recipe = embedding_recipe(cfg.norm.type, cfg.norm.options, cfg.d_model)  # DyT's, else None
        self.emb_gain = None if recipe is None else nn.Parameter(torch.tensor(recipe[0]))
        self.pos = build_position(cfg.pos.name, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.attn.causal,
                                  **cfg.position_options())
        self.patterns = layer_patterns(cfg)  # which keys each query sees, per self-attention layer
        self.abacus = AbacusEmbedding(abacus_size(cfg.pos.abacus_offset, cfg.max_len), cfg.d_model) \
            if cfg.pos.abacus else None
        self.segment_emb: nn.Embedding | None = None  # sentence pairs: the encoder-only model's (BERT)
        self.drop = dropout_layer(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.final_norm = _final_norm(cfg)
        # The readout multiplier: 1, or under param=mup base_width / d_model (mup's MuReadout, MuSharedReadout if tied).
        self.head = Readout(cfg.d_model, cfg.vocab_size, cfg.param.rule().readout_multiplier(cfg))
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        apply_init(self, cfg)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # shared (tied) tensors counted once

    @property
    def pattern(self):
        """The first layer's pattern: every layer's, but in a hybrid stack (attn.layers)."""
        return self.patterns[0]

    def new_cache(self) -> DecodingCache:
        # Layers whose state does not grow per token (a running state) keep no keys: the cache then keeps
        # only the newest key's position. A kind that cannot decode says so at its first step, not here.
        size = next(self.parameters()).element_size()
        try:
            grows = [block.attn.state_bytes_per_token(size) > 0 for block in self.blocks]
        except NotImplementedError:
            grows = [True]
        reach = [pattern.cache_keys for pattern in self.patterns]
        # Keys older than every layer's reach are dropped from every layer's state; a fixed state (a hybrid's
        # recurrent layer) has none to drop, so a stack mixing the two keeps every key (correct, not the least).
        window = None if None in reach or not all(grows) else max(reach)
        return DecodingCache(window=window, keeps_keys=any(grows))

    def cache_bytes_per_token(self) -> int:
        """How much cached decoding state grows per generated token, over all layers."""
        size = next(self.parameters()).element_size()
        return sum(block.attn.state_bytes_per_token(size) for block in self.blocks)

    def placeholder_streams(self, idx: Tensor) -> dict[str, Tensor]:
        """Streams to time or measure the model on random tokens `idx` (costs do not depend on their values):
        digit indices of 0 for a model with Abacus embeddings, nothing otherwise."""
        return {} if self.abacus is None else {"digit_index": torch.zeros_like(idx)}

    def embed_tokens(self, idx: Tensor) -> Tensor:
        """The token embeddings of idx, times the learned gain where the norm type asks for one (DyT)."""
        tokens = self.tok_emb(idx)
        return tokens if self.emb_gain is None else tokens * self.emb_gain

    def _dropout(self, x: Tensor) -> Tensor:
        return x if self.drop is None else self.drop(x)

    def forward(self, idx: Tensor, positions: Tensor | None = None, valid: Tensor | None = None,
                cache: DecodingCache | None = None, need_weights: bool = False, digit_index: Tensor | None = None,
                at: Tensor | None = None):
        """idx (B, T) token ids; positions (B|1, T) position ids (default: continue from the cache,
        or 0..T-1); valid (B, T) False at padding. With a cache, idx holds only the new tokens.
        digit_index (B, T): each digit's index in its number, for a model with Abacus embeddings.
        Returns logits (B, T, vocab), and with need_weights also a list of per-layer (B, H, T, Tk).
        at (N,): flat indices into the B x T positions (row-major, b * T + t); the logits are then (N, vocab), the
        output layer computed at those positions only (a masked loss reads a few: MQAR's queries, copy's answers)."""
        return self._decode(idx, positions, valid, cache, need_weights, digit_index=digit_index, at=at)

    def _contexts(self, scheme, idx, positions, valid, cache, causal, need_weights) -> list[AttentionContext]:
        """Each layer's attention context: one per distinct pattern, shared by the layers that have it."""
        made = {}
        for pattern in self.patterns:
            if id(pattern) not in made:
                made[id(pattern)] = self_attention_context(idx, positions, valid, cache, scheme, causal, pattern,
                                                           need_weights)
        return [made[id(pattern)] for pattern in self.patterns]

    def _decode(self, idx, positions, valid, cache, need_weights, *cross, digit_index=None, segment=None,
                sentence=False, at=None):
        """The self-attention stack over idx (causal unless built bidirectional); `cross` = (cross-attention
        context, encoder memory) if any. segment and sentence: the encoder-only model's sentence pairs.
        at: the positions to give logits at (forward)."""
        contexts = self._contexts(self.pos, idx, positions, valid, cache, self.cfg.attn.causal, need_weights)
        tokens = self.embed_tokens(idx)
        if segment is not None:
            tokens = tokens + self.segment_emb(segment)
        x = self.pos.embed(tokens, contexts[0].positions)
        if self.abacus is not None:
            x = self.abacus(x, digit_index)
        x = self._dropout(x)
        for block, ctx in zip(self.blocks, contexts):
            x = block(x, ctx, *cross)
        if cache is not None:
            cache.commit(contexts[0].k_positions, contexts[0].k_valid)
        hidden = apply_norm(self.final_norm, x, valid)  # over every position: a norm's statistics may span tokens
        logits = softcap(self.head(hidden if at is None else hidden.flatten(0, 1).index_select(0, at)),
                         self.cfg.logit_softcap)
        if need_weights:
            return logits, [block.attn.last_weights for block in self.blocks]
        if sentence:
            return logits, self.sentence_head(hidden[:, 0])
        return logits


@ARCHITECTURES.register("encoder_decoder")
class EncoderDecoder(Transformer):
    """Vaswani et al.: a bidirectional encoder reads the source; a causal decoder with
    cross-attention writes the target. Token embeddings (and the output head) are shared."""

    is_encoder_decoder = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)  # the decoder: embeddings, causal blocks, head
        self.blocks = nn.ModuleList(Block(cfg, layer, cross=True) for layer in range(cfg.n_layers))
        self.enc_pos = build_position(cfg.pos.name, cfg.d_model, cfg.n_heads, cfg.d_head, False,
                                      **cfg.position_options())
        self.encoder = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.enc_norm = _final_norm(cfg)
        apply_init(self, cfg)

    def encode(self, source: Tensor, source_valid: Tensor | None = None, need_weights: bool = False) -> Tensor:
        """Bidirectional pass over right-padded sources (padding is never attended to)."""
        contexts = self._contexts(self.enc_pos, source, None, source_valid, None, False, need_weights)
        x = self._dropout(self.enc_pos.embed(self.embed_tokens(source), contexts[0].positions))
        for block, ctx in zip(self.encoder, contexts):
            x = block(x, ctx)
        return apply_norm(self.enc_norm, x, source_valid)

    def forward(self, idx: Tensor, positions: Tensor | None = None, valid: Tensor | None = None,
                cache: DecodingCache | None = None, need_weights: bool = False, source: Tensor | None = None,
                source_valid: Tensor | None = None, at: Tensor | None = None):
        """As the decoder-only forward, plus the source; with a cache the source is encoded once."""
        if cache is not None and cache.memory is not None:
            memory, source_valid = cache.memory, cache.memory_valid
        else:
            memory = self.encode(source, source_valid)
            if cache is not None:
                cache.memory, cache.memory_valid = memory, source_valid
        cross_ctx = cross_attention_context(memory, source_valid, self.pos, cache, need_weights)
        return self._decode(idx, positions, valid, cache, need_weights, cross_ctx, memory, at=at)


@ARCHITECTURES.register("encoder")
class Encoder(Transformer):
    """Encoder-only (BERT: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for
    Language Understanding", NAACL): the decoder-only stack with every self-attention layer bidirectional,
    so each position attends to every position of its sequence, later ones included, and the output head
    gives a distribution over the vocabulary at every position (the masked-LM head, tied to the token
    embeddings as in BERT; BERT's extra dense+LayerNorm transform before it is left out). It is built
    with attn.causal=false whatever the config says, so the position scheme, the attention kind and the
    pattern all take their non-causal form; it trains on a masked task (task=mlm) and does not generate."""

    is_encoder_only = True
    generates = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, causal=False)))
        if cfg.segments:
            # Sentence pairs (BERT section 3.1, task #2, next-sentence prediction): a learned segment embedding
            # summed with each token's, and the final state of the first token ([CLS]) pooled (dense + tanh, as
            # BERT's pooler) and classified: is the second sentence the one that followed the first?
            self.segment_emb = nn.Embedding(cfg.segments, cfg.d_model)
            self.sentence_head = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.Tanh(),
                                               nn.Linear(cfg.d_model, 2))
            apply_init(self, self.cfg)  # the new layers get the configured init too

    def forward(self, idx: Tensor, positions: Tensor | None = None, valid: Tensor | None = None,
                cache: DecodingCache | None = None, need_weights: bool = False, digit_index: Tensor | None = None,
                segment: Tensor | None = None, sentence: bool = False, at: Tensor | None = None):
        """As the decoder-only forward, plus, for a model built for sentence pairs: segment (B, T), each token's
        sentence (0: first, 1: second); with sentence=True also the next-sentence logits (B, 2) (index 1: is next)."""
        return self._decode(idx, positions, valid, cache, need_weights, digit_index=digit_index, segment=segment,
                            sentence=sentence, at=at)


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(logits / cap): Gemma 2's soft-capping (Gemma Team 2024, "Gemma 2: Improving Open Language Models
    at a Practical Size", §2; google-deepmind/gemma, gemma/modules.py and transformer.py: final_logit_softcap 30,
    attn_logits_soft_cap 50), bounding every logit to (-cap, cap) while leaving small ones almost unchanged."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def build_model(cfg: ModelConfig) -> Transformer:
    return ARCHITECTURES[cfg.arch](cfg)
