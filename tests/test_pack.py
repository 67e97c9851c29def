"""Seeds trained together (train/pack.py, grouped.py, pack_state.py, pack_jobs.py): a pack of one is a plain run
bit for bit; a packed member's per-step losses are its run alone's to float32 round-off; clipping, divergence
and results are per member; checkpoints are Lightning's; a sweep with study.pack_seeds writes where the
sequential sweep writes, skips what the pack finished, and resumes after SIGTERM to the same results."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.results import read_results
from blocklab.schema import schema_errors
from blocklab.train.grouped import GroupedModel, fold
from blocklab.train.pack import Pack, pack_of, train_pack
from blocklab.train.pack_jobs import refusal
from blocklab.train.sweep import BASIC_LAUNCHER, JOBLIB_LAUNCHER
from conftest import FAST, ROOT, compose_config, run_in_process

QUIET = ["logger=none", "diagnostics=none", "task.eval_examples=16", "task.eval_lengths=[4,16,20]"]


def cfgs(tmp_path, overrides: list[str], seeds=(0, 1, 2), tag="p"):
    return [compose_config([*overrides, f"seed={s}"], tmp_path / f"{tag}{s}") for s in seeds]


def history(pack: Pack) -> torch.Tensor:
    return torch.tensor(pack.history)  # (steps, members)


def weights(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def measured(results: dict) -> dict:
    """What a run measured of its model (not how long it took)."""
    keep = ("status", "steps", "final_train_loss", "final_val_loss", "train_loss_curve", "eval", "steps_to_target_loss",
            "diverged_at_step", "params")
    return {key: results[key] for key in keep}


def alone_losses(tmp_path, overrides, seeds=(0, 1, 2)) -> torch.Tensor:
    """Each seed's per-step losses trained alone (a pack of one: a plain run, bit for bit, as tested below)."""
    runs = []
    for seed in seeds:
        pack = pack_of(cfgs(tmp_path, overrides, (seed,), tag="alone"))
        pack.run()
        runs.append(history(pack)[:, 0])
    return torch.stack(runs, dim=1)


# ------------------------------------------------------------------------------------------ a pack of one

@pytest.mark.parametrize("dropout, precision", [(0.0, "32-true"), (0.2, "32-true"), (0.0, "bf16-mixed")])
def test_a_pack_of_one_is_a_plain_run_bit_for_bit(tmp_path, dropout, precision):
    """bf16-mixed too: the pack's forward runs under the autocast Lightning's bf16-mixed plugin opens."""
    overrides = [*FAST, f"model.dropout={dropout}", f"trainer.precision={precision}"]
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    run_in_process(overrides, plain)
    train_pack([compose_config(overrides, packed)])
    a, b = (torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
            for d in (plain, packed))
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    assert all(torch.equal(sa["state"][i][key], sb["state"][i][key]) for i in sa["state"] for key in sa["state"][i])
    assert a["lr_schedulers"] == b["lr_schedulers"] and a["global_step"] == b["global_step"] == 20
    ra, rb = read_results(plain), read_results(packed)
    for key in ("status", "steps", "final_train_loss", "final_val_loss", "train_loss_curve", "eval", "params",
                "steps_to_target_loss", "choices"):
        assert ra[key] == rb[key], key
    assert ra["diagnostics"]["end"]["layers"] == rb["diagnostics"]["end"]["layers"]
    assert rb["pack"] == {"members": 1, "seeds": [0]}


# ------------------------------------------------------------------------------------------ packed = alone

