"""A scripted list of bad inputs to `python train.py`, one per problem a user can type: misspelled keys, groups
and options, values of the wrong type, out of range or not finite, each position scheme's, attention kind's, norm's,
FFN's and task's own options, sizes that cannot be allocated, and whole-command mistakes (a key set twice, a sweep
without -m, a folder Hydra cannot create, a ${...} that does not resolve). Each must end the same way: exit 2,
exactly one line on stderr starting "error: " and naming a key the command set, no traceback, and no run or sweep
folder. The full list (about 220 commands, a second or two each) is `-m slow`; REPRESENTATIVE runs by default.

Run it as a script for a table of every command's outcome: `python tests/test_bad_input_list.py`."""
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest's helpers when run as a script
from conftest import run_cli  # noqa: E402

# (key group, the command's arguments); {blocker} is a file standing where a folder's parent should be.
CASES = [
    # typo
    ('typo', 'model.dmodel=64'),
    ('typo', 'nrom=pre_ln'),
    ('typo', 'norm=post_layernorm'),
    ('typo', 'pos=rop'),
    ('typo', 'attn=mhaa'),
    ('typo', 'act=gelo'),
    ('typo', 'ffn=denze'),
    ('typo', 'init=norml'),
    ('typo', 'task=cpy'),
    ('typo', 'optim=adam'),
    ('typo', 'trainer=gpuu'),
    ('typo', 'logger=wandbb'),
    ('typo', 'diagnostics=ful'),
    ('typo', 'method=rop'),
    ('typo', 'experiment=nano'),
    ('typo', 'optim.lrr=0.001'),
    ('typo', 'trainer.max_step=5'),
    ('typo', 'task.max_lenn=3'),
    ('typo', 'pos.bas=10'),
    ('typo', 'attn.windw=4'),
    ('typo', 'norm.epss=0.1'),
    ('typo', 'seedd=1'),
    ('typo', '+modle.x=1'),
    ('typo', '~model.dmodel'),
    ('typo', 'hydra/launcher=jobib'),
    ('typo', 'attn.kind=sofmax'),
    ('typo', 'attn.pattern=windoww'),
    ('typo', 'norm.type=layernrom'),
    ('typo', 'norm.placement=prre'),
    ('typo', 'act.name=gelo'),
    ('typo', 'init.name=norml'),
    ('typo', 'model.arch=decodr'),
    ('typo', 'logger.mode=onlin'),
    ('typo', 'trainer.accelerator=gpuu'),
    # type
    ('type', 'model.d_model=abc'),
    ('type', 'model.d_model=1.5'),
    ('type', 'model.n_layers=true'),
    ('type', 'model.dropout=abc'),
    ('type', 'model.bias=maybe'),
    ('type', 'optim.lr=abc'),
    ('type', 'optim.betas=abc'),
    ('type', 'optim.betas=[a,b]'),
    ('type', 'trainer.max_steps=1.5'),
    ('type', 'trainer.precision=16'),
    ('type', 'trainer.devices=abc'),
    ('type', 'task.max_len=abc'),
    ('type', 'task.batch_size=2.5'),
    ('type', 'task.eval_lengths=abc'),
    ('type', 'task.eval_lengths=[a]'),
    ('type', 'pos.base=abc'),
    ('type', 'attn.causal=abc'),
    ('type', 'attn.window=abc'),
    ('type', 'attn.scale=abc'),
    ('type', 'norm.eps=abc'),
    ('type', 'norm.affine=abc'),
    ('type', 'act=swiglu act.match_params=abc'),
    ('type', 'init.std=abc'),
    ('type', 'seed=abc'),
    ('type', 'seed=1.5'),
    ('type', 'max_loss=abc'),
    ('type', 'checkpoint_every=abc'),
    ('type', 'resume=abc'),
    ('type', 'diagnostics.every_n_steps=abc'),
    ('type', 'target_loss=abc'),
    ('type', 'study=abc'),
    ('type', 'model=abc'),
    # range
    ('range', 'model.d_model=0'),
    ('range', 'model.d_model=-8'),
    ('range', 'model.n_layers=0'),
    ('range', 'model.n_heads=0'),
    ('range', 'model.n_heads=5'),
    ('range', 'model.d_ff=0'),
    ('range', 'model.dropout=1.5'),
    ('range', 'model.dropout=-0.1'),
    ('range', 'optim.lr=0'),
    ('range', 'optim.lr=-1'),
    ('range', 'optim.min_lr=1'),
    ('range', 'optim.betas=[1.0,0.9]'),
    ('range', 'optim.weight_decay=-1'),
    ('range', 'optim.warmup_steps=-1'),
    ('range', 'trainer.max_steps=0'),
    ('range', 'trainer.val_check_interval=0'),
    ('range', 'trainer.log_every_n_steps=0'),
    ('range', 'trainer.gradient_clip_val=0'),
    ('range', 'trainer.num_sanity_val_steps=-1'),
    ('range', 'trainer.threads=0'),
    ('range', 'trainer.data_workers=-1'),
    ('range', 'task.max_len=0'),
    ('range', 'task.min_len=5 task.max_len=3'),
    ('range', 'task.batch_size=0'),
    ('range', 'task.eval_examples=0'),
    ('range', 'task.eval_lengths=[]'),
    ('range', 'task.eval_lengths=[0]'),
    ('range', 'seed=-1'),
    ('range', 'seed=4294967296'),
    ('range', 'checkpoint_every=0'),
    ('range', 'max_loss=0'),
    ('range', 'target_loss=-1'),
    ('range', 'diagnostics.every_n_steps=0'),
    ('range', 'diagnostics.probe_examples=0'),
    ('range', 'diagnostics.sparsity_eps=-1'),
    ('range', 'init.std=0'),
    ('range', 'norm.eps=0'),
    ('range', 'norm.eps=-1'),
    ('range', 'attn.n_kv_heads=3'),
    ('range', 'attn.window=0'),
    ('range', 'attn.scale_factor=0'),
    ('range', 'attn.scale=-1'),
    ('range', 'model.d_model=1000000000'),
    ('range', 'model.n_layers=100000 model.d_model=1024'),
    ('range', 'model.d_ff=10000000000'),
    # Every size key counts (the model built on the meta device), embeddings included. 10**10: the issue's
    # task.vocab_size=100000000 (95 GiB) would fit a machine of 128 GiB.
    ('range', 'task=mqar task.vocab_size=10000000000'),
    ('range', 'model.n_layers=1000000000'),
    ('range', 'model.d_model=1000000000 model.n_heads=3'),
    ('range', 'pos=alibi model.d_model=1000000000 model.n_heads=1000000000'),
    ('range', 'attn=based attn.feature_dim=1000000000'),
    ('range', 'attn=mla attn.kv_rank=1000000000'),
    ('range', 'attn=gla attn.gate_rank=1000000000'),
    ('range', 'attn=performer attn.n_features=1000000000'),
    ('range', 'pos=fire pos.mlp_hidden=1000000000'),
    ('range', 'pos=learned pos.max_len=1000000000'),
    ('range', 'ffn=moe ffn.experts=1000000000'),
    ('range', 'pos.scaling=ntk pos.scaling_factor=1e308'),
    ('range', 'task.eval_lengths=[1000000]'),
    ('range', 'task.max_len=100000'),
    # nonfinite
    ('nonfinite', 'optim.lr=inf'),
    ('nonfinite', 'optim.lr=nan'),
    ('nonfinite', 'optim.lr=-inf'),
    ('nonfinite', 'optim.min_lr=inf'),
    ('nonfinite', 'optim.weight_decay=inf'),
    ('nonfinite', 'optim.betas=[0.9,inf]'),
    ('nonfinite', 'model.dropout=nan'),
    ('nonfinite', 'attn.scale_factor=inf'),
    ('nonfinite', 'attn.scale_factor=nan'),
    ('nonfinite', 'attn.scale=inf'),
    ('nonfinite', 'pos.base=inf'),
    ('nonfinite', 'pos.base=nan'),
    ('nonfinite', 'init.std=inf'),
    ('nonfinite', 'norm.eps=inf'),
    ('nonfinite', 'norm.eps=nan'),
    ('nonfinite', 'trainer.gradient_clip_val=inf'),
    ('nonfinite', 'max_loss=nan'),
    ('nonfinite', 'target_loss=inf'),
    ('nonfinite', 'diagnostics.sparsity_eps=inf'),
    ('nonfinite', 'task=lm task.data.val_fraction=nan'),
    ('nonfinite', 'ffn=moe ffn.capacity_factor=inf'),
    ('nonfinite', 'pos=fire pos.init_c=inf'),
    ('nonfinite', 'attn=ssmax attn.s_init=inf'),
    ('nonfinite', 'ffn=moe ffn.aux_loss_weight=nan'),
    # pos
    ('pos', 'pos.base=0'),
    ('pos', 'pos.base=1'),
    ('pos', 'pos.base=-1'),
    ('pos', 'pos=sinusoidal pos.base=0'),
    ('pos', 'pos=sinusoidal model.d_model=33 model.n_heads=1'),
    ('pos', 'pos=sinusoidal pos.scale_embeddings=abc'),
    ('pos', 'pos=learned pos.max_len=4'),
    ('pos', 'pos=learned pos.max_len=abc'),
    ('pos', 'pos=t5_bias pos.num_buckets=0'),
    ('pos', 'pos=t5_bias pos.max_distance=0'),
    ('pos', 'pos=fire pos.mlp_hidden=0'),
    ('pos', 'pos=fire pos.init_L=0'),
    ('pos', 'pos=fire pos.init_L=-5'),
    ('pos', 'pos.randomize=true'),
    ('pos', 'pos.randomize=true pos.random_max=4'),
    ('pos', 'pos.random_max=0'),
    ('pos', 'pos.coupled=abc'),
    ('pos', 'pos.coupled_offset=-1'),
    ('pos', 'pos.abacus_offset=-1'),
    ('pos', 'pos.coupled_offset=2'),
    ('pos', 'pos.coupled=true task=lm'),
    ('pos', 'pos.abacus=true task=lm'),
    ('pos', 'pos=alibi pos.foo=1'),
    ('pos', 'model.d_model=12 model.n_heads=4'),
    ('pos', 'pos=none pos.base=5'),
    # attn
    ('attn', 'attn=window attn.window=0'),
    ('attn', 'attn=linformer attn.k=0'),
    ('attn', 'attn=linformer attn.causal=true'),
    ('attn', 'attn=performer attn.n_features=0'),
    ('attn', 'attn=performer attn.redraw_interval=0'),
    ('attn', 'attn=linear attn.chunk=0'),
    ('attn', 'attn=bigbird attn.n_global=-1'),
    ('attn', 'attn=bigbird attn.block=0'),
    ('attn', 'attn=dilated attn.dilation=0'),
    ('attn', 'attn=strided attn.stride=0'),
    ('attn', 'attn=global attn.n_global=0'),
    ('attn', 'attn=ssmax attn.s_init=abc'),
    ('attn', 'attn=ssmax attn.s_init=0'),
    ('attn', 'attn=gqa attn.n_kv_heads=3'),
    ('attn', 'attn.qk_norm=abc'),
    ('attn', 'attn.scale=sqrt'),
    ('attn', 'attn=window attn.kind=linear'),
    # norm
    ('norm', 'norm=pre_bn task.batch_size=1'),
    ('norm', 'norm.affine=1'),
    ('norm', 'norm=rezero norm.placement=sideways'),
    # ffn
    ('ffn', 'ffn=moe ffn.experts=0'),
    ('ffn', 'ffn=moe ffn.top_k=0'),
    ('ffn', 'ffn=moe ffn.top_k=5'),
    ('ffn', 'ffn=moe ffn.capacity_factor=0'),
    ('ffn', 'ffn=moe ffn.aux_loss_weight=-1'),
    # init
    ('init', 'init=xavier init.std=-1'),
    # task
    ('task', "task=copy task.alphabet=''"),
    ('task', 'task=addition task.max_len=0'),
    ('task', 'task=lm task.block_size=0'),
    ('task', 'task=lm task.data.path=/nonexistent/corpus.txt'),
    ('task', 'task=lm task.data.path=/dev/zero'),
    ('task', 'task=lm task.data.val_fraction=1.5'),
    ('task', 'task=lm task.eval_multipliers=[]'),
    ('task', 'task=lm task.data.encoding_errors=ignore'),
    ('task', 'task=lm task.block_size=8192'),
    ('task', 'task=mlm model.arch=encoder task.mask_prob=1.5'),
    ('task', 'task=mlm model.arch=encoder task.mask_prob=0'),
    ('task', 'task=mlm model.arch=encoder task.eval_seed=-1'),
    ('task', 'task=copy model.arch=encoder'),
    ('task', 'task=periodic task.period=0'),
    ('task', 'task=keyed task.max_len=0'),
    ('task', 'task=count task.min_len=0'),
    ('task', 'task=brackets task.max_len=-1'),
    ('task', 'task=max task.batch_size=0'),
    ('task', 'task=copy task.index_hints=abc'),
    ('task', 'task=addition task.eval_given_length=abc'),
    # command
    ('command', 'optim.lr=1 optim.lr=2'),
    ('command', 'sweep=causal_mask'),
    ('command', 'model.d_model=${oc.env:BLOCKLAB_UNSET_VARIABLE}'),
    ('command', '-m sweep=causal_mask study.scale=abc'),
    ('command', 'seed=0,1'),
    ('command', 'model.d_model=[1,'),
    ('command', 'model.d_model'),
    ('command', 'hydra.run.dir={blocker}/run'),
    ('command', '-m seed=0,1 hydra.sweep.dir={blocker}/sweep'),
    ('command', 'model.d_model=${nope}'),
    ('command', '-m norm=pre_ln,post_layernorm'),
    ('command', '-m pos=glob(xx*)'),
    ('command', '+model.d_model=32'),
    ('command', '-m attn=gla,mha attn.gate_rank=8'),
    ('command', 'hydra.run.dir='),
    ('command', '-m seed=0,1 hydra.sweep.dir='),
    ('command', 'hydra.run.dir=/tmp/' + 'a' * 300),
    ('command', 'hydra.run.dir={blocker}/\x1b[31mred\x1b[0m'),
    ('command', 'seed=0,1 -m'),
    ('range', 'model.d_model=' + '1' * 5000),
    ('range', 'attn.short_conv=1000'),
    ('pos', 'pos.original_context=0'),
]

