"""Adding a component is one registry entry + one yaml: a position scheme and an attention kind defined
here, at run time, train end to end, show up in the sweeps over their group and are validated by the
options they declare. And no code outside a registry names a variant to decide what to do."""
import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from omegaconf import OmegaConf

from blocklab.model import ModelConfig, build_model
from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.cache import KVState
from blocklab.model.config import AttnConfig, PosConfig
from blocklab.model.ffn import ACTIVATIONS
from blocklab.model.init import INIT_SCHEMES
from blocklab.model.norm import NORM_TYPES, PLACEMENTS
from blocklab.model.patterns import ATTENTION_PATTERNS
from blocklab.model.position import POSITION_SCHEMES, PositionScheme
from blocklab.model.transformer import ARCHITECTURES
from blocklab.results import read_results
from blocklab.tasks import TASKS
from conftest import CONF, FAST, run_in_process
from helpers import refused

SRC = Path(__file__).resolve().parents[1] / "src" / "blocklab"


class Ramp(PositionScheme):
    """A throwaway absolute scheme: adds slope * position to every embedding channel."""

    def __init__(self, d_model, n_heads, d_head, causal=True, slope: float = 0.01):
        super().__init__(d_model, n_heads, d_head, causal)
        self.slope = slope

    @classmethod
    def errors(cls, cfg, options):
        return [] if options["slope"] > 0 else [f"pos.slope={options['slope']} must be positive"]

    def embed(self, x, positions):
        return x + self.slope * positions[..., None].to(x.dtype)


class UniformAttention(Attention):
    """A throwaway kind: each query averages the values of every key it may see (all scores equal)."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 mix: float = 1.0):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        self.mix = mix

    def state_bytes_per_token(self, element_size):
        return 2 * self.n_kv_heads * self.d_head * element_size

    def new_state(self):
        return KVState()

    def attend(self, q, k, v, ctx, state):
        if state is not None:
            k, v = state.extend(k, v)
        mask = None if ctx.mask is None else ctx.mask.to(q.dtype)
        if ctx.need_weights:  # analysis: the (B, H, Tq, Tk) weights, written out
            scores = torch.zeros(*q.shape[:3], k.shape[2], dtype=q.dtype)
            if ctx.is_causal:
                scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            self.last_weights = (scores if mask is None else scores + mask).softmax(-1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            return self.mix * (self.last_weights @ v)
        y = F.scaled_dot_product_attention(torch.zeros_like(q), k, v, attn_mask=mask, is_causal=ctx.is_causal,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.mix * y


@pytest.fixture
def plugins(tmp_path):
    """Register both at run time, with their yaml in a config dir of their own (Hydra's search path)."""
    POSITION_SCHEMES.register("ramp")(Ramp)
    ATTENTION_KINDS.register("uniform")(UniformAttention)
    conf = tmp_path / "plugin_conf"
    (conf / "pos").mkdir(parents=True)
    (conf / "attn").mkdir()
    (conf / "pos" / "ramp.yaml").write_text("name: ramp\nslope: 0.01\n")
    (conf / "attn" / "uniform.yaml").write_text("defaults:\n  - mha\n  - _self_\nkind: uniform\nmix: 1.0\n")
    yield [f"hydra.searchpath=[file://{conf}]"]
    POSITION_SCHEMES.unregister("ramp")
    ATTENTION_KINDS.unregister("uniform")


def test_uniform_kind_averages_the_visible_values():
    """The math of the test kind itself, so the end-to-end test below trains what it claims."""
    ATTENTION_KINDS.register("uniform")(UniformAttention)
    try:
        cfg = ModelConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, attn=AttnConfig(kind="uniform"),
                          pos=PosConfig("none"))
        assert cfg.errors() == [] and cfg.attn_label == "uniform"
        model = build_model(cfg).double().eval()
        attn = model.blocks[0].attn
        x = torch.randn(1, 5, 16, dtype=torch.float64)
        v = F.linear(x, *attn.projection("v")).view(1, 5, 2, 8).transpose(1, 2)
        expected = v.cumsum(2) / torch.arange(1, 6, dtype=torch.float64)[:, None]
        from blocklab.model.mask import self_attention_context
        ctx = self_attention_context(torch.zeros(1, 5, dtype=torch.long), None, None, None, model.pos, True, None)
        out = attn(x, ctx)
        torch.testing.assert_close(out, attn.out_proj(expected.transpose(1, 2).flatten(2)))
    finally:
        ATTENTION_KINDS.unregister("uniform")