ARCHS = {"mha-rope": ["attn=mha", "pos=rope"], "gqa-alibi": ["attn=gqa", "pos=alibi"],
         "gqa-learned-rms": ["attn=gqa", "pos=learned", "norm=pre_rms"],
         "ssmax-coupled-rope": ["method=coupled_rope_ssmax"]}  # a per-head gain meeting the keys-seen counts


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_members_train_as_each_seed_alone(tmp_path, arch):
    """20 steps: per-step training losses agree to float32 round-off (members' batches differ in width, so the
    pack pads them; matmuls run batched)."""
    overrides = [*QUIET, *ARCHS[arch], "trainer.max_steps=20", "trainer.val_check_interval=20"]
    pack = pack_of(cfgs(tmp_path, overrides))
    pack.run()
    packed, alone = history(pack), alone_losses(tmp_path, overrides)
    assert packed.shape == alone.shape == (20, 3)
    assert torch.allclose(packed, alone, rtol=1e-5, atol=0)
    assert (alone[-1] - alone[-1].mean()).abs().max() > 1e-3  # the seeds do differ: members are not one run


def test_packed_members_in_bf16_mixed_train_as_each_seed_alone_to_bfloat16_round_off(tmp_path):
    """Under bfloat16 autocast a member's matmuls run batched with the others' (bmm) instead of alone (mm), and a
    product summed in another order can round to a neighbouring bfloat16 value: the losses need not agree to
    float32's round-off, but each member must track its own seed's run far more closely than any other seed's."""
    overrides = [*QUIET, "trainer.precision=bf16-mixed", "trainer.max_steps=20", "trainer.val_check_interval=20"]
    pack = pack_of(cfgs(tmp_path, overrides))
    pack.run()
    packed, alone = history(pack), alone_losses(tmp_path, overrides)
    assert packed.shape == alone.shape == (20, 3)
    for k in range(3):
        gaps = [float(((packed[:, k] - alone[:, j]).abs() / alone[:, j]).max()) for j in range(3)]
        assert gaps[k] < 1e-3 and all(gap > 5 * 1e-3 for j, gap in enumerate(gaps) if j != k), gaps
    assert read_results(tmp_path / "p0")["choices"]["precision"] == "bf16-mixed"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mha-rope", "gqa-alibi"])
def test_packed_members_match_alone_over_200_steps_and_in_their_metrics(tmp_path, arch):
    """Round-off grows as training amplifies it (about 1e-6 relative at step 50, 1e-4 by step 200, measured),
    far below the seeds' own spread; final metrics agree within seed noise."""
    overrides = [*QUIET, *ARCHS[arch], "trainer.max_steps=200", "trainer.val_check_interval=200"]
    pack = pack_of(cfgs(tmp_path, overrides))
    pack.run()
    packed, alone = history(pack), alone_losses(tmp_path, overrides)
    assert torch.allclose(packed, alone, rtol=1e-3, atol=0)
    spread = (alone[-20:].mean(0) - alone[-20:].mean()).abs().max()
    assert (packed[-20:].mean(0) - alone[-20:].mean(0)).abs().max() < 0.1 * spread
    for seed in range(3):
        a, b = read_results(tmp_path / f"alone{seed}"), read_results(tmp_path / f"p{seed}")
        assert b["final_val_loss"] == pytest.approx(a["final_val_loss"], rel=1e-3)


# ------------------------------------------------------------------------------------------ per member

def test_each_member_is_clipped_by_its_own_gradient_norm(tmp_path):
    """One member's gradient norm above the limit, one below: each is clipped as clip_grad_norm_ clips it alone."""
    pack = pack_of(cfgs(tmp_path, [*QUIET, "trainer.max_steps=2"], seeds=(0, 1)))
    pack.open()
    params = [pack.grouped.params[name] for name in pack.order]
    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in params]
    for g in grads:
        g[0] *= 10.0 / len(grads) ** 0.5  # member 0: norm ~ 10 x sqrt(size) >> 1
        g[1] *= 1e-4  # member 1: norm << 1
    expected = []
    for k in range(2):
        alone = [torch.nn.Parameter(g[k].clone()) for g in grads]
        for p, g in zip(alone, grads):
            p.grad = g[k].clone()
        before = torch.nn.utils.clip_grad_norm_(alone, 1.0)
        expected.append(([p.grad for p in alone], float(before)))
    assert expected[0][1] > 1.0 > expected[1][1]
    pack._clip(grads, 1.0)
    for k in range(2):
        assert all(torch.equal(g[k], e) for g, e in zip(grads, expected[k][0]))
    assert float(torch.linalg.vector_norm(torch.stack([g[0].norm() for g in grads]))) == pytest.approx(1.0, rel=1e-5)


