"""DyT (norm.type=dyt) against its authors' code: jiachenzhu/DyT, dynamic_tanh.py (MIT), whose `DynamicTanh` is
written out below for channels-last inputs, as the oracle."""
import dataclasses

import pytest
import torch
from torch import nn

from blocklab.model.config import ModelConfig
from blocklab.model.norm import build_norm
from blocklab.model.transformer import build_model


class ReferenceDynamicTanh(nn.Module):
    """jiachenzhu/DyT dynamic_tanh.py, DynamicTanh with channels_last=True."""

    def __init__(self, normalized_shape, alpha_init_value=0.5):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1) * alpha_init_value)
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        x = torch.tanh(self.alpha * x)
        return x * self.weight + self.bias


@pytest.mark.parametrize("alpha_init", [0.5, 0.05, 2.0])
def test_dyt_matches_the_reference_with_the_same_parameters(alpha_init):
    ours = build_norm("dyt", 8, alpha_init=alpha_init)
    reference = ReferenceDynamicTanh(8, alpha_init)
    torch.testing.assert_close(ours.alpha, reference.alpha)  # the same start
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (reference.weight, reference.bias):
            p.copy_(torch.randn(p.shape, generator=g))
        ours.weight.copy_(reference.weight)
        ours.bias.copy_(reference.bias)
    x = 3 * torch.randn(2, 5, 8, generator=g)
    torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=0)


def test_dyt_by_hand():
    """alpha 0.5, gain 2, shift 1: x = 2 gives 2 tanh(1) + 1 = 2.523188..."""
    norm = build_norm("dyt", 1)
    with torch.no_grad():
        norm.weight.fill_(2.0)
        norm.bias.fill_(1.0)
    assert norm(torch.tensor([[2.0]])).item() == pytest.approx(2 * 0.7615941559557649 + 1)


def test_without_affine_or_bias_dyt_keeps_only_alpha():
    assert [n for n, _ in build_norm("dyt", 4, affine=False).named_parameters()] == ["alpha"]
    assert [n for n, _ in build_norm("dyt", 4, bias=False).named_parameters()] == ["alpha", "weight"]


def groups(**norm) -> dict:
    return {"model": {}, "norm": norm, "act": {}, "init": {}, "attn": {}, "pos": {"name": "rope"}}


def test_every_norm_of_the_stack_is_dyt_with_the_configured_start():
    cfg = ModelConfig.from_groups(groups(type="dyt", alpha_init=0.2), vocab_size=16, max_len=32)
    assert cfg.errors() == []
    model = build_model(cfg)
    norms = [m for m in model.modules() if type(m).__name__ == "DynamicTanh"]
    assert len(norms) == 2 * cfg.n_layers + 1  # each sublayer's input, and the final norm of the pre-LN stack
    assert all(m.alpha.item() == pytest.approx(0.2) for m in norms)
    assert not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in model.modules())


def test_an_option_the_norm_type_does_not_take_is_one_line():
    errors = ModelConfig.from_groups(groups(type="layernorm", alpha_init=0.5), vocab_size=16, max_len=32).errors()
    assert len(errors) == 1 and errors[0].startswith("norm.alpha_init is not a key of norm")
    wrong = ModelConfig.from_groups(groups(type="dyt", alpha_init="big"), vocab_size=16, max_len=32).errors()
    assert len(wrong) == 1 and "norm.alpha_init" in wrong[0]


def test_dyt_embeds_tokens_as_the_authors_llama_code_does():
    """jiachenzhu/DyT other_tasks/LLaMA/fms_fsdp/models/llama.py: `x_in = self.shared(x_in) * self.shared_scale`,
    shared_scale one parameter filled with sqrt(emb_dim), and fms's WordEmbedding initialised at std emb_dim^-1/2."""
    cfg = ModelConfig.from_groups(groups(type="dyt"), vocab_size=512, max_len=32)
    model = build_model(cfg)
    assert model.emb_gain.shape == () and model.emb_gain.item() == pytest.approx(cfg.d_model ** 0.5)
    assert model.tok_emb.weight.std().item() == pytest.approx(cfg.d_model ** -0.5, rel=0.05)
    idx = torch.randint(0, 512, (2, 7))
    shared_scale = torch.full((1,), cfg.d_model ** 0.5)
    torch.testing.assert_close(model.embed_tokens(idx), model.tok_emb(idx) * shared_scale)
    assert any(p is model.emb_gain for p in model.parameters())  # learned


def test_without_the_embedding_gain_dyt_keeps_the_schemes_embeddings():
    cfg = ModelConfig.from_groups(groups(type="dyt", embedding_gain=False), vocab_size=512, max_len=32)
    model = build_model(cfg)
    assert model.emb_gain is None
    assert model.tok_emb.weight.std().item() == pytest.approx(cfg.init.std, rel=0.05)
    assert build_model(ModelConfig.from_groups(groups(type="layernorm"), vocab_size=16, max_len=32)).emb_gain is None


def test_a_dyt_run_saved_before_the_gain_existed_reads_without_it():
    saved = dataclasses.asdict(ModelConfig.from_groups(groups(type="dyt", alpha_init=0.5), vocab_size=16, max_len=32))
    assert saved["norm"]["options"] == {"alpha_init": 0.5, "embedding_gain": True}  # a new run records it
    saved["norm"]["options"] = {"alpha_init": 0.5}
    assert ModelConfig.from_dict(saved).norm.options["embedding_gain"] is False
    assert build_model(ModelConfig.from_dict(saved)).emb_gain is None


def _bigram_loss_after(norm: dict, steps: int) -> float:
    """A decoder trained on a deterministic bigram chain (next = 3 * token + 1 mod 50): a model whose output
    depends on its input gets far below the uniform loss ln 50 = 3.91; one whose final DyT saturates cannot."""
    cfg = ModelConfig.from_groups({**groups(**norm), "model": {"d_model": 32, "n_heads": 2, "n_layers": 2}},
                                  vocab_size=64, max_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        seq = [torch.randint(0, 50, (16, 1), generator=g)]
        for _ in range(16):
            seq.append((seq[-1] * 3 + 1) % 50)
        x = torch.cat(seq, 1)
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def test_dyt_with_the_authors_embeddings_learns_where_the_bare_layer_does_not():
    """The defect the recipe fixes: with std-0.02 embeddings every DyT input is ~0.01, and after 80 steps the bare
    layer has learned nothing about the input (loss at ln 50); with the authors' embeddings it has."""
    assert _bigram_loss_after({"type": "dyt"}, 80) < 1.5
    assert _bigram_loss_after({"type": "dyt", "embedding_gain": False}, 80) > 3.0  # measured 3.5; ln 50 = 3.9