# One or more of each group, in the default run.
REPRESENTATIVE = {
    "model.dmodel=64", "norm=post_layernorm", "attn.kind=sofmax", "model.d_model=abc", "optim.betas=[a,b]",
    "trainer.precision=16", "model.n_heads=5", "task.min_len=5 task.max_len=3", "seed=-1", "optim.lr=inf",
    "pos=fire pos.init_c=inf", "model.d_model=1000000000", "task.eval_lengths=[1000000]", "pos.base=0",
    "pos=t5_bias pos.num_buckets=0", "attn=linformer attn.causal=true", "norm=pre_bn task.batch_size=1",
    "ffn=moe ffn.top_k=5", "task=lm task.data.path=/dev/zero", "optim.lr=1 optim.lr=2", "sweep=causal_mask",
    "hydra.run.dir={blocker}/run", "hydra.run.dir=", "seed=0,1 -m", "attn.short_conv=1000",
    "hydra.run.dir={blocker}/\x1b[31mred\x1b[0m",
    "hydra.run.dir={blocker}/run", "task=mqar task.vocab_size=10000000000", "attn=based attn.feature_dim=1000000000",
    "ffn=moe ffn.experts=1000000000", "pos.scaling=ntk pos.scaling_factor=1e308",
}


def command(line: str, tmp_path: Path) -> tuple[list[str], Path, Path]:
    """The arguments, with a run and a sweep folder in tmp_path (unless the case sets its own) and no W&B."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    args = [arg.replace("{blocker}", str(blocker)) for arg in shlex.split(line)]
    keys = {arg.partition("=")[0].lstrip("+~") for arg in args}
    run_dir, sweep_dir = tmp_path / "run", tmp_path / "sweep"
    extra = [] if any(key.startswith("logger") for key in keys) else ["logger=none"]
    extra += [] if "hydra.run.dir" in keys else [f"hydra.run.dir={run_dir}"]
    extra += [] if "hydra.sweep.dir" in keys else [f"hydra.sweep.dir={sweep_dir}"]
    return [*args, *extra], run_dir, sweep_dir


def named_keys(line: str) -> set[str]:
    """The keys (or groups) a case sets: its one line must name at least one of them."""
    return {arg.partition("=")[0].lstrip("+~") for arg in shlex.split(line) if not arg.startswith("-")}


def outcome(line: str, tmp_path: Path) -> str | None:
    """None where the command is refused as it must be, else what went wrong. It runs in a folder of its own, so
    that a command accepted by mistake that writes into the current folder (hydra.run.dir=) leaves the checkout be."""
    args, run_dir, sweep_dir = command(line, tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_cli(args, timeout=120, cwd=cwd)
    lines = proc.stderr.strip().splitlines()
    if "Traceback" in proc.stderr:
        return f"traceback: {lines[-1] if lines else ''}"
    if proc.returncode == 0:
        return "accepted: it trained"
    if proc.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
        return f"exit {proc.returncode} with {len(lines)} lines: {proc.stderr[-500:]}"
    if any(ord(ch) < 32 and ch != "\n" or 127 <= ord(ch) < 160 for ch in proc.stderr):  # a terminal would act on it
        return f"control characters printed raw: {proc.stderr!r}"
    if not any(key in lines[0] for key in named_keys(line)):
        return f"names none of {sorted(named_keys(line))}: {lines[0]}"
    if run_dir.exists() or sweep_dir.exists() or any(cwd.iterdir()):
        return f"refused, but created {run_dir if run_dir.exists() else sweep_dir if sweep_dir.exists() else cwd}"
    return None


@pytest.mark.parametrize("group, line", [
    pytest.param(group, line, id=f"{group}: {line if len(line) <= 80 else f'{line[:60]}...({len(line)} chars)'}",
                 marks=() if line in REPRESENTATIVE else pytest.mark.slow)
    for group, line in CASES])
def test_a_bad_input_is_one_line_exit_2_and_creates_nothing(group, line, tmp_path):
    assert outcome(line, tmp_path) is None


def test_the_list_covers_every_key_group():
    groups = {group for group, _ in CASES}
    assert {"typo", "type", "range", "nonfinite", "pos", "attn", "norm", "ffn", "task", "command"} <= groups
    assert len(CASES) >= 150 and len({line for _, line in CASES}) == len(CASES)
    assert REPRESENTATIVE <= {line for _, line in CASES}


if __name__ == "__main__":
    import tempfile

    failures = 0
    for group, line in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            problem = outcome(line, Path(tmp))
        failures += problem is not None
        print(f"{'ok  ' if problem is None else 'FAIL'} {group:9} {line}" + (f"  -- {problem}" if problem else ""))
    print(f"{len(CASES) - failures} of {len(CASES)} refused in one line with exit 2; {failures} not")
    sys.exit(1 if failures else 0)