def diverge_at(member: int, step: int):
    """A Pack.train_step that, after `step`, sets one member's parameters to NaN: its next loss is not finite."""
    original = Pack.train_step

    def train_step(self, s):
        losses = original(self, s)
        if s + 1 == step:
            with torch.no_grad():
                for p in self.grouped.params.values():
                    p[member] = float("nan")
        return losses

    return train_step


def test_one_member_diverging_leaves_the_others_exactly_as_they_were(tmp_path, monkeypatch):
    overrides = [*QUIET, "trainer.max_steps=16", "trainer.val_check_interval=16", "checkpoint_every=100"]
    calm = pack_of(cfgs(tmp_path, overrides, tag="calm"))
    calm.run()
    monkeypatch.setattr(Pack, "train_step", diverge_at(member=1, step=6))
    stormy = pack_of(cfgs(tmp_path, overrides, tag="stormy"))
    stormy.run()
    a, b = history(calm), history(stormy)
    assert torch.equal(a[:, [0, 2]], b[:, [0, 2]])  # bit for bit: nothing of member 1 reached them
    assert torch.equal(a[:6, 1], b[:6, 1]) and b[6:, 1].isnan().all()
    for seed in (0, 2):
        assert measured(read_results(tmp_path / f"calm{seed}")) == measured(read_results(tmp_path / f"stormy{seed}"))
        assert all(torch.equal(x, y) for x, y in zip(weights(tmp_path / f"calm{seed}").values(),
                                                      weights(tmp_path / f"stormy{seed}").values()))
    diverged = read_results(tmp_path / "stormy1")
    assert diverged["status"] == "diverged" and diverged["diverged_at_step"] == diverged["steps"] == 7
    assert torch.load(tmp_path / "stormy1" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 7


# ------------------------------------------------------------------------------------------ what is not packed

@pytest.mark.parametrize("overrides, why", [(["norm=pre_bn"], "batch_norm"), (["attn=performer"], "random_features")])
def test_models_whose_members_would_mix_are_not_packed_and_nothing_is_written(tmp_path, overrides, why):
    reason = train_pack(cfgs(tmp_path, [*QUIET, *overrides], seeds=(0, 1)))
    assert isinstance(reason, str) and why in reason
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.ckpt"))


def test_grouped_linear_embedding_and_norms_compute_each_members_own():
    """Against each member's own module, on the members' rows laid end to end (and on one row all members share,
    as a position table is looked up)."""
    torch.manual_seed(0)
    layers = {"linear": torch.nn.Linear(5, 3), "embedding": torch.nn.Embedding(7, 4),
              "layer_norm": torch.nn.LayerNorm(5), "rms_norm": torch.nn.RMSNorm(5)}
    for name, layer in layers.items():
        members = [_fresh(layer) for _ in range(3)]
        grouped = GroupedModel(members)
        x = torch.randint(7, (6, 2)) if name == "embedding" else torch.randn(6, 2, 5)
        expected = torch.cat([m(x[2 * k:2 * k + 2]) for k, m in enumerate(members)])
        assert torch.allclose(grouped.apply(x), expected, atol=1e-6), name
        if name in ("linear", "embedding"):  # a row shared by the batch: each member's result on each of its rows
            grouped = GroupedModel([FirstRow(m) for m in members])
            expected = torch.cat([m(x[:1]).expand(2, *m(x[:1]).shape[1:]) for m in members])
            assert torch.allclose(grouped.apply(x), expected, atol=1e-6), name


class FirstRow(torch.nn.Module):
    """A layer applied to the batch's first row alone (as a position table to one row of positions)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x[:1])


def _fresh(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of `layer` with every parameter drawn anew (so members differ)."""
    import copy

    member = copy.deepcopy(layer)
    for p in member.parameters():
        torch.nn.init.normal_(p)
    return member


def test_fold_right_pads_each_members_batch_as_the_task_pads():
    a = {"input": torch.ones(2, 3, dtype=torch.long), "target": torch.ones(2, 3, dtype=torch.long),
         "valid": torch.ones(2, 3, dtype=torch.bool)}
    b = {key: value[:, :1] for key, value in a.items()}
    folded = fold([a, b], pad_id=9)
    assert folded["input"][2:].tolist() == [[1, 9, 9]] * 2 and folded["target"][2:].tolist() == [[1, -100, -100]] * 2
    assert folded["valid"][2:].tolist() == [[True, False, False]] * 2
    assert folded["input"][:2].tolist() == a["input"].tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU, so trainer=gpu is not refused here")
def test_a_pack_asked_to_train_on_a_gpu_without_one_is_one_line_and_writes_nothing(tmp_path):
    with pytest.raises(ConfigError) as err:
        train_pack(cfgs(tmp_path, [*QUIET, "trainer=gpu"], seeds=(0, 1)))
    assert "needs a CUDA GPU, and torch sees none" in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.rglob("*"))