@pytest.mark.parametrize("choice", [["pos=ramp"], ["attn=uniform"], ["pos=ramp", "attn=uniform", "task=addition"]])
def test_runtime_plugins_train_end_to_end(plugins, choice, run_dir):
    run_in_process([*FAST, *plugins, *choice], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["steps"] == 20
    picked = results["choices"]
    assert picked["pos"] == ("ramp" if "pos=ramp" in choice else "rope")
    assert picked["attn"] == ("uniform" if "attn=uniform" in choice else "mha")
    assert results["decode"]["kv_cache_bytes_per_token"] > 0


def group_options(plugins: list[str], override: str) -> list[str]:
    """What Hydra's sweeper expands `override` to (glob included), with the plugin conf on the search path."""
    search_path = create_config_search_path(str(CONF))
    search_path.append("plugins", plugins[0].split("[", 1)[1].rstrip("]"))
    parser = OverridesParser.create(config_loader=ConfigLoaderImpl(config_search_path=search_path))
    return list(parser.parse_overrides([override])[0].sweep_string_iterator())


def test_runtime_plugins_appear_in_the_sweeps_over_their_group(plugins):
    sweep = OmegaConf.load(CONF / "sweep" / "pe_copy.yaml")["hydra"]["sweeper"]["params"]
    schemes = group_options(plugins, f"pos={sweep['pos']}")
    assert "ramp" in schemes and set(POSITION_SCHEMES.names()) <= set(schemes)
    assert "uniform" in group_options(plugins, "attn=glob(*)")


@pytest.mark.parametrize("override, message", [
    ("pos.slope=fast", "pos.slope='fast' must be a number"),
    ("+pos.slop=1", "pos.slop is not an option of pos.name=ramp; did you mean pos.slope? its options are ['slope']"),
    ("pos.slope=-1", "pos.slope=-1 must be positive"),
    ("+attn.mixx=2", "attn.mixx is not an option of attn.kind=uniform; did you mean attn.mix? its options are ['mix']"),
    ("attn.mix=yes", "attn.mix='yes' must be a number"),
])
def test_runtime_plugins_are_validated_by_their_declared_options(plugins, override, message, run_dir):
    choice = ["pos=ramp"] if override.lstrip("+").startswith("pos") else ["attn=uniform"]
    with refused(message, run_dir) as err:
        run_in_process([*FAST, *plugins, *choice, override], run_dir)
    assert str(err.value) == message


# ------------------------------------------------------------------ no variant names outside registries

REGISTRIES = [POSITION_SCHEMES, ATTENTION_KINDS, ATTENTION_PATTERNS, NORM_TYPES, PLACEMENTS, ACTIVATIONS, INIT_SCHEMES,
              ARCHITECTURES, TASKS]
# Expressions that hold a variant's name: config fields and the usual local names for them.
NAME_HOLDERS = {"name", "kind", "arch", "placement", "type", "norm_type", "scheme_name", "pos", "act", "attn", "init",
                "task", "variant", "scheme", "pattern", "pattern_name"}


def _holds_a_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in NAME_HOLDERS
    if isinstance(node, ast.Name):
        return node.id in NAME_HOLDERS
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value in NAME_HOLDERS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value in NAME_HOLDERS
    return False


def _literals(node: ast.expr) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def name_comparisons(source: str, variant_names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every comparison of a name-holding expression with a variant name literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = any(_holds_a_name(o) for o in operands)
            if named and any(_literals(o) & variant_names for o in operands):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_checker_finds_what_it_looks_for():
    names = {"alibi", "pre", "encoder_decoder"}
    code = ("if cfg.pos.name in ('alibi', 't5_bias'): pass\nif placement == 'pre': pass\n"
            "if groups['model'].get('arch') != 'encoder_decoder': pass\nif status == 'failed': pass\n")
    assert [line for line, _ in name_comparisons(code, names)] == [1, 2, 3]


def test_no_module_compares_a_variant_name_to_a_string():
    variant_names = {name for registry in REGISTRIES for name in registry}
    offenders = [f"{path.relative_to(SRC)}:{line}: {code}" for path in sorted(SRC.rglob("*.py"))
                 for line, code in name_comparisons(path.read_text(), variant_names)]
    assert offenders == []