def test_configs_that_cannot_pack_say_why():
    base = compose_config(QUIET)
    groups = {"trainer": dict(base.trainer)}
    basic = {"_target_": BASIC_LAUNCHER}
    assert refusal(groups, basic) is None
    assert refusal(groups, {"_target_": JOBLIB_LAUNCHER, "n_jobs": 1}) is None  # joblib then runs them in order
    assert "DDP" in refusal({"trainer": {**groups["trainer"], "strategy": "ddp", "devices": 2}}, basic)
    assert refusal({"trainer": {**groups["trainer"], "precision": "bf16-mixed"}}, basic) is None
    assert refusal({"trainer": {**groups["trainer"], "accelerator": "gpu"}}, basic) is None  # packs train on a GPU
    assert "64-true" in refusal({"trainer": {**groups["trainer"], "precision": "64-true"}}, basic)
    assert "compiled" in refusal({"trainer": {**groups["trainer"], "compile": True}}, basic)
    assert refusal(groups, {"_target_": JOBLIB_LAUNCHER, "n_jobs": -1}) is None  # packs side by side
    assert "basic or joblib launcher" in refusal(groups, {"_target_": "hydra_plugins.hydra_submitit_launcher."
                                                                      "submitit_launcher.SlurmLauncher"})


def test_pack_seeds_must_be_a_boolean():
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(compose_config(QUIET), resolve=True) | {"study": {"name": "x", "pack_seeds": "yes"}}
    assert "study.pack_seeds='yes' must be true (train each setting's seeds together) or false" in schema_errors(config)


# ------------------------------------------------------------------------------------------ checkpoints

def interrupt_at(step: int):
    """A Pack.train_step that raises the flag SIGTERM raises, after `step`."""
    original = Pack.train_step

    def train_step(self, s):
        losses = original(self, s)
        if s + 1 == step:
            self.interrupted = True
        return losses

    return train_step


@pytest.mark.slow  # ~100 s under load; test_an_interrupted_pack_resumes_... covers a pack's resume in the default run
def test_a_packed_checkpoint_resumes_as_a_plain_run(tmp_path, monkeypatch):
    """Interrupted, a pack of one leaves a checkpoint Lightning resumes from, ending bit for bit where a plain
    run ends: weights, optimizer, schedule, loop counters, totals and random state all carried."""
    overrides = [*FAST, "model.dropout=0.2", "checkpoint_every=5"]
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    monkeypatch.setattr(Pack, "train_step", interrupt_at(12))
    with pytest.raises(SystemExit, match="143"):
        train_pack([compose_config(overrides, interrupted)])
    assert torch.load(interrupted / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 12
    assert not (interrupted / "results.json").exists()
    run_in_process(overrides, interrupted)  # Lightning, from the pack's checkpoint
    run_in_process(overrides, straight)
    assert measured(read_results(interrupted)) == measured(read_results(straight))
    assert all(torch.equal(a, b) for a, b in zip(weights(interrupted).values(), weights(straight).values()))


def test_an_interrupted_pack_resumes_to_exactly_what_an_uninterrupted_one_ends_with(tmp_path, monkeypatch):
    """With dropout (the pack's random state is carried) and diagnostics (their history is carried)."""
    overrides = [*FAST, "model.dropout=0.1", "diagnostics.every_n_steps=5", "checkpoint_every=5"]
    train_pack(cfgs(tmp_path, overrides, seeds=(0, 1), tag="straight"))
    monkeypatch.setattr(Pack, "train_step", interrupt_at(12))
    with pytest.raises(SystemExit, match="143"):
        train_pack(cfgs(tmp_path, overrides, seeds=(0, 1), tag="resumed"))
    monkeypatch.undo()
    train_pack(cfgs(tmp_path, overrides, seeds=(0, 1), tag="resumed"))
    for seed in (0, 1):
        straight, resumed = tmp_path / f"straight{seed}", tmp_path / f"resumed{seed}"
        assert measured(read_results(resumed)) == measured(read_results(straight))
        assert all(torch.equal(a, b) for a, b in zip(weights(resumed).values(), weights(straight).values()))
        history = [json.loads((d / "diagnostics" / "history.json").read_text()) for d in (straight, resumed)]
        assert history[0] == history[1] and [h["step"] for h in history[1]] == [0, 5, 10, 15, 20]


# ------------------------------------------------------------------------------------------ in a sweep

def sweep(sweep_dir, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "-m", "sweep=causal_mask", "seed=0,1", "attn.causal=true",
            "trainer.max_steps=60", "trainer.val_check_interval=30", "checkpoint_every=10", "task.eval_examples=16",
            "diagnostics=none", "hydra.launcher.n_jobs=1", f"hydra.sweep.dir={sweep_dir}", *extra]


def finished(sweep_dir) -> dict:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/results.json"))}


ENV = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def run_sweep(cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two sweeps (35 s); the in-process pack tests cover a pack's training and resume in the default run
def test_a_packed_sweep_writes_each_seed_where_the_sequential_sweep_does(tmp_path):
    run = run_sweep
    sequential, packed = tmp_path / "sequential", tmp_path / "packed"
    done = run(sweep(sequential, "logger=none"))
    assert done.returncode == 0, done.stderr[-2000:]
    done = run(sweep(packed, "logger=wandb", "study.pack_seeds=true"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train seeds 0,1" in done.stdout and done.stdout.count("skip ") == 1  # the second job: done by the first
    alone, together = finished(sequential), finished(packed)
    assert alone.keys() == together.keys() and len(together) == 2  # the same directories: pack_seeds names no job
    for name, results in together.items():
        assert results["status"] == "completed" and results["pack"] == {"members": 2, "seeds": [0, 1]}
        assert results["beside_other_jobs"] is False and alone[name]["beside_other_jobs"] is False  # n_jobs=1
        assert results["final_train_loss"] == pytest.approx(alone[name]["final_train_loss"], rel=1e-4)
        assert "study.pack_seeds=True" in results["overrides"] and f"seed={results['choices']['seed']}" in \
            results["overrides"]
        run_dir = packed / name
        assert (run_dir / ".hydra" / "overrides.yaml").read_text().count(f"seed={results['choices']['seed']}") == 1
        assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1  # each member its own W&B run
    # W&B: seed 1's run (trained by seed 0's job) is tagged and grouped as its own job would be.
    run_1 = next(packed.glob("*seed=1*/wandb/offline-run-*"))
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent))
    summary = json.loads(subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(run_1)],
                                        capture_output=True, text=True, timeout=120).stdout)
    assert "seed=1" in summary["tags"] and "attn.causal=True" in summary["tags"] and summary["config"]["seed"] == 1
    records = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(run_1)], capture_output=True, text=True,
                             timeout=120).stdout
    assert '"job_type":"copy"' in records and '"run_group":"causal_mask-' in records


@pytest.mark.slow  # two more sweeps; test_an_interrupted_pack_resumes_... covers a pack's resume in the default run
def test_a_packed_sweep_resumes_after_sigterm_to_what_an_uninterrupted_one_ends_with(tmp_path):
    run = run_sweep
    packed, interrupted = tmp_path / "packed", tmp_path / "interrupted"
    done = run(sweep(packed, "logger=none", "study.pack_seeds=true"))
    assert done.returncode == 0, done.stderr[-2000:]
    together = finished(packed)
    proc = subprocess.Popen(sweep(interrupted, "logger=none", "study.pack_seeds=true"), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(interrupted.glob("*/checkpoints/last.ckpt")) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Run the same command again to resume" in err, err[-2000:]
    assert not finished(interrupted) and len(list(interrupted.glob("*/checkpoints/last.ckpt"))) == 2
    resumed = run(sweep(interrupted, "logger=none", "study.pack_seeds=true"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.count("resuming") == 2
    again = finished(interrupted)
    keep = ("status", "steps", "final_train_loss", "final_val_loss", "eval", "train_loss_curve")
    assert {n: {k: r[k] for k in keep} for n, r in again.items()} == \
        {n: {k: r[k] for k in keep} for n, r in together.items()}


# ------------------------------------------------------------------------------------------ packs side by side

def settings_sweep(sweep_dir, *extra: str) -> list[str]:
    """Two settings of two seeds each, packed, one thread a job (so the launchers compute alike)."""
    return [sys.executable, str(ROOT / "train.py"), "-m", "sweep=causal_mask", "seed=0,1", "attn.causal=true,false",
            "trainer.max_steps=40", "trainer.val_check_interval=20", "checkpoint_every=10", "task.eval_examples=8",
            "diagnostics=none", "logger=none", "trainer.threads=1", "study.pack_seeds=true",
            f"hydra.sweep.dir={sweep_dir}", *extra]


def test_packs_side_by_side_train_each_seed_once(tmp_path):
    from joblib import cpu_count

    command = [arg for arg in settings_sweep(tmp_path / "beside", "hydra.launcher.n_jobs=2") if arg != "trainer.threads=1"]
    beside = run_sweep(command)
    assert beside.returncode == 0, beside.stderr[-2000:]
    assert beside.stdout.count("status: completed") == 4  # each seed's results written once: no seed trained twice
    # The two jobs that do not train find their seed claimed by the pack beside, or finished by it.
    assert beside.stdout.count("packed: ") + beside.stdout.count("skip ") == 2, beside.stdout[-3000:]
    together = finished(tmp_path / "beside")
    assert len(together) == 4 and all(r["pack"] == {"members": 2, "seeds": [0, 1]} for r in together.values())
    # Two packs on two workers: each takes half the cores.
    assert {r["threads"] for r in together.values()} == {max(1, cpu_count() // 2)}


@pytest.mark.slow  # two sweeps (~50 s); test_packs_side_by_side_train_each_seed_once covers the launch in the default run
def test_packs_side_by_side_end_as_packs_one_after_another_do(tmp_path):
    one_by_one = run_sweep(settings_sweep(tmp_path / "sequential", "hydra.launcher.n_jobs=1"))
    assert one_by_one.returncode == 0, one_by_one.stderr[-2000:]
    beside = run_sweep(settings_sweep(tmp_path / "beside", "hydra.launcher.n_jobs=2"))
    assert beside.returncode == 0, beside.stderr[-2000:]
    sequential, together = finished(tmp_path / "sequential"), finished(tmp_path / "beside")
    assert sequential.keys() == together.keys() and len(together) == 4
    for name, results in together.items():
        assert results["pack"] == {"members": 2, "seeds": [0, 1]} and results["threads"] == 1
        assert results["beside_other_jobs"] is True and sequential[name]["beside_other_jobs"] is False
        assert measured(results) == measured(sequential[name])


def test_the_only_pack_of_a_launch_takes_the_cores_of_the_workers_left_idle(tmp_path):
    from joblib import cpu_count

    command = [arg if arg != "hydra.launcher.n_jobs=1" else "hydra.launcher.n_jobs=-1"
               for arg in sweep(tmp_path / "one", "logger=none", "study.pack_seeds=true")]
    done = run_sweep(command)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = finished(tmp_path / "one")
    assert len(runs) == 2 and all(r["pack"]["members"] == 2 and r["beside_other_jobs"] for r in runs.values())
    assert {r["threads"] for r in runs.values()} == {cpu_count()}  # one setting: one pack trains, on every core


def hold_seed(run_dir, mark: str | None) -> subprocess.Popen:
    """Another process holding `run_dir`'s seed lock (and marking it claimed by `mark`) until its stdin closes."""
    code = ("import sys; from blocklab.train.pack_claims import Seed; s = Seed(sys.argv[1]); assert s.take(); "
            "sys.argv[2] and s.mark(sys.argv[2]); print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir), mark or ""], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_seed_held_by_another_process_is_not_taken_and_its_claim_ends_with_that_process(tmp_path):
    from blocklab.train.pack_claims import Seed

    run_dir = tmp_path / "seed=0"
    holder = hold_seed(run_dir, "seeds 0,1, process 1")
    seed = Seed(run_dir)
    assert not seed.take() and seed.claimed_by() == "seeds 0,1, process 1"
    seed.release()  # a job that lost its seed to the pack beside (and returns) leaves that pack's claim alone
    assert seed.claimed_by() == "seeds 0,1, process 1"
    holder.kill()  # killed, not finished: the mark stays, the lock goes with the process
    holder.wait()
    assert seed.mark_path.exists() and seed.claimed_by() is None and not seed.mark_path.exists()
    assert seed.take()
    assert not Seed(run_dir).take()  # taken by this process's first handle: a second one waits its turn too
    seed.release()
    assert Seed(run_dir).take()


def test_a_job_waits_for_its_groups_lock_or_for_its_seed_to_be_claimed(tmp_path):
    from blocklab.train.pack_claims import Claims, Seed, group_lock, wait_for_turn

    mine, other = tmp_path / "seed=0", tmp_path / "seed=1"
    group = group_lock(mine, "attn.causal=True")
    assert wait_for_turn(Seed(mine), group) is None and group.fd is not None  # the group was free: this job forms
    claims = Claims(Seed(mine), group)
    assert claims.mine.take() and claims.take(other)
    waiting = Seed(other)
    assert not waiting.take() and waiting.claimed_by() is None  # taken, not yet claimed: seed 1's job still waits
    claims.formed("seeds 0,1, process 7")  # the pack is formed: seed 1's job returns at once
    assert wait_for_turn(waiting, group_lock(other, "attn.causal=True")) == "seeds 0,1, process 7"
    claims.release()
    assert waiting.claimed_by() is None and waiting.take()
    waiting.release()


def test_a_pack_that_cannot_form_gives_the_other_seeds_back_and_keeps_its_own(tmp_path):
    from blocklab.train.pack_claims import Claims, Seed, group_lock

    mine, other, elsewhere = tmp_path / "seed=0", tmp_path / "seed=1", tmp_path / "seed=2"
    holder = hold_seed(elsewhere, None)  # seed 2 trains alone in another process
    try:
        claims = Claims(Seed(mine), group_lock(mine, "g"))
        assert claims.group.take() and claims.mine.take() and claims.take(other) and not claims.take(elsewhere)
        claims.alone()
        assert Seed(mine).take() is False  # this job trains its own seed alone
        for lock in (Seed(other).lock, group_lock(mine, "g")):  # free for the others' jobs
            assert lock.take()
            lock.release()
        claims.release()
        assert Seed(mine).take()
    finally:
        holder.stdin.close()
        holder.wait()


@pytest.mark.slow  # two sweeps side by side and one resumed (~60 s); the sequential pack's resume is tested above
def test_packs_side_by_side_resume_after_sigterm_to_what_uninterrupted_ones_end_with(tmp_path):
    packed, interrupted = tmp_path / "packed", tmp_path / "interrupted"
    done = run_sweep(settings_sweep(packed, "hydra.launcher.n_jobs=2"))
    assert done.returncode == 0, done.stderr[-2000:]
    proc = subprocess.Popen(settings_sweep(interrupted, "hydra.launcher.n_jobs=2"), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while len(list(interrupted.glob("*/checkpoints/last.ckpt"))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Run the same command again to resume" in err, err[-2000:]
    assert len(finished(interrupted)) < 4
    resumed = run_sweep(settings_sweep(interrupted, "hydra.launcher.n_jobs=2"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.count("resuming") >= 2  # the interrupted pack's members go on from their checkpoints
    keep = ("status", "steps", "final_train_loss", "final_val_loss", "eval", "train_loss_curve")
    assert {n: {k: r[k] for k in keep} for n, r in finished(interrupted).items()} == \
        {n: {k: r[k] for k in keep} for n, r in finished(packed).items()}


def test_a_pack_failing_beside_other_jobs_records_the_failure_of_the_seeds_whose_jobs_returned(tmp_path,
                                                                                               monkeypatch):
    from omegaconf import OmegaConf

    import blocklab.train.pack as pack_module
    import blocklab.train.pack_jobs as pack_jobs
    from blocklab.train.pack_claims import Claims, Seed, group_lock

    def member(seed):
        return OmegaConf.create({"seed": seed, "run_dir": str(tmp_path / f"seed={seed}"), "task": {"name": "copy"}})

    (tmp_path / "seed=2").mkdir()
    (tmp_path / "seed=2" / "results.json").write_text(json.dumps({"status": "diverged"}))  # written before the fault

    class Failing:
        def run(self):
            raise RuntimeError("out of memory\nmore")

    members = [(member(s), [f"seed={s}"]) for s in (0, 1, 2)]
    monkeypatch.setattr(pack_jobs, "seed_group", lambda cfg, claims: members)
    monkeypatch.setattr(pack_jobs, "sweep_tags_and_group", lambda groups: {})
    monkeypatch.setattr(pack_jobs, "settings_in_sweep", lambda: 1)
    monkeypatch.setattr(pack_module, "pack_of", lambda *args: Failing())
    claims = Claims(Seed(tmp_path / "seed=0"), group_lock(tmp_path / "seed=0", "g"))
    with pytest.raises(RuntimeError):
        pack_jobs.pack_group(member(0), lambda cfg: pytest.fail("a formed pack does not train alone"), claims)
    claims.release()
    assert read_results(tmp_path / "seed=1") == {"status": "failed", "overrides": ["seed=1"], "task": "copy",
                                                 "error": "in the pack of its seed group: RuntimeError: out of memory"}
    assert read_results(tmp_path / "seed=2")["status"] == "diverged"  # a member's final result stays
    assert not (tmp_path / "seed=0").exists()  # this job's own failure is run_as_sweep_job's to record
