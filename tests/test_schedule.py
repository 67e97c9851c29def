"""optim.schedule: the wsd schedule against OLMo-core's WSD and Hägele et al.'s 1-sqrt cooldown, cosine as before,
old configs as cosine, and a cooldown branch that starts from its trunk's exact state (weights, AdamW's moments,
step) and decays as the formula says, step by step."""
import copy
import math

import pytest
import torch

from blocklab.schedule import SCHEDULES, branch_steps, schedule, schedule_errors
from blocklab.train.module import lr_factor
from conftest import FAST, run_in_process

OPTIM = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 5, "schedule": "wsd", "cooldown": 0.2,
         "cooldown_shape": "linear", "branch_points": [], "branch_from": None, "branch_step": None}


# allenai/OLMo-core, src/olmo_core/optim/scheduler.py (WSD.get_lr after warmup, and _linear_decay), copied:
def _linear_decay(initial_lr, step_from_end, decay, decay_min_lr=0.0):
    return decay_min_lr + (initial_lr - decay_min_lr) * min(step_from_end, decay) / decay


def olmo_wsd(initial_lr, current, t_max, decay_fraction, decay_min_lr):
    decay = round(t_max * decay_fraction)
    if current >= t_max - decay:
        return _linear_decay(initial_lr, t_max - current, decay, decay_min_lr)
    return initial_lr


def test_wsd_linear_is_olmo_cores_wsd_after_warmup():
    factor = schedule(OPTIM, 100)
    for step in range(OPTIM["warmup_steps"], 101):
        assert factor(step) == pytest.approx(olmo_wsd(1.0, step, 100, 0.2, 0.1)), step
    assert factor(79) == 1.0 and factor(100) == pytest.approx(0.1)


def test_wsd_one_minus_sqrt_cooldown():
    """Hägele et al. 2024, eq. (1-sqrt): lr = lr_max (1 - sqrt((n - n_cooldown_start) / n_cooldown)), here floored
    at min_lr: min + (lr - min) (1 - sqrt(progress))."""
    factor = schedule({**OPTIM, "cooldown_shape": "1-sqrt"}, 100)
    for step in range(80, 101):
        assert factor(step) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt((step - 80) / 20)))


def test_warmup_and_cosine_as_before():
    """The warmup both schedules share, and cosine = nanoGPT's get_lr (karpathy/nanoGPT train.py, its min_lr
    reached at max_steps), for a config saved before optim.schedule existed (no key: cosine)."""
    old = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 5}
    cosine = schedule(old, 50)
    for step in range(60):
        if step < 5:
            want = (step + 1) / 6
        elif step >= 50:
            want = 0.1
        else:
            want = 0.1 + 0.5 * (1 + math.cos(math.pi * (step - 5) / 45)) * 0.9
        assert cosine(step) == pytest.approx(want) == pytest.approx(lr_factor(step, 5, 50, 0.1))
        assert schedule(OPTIM, 50)(step) == pytest.approx(want) if step < 5 else True


def test_a_trunk_never_decays_and_keeps_its_branch_points():
    trunk = schedule({**OPTIM, "branch_points": [0.25, 0.5, 1.0]}, 200)
    assert all(trunk(s) == 1.0 for s in range(5, 201))
    assert branch_steps([0.25, 0.5, 1.0], 200) == [50, 100, 200]


def test_schedule_errors_name_the_key():
    assert "optim.schedule='cosin' is unknown; did you mean 'cosine'?" in schedule_errors({"schedule": "cosin"}, 10)[0]
    assert "optim.branch_step=30" in schedule_errors({**OPTIM, "branch_from": "x", "branch_step": 30}, 20)[0]
    assert schedule_errors({**OPTIM, "branch_from": "x"}, 20)[0].startswith("optim.branch_from=x needs optim.branch_step")
    assert schedule_errors({**OPTIM, "branch_step": 3}, 20)[0].startswith("optim.branch_step=3 needs optim.branch_from")
    assert "optim.schedule=wsd" in SCHEDULES["cosine"].errors({"branch_points": [0.5]}, 20)[0]


WSD = [*FAST, "optim.schedule=wsd", "optim.warmup_steps=2", "optim.lr=0.01", "optim.min_lr=0.001"]


@pytest.mark.slow
def test_a_branch_starts_from_its_trunks_exact_state_and_decays_as_the_formula(tmp_path, monkeypatch):
    """Trunk: 20 steps (trainer=debug), kept at 50% and 100%. Branch from step 10 to step 14: when its training
    starts, its weights and AdamW state are the trunk's step-10 checkpoint's, bit for bit; the lr of each of its
    steps is min + (lr - min) (14 - s) / 4 (OLMo-core's linear decay over the branch's 4 steps)."""
    from blocklab.train.module import LitTransformer

    trunk = tmp_path / "trunk"
    run_in_process([*WSD, "optim.branch_points=[0.5,1.0]"], trunk)
    kept = torch.load(trunk / "checkpoints" / "step-10.ckpt", weights_only=True)
    assert kept["global_step"] == 10 and (trunk / "checkpoints" / "step-20.ckpt").is_file()

    seen = {"lr": {}}

    def on_train_start(self):
        seen["step"] = self.global_step
        seen["weights"] = {k: v.clone() for k, v in self.state_dict().items()}
        seen["optimizer"] = copy.deepcopy(self.trainer.optimizers[0].state_dict())  # later steps write in place

    def on_train_batch_start(self, batch, batch_idx):
        original(self, batch, batch_idx)
        seen["lr"][self.global_step] = self.trainer.optimizers[0].param_groups[0]["lr"]

    original = LitTransformer.on_train_batch_start
    monkeypatch.setattr(LitTransformer, "on_train_start", on_train_start, raising=False)
    monkeypatch.setattr(LitTransformer, "on_train_batch_start", on_train_batch_start)
    run_in_process([*WSD, f"optim.branch_from={trunk}", "optim.branch_step=10", "trainer.max_steps=14"],
                   tmp_path / "branch")
    assert seen["step"] == 10
    assert seen["weights"].keys() == kept["state_dict"].keys()
    for name, value in kept["state_dict"].items():
        assert torch.equal(seen["weights"][name], value), name
    moments = seen["optimizer"]["state"]
    assert moments.keys() == kept["optimizer_states"][0]["state"].keys()
    for i, state in kept["optimizer_states"][0]["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[i][key], state[key]), (i, key)
    assert sorted(seen["lr"]) == [10, 11, 12, 13]
    for step, lr in seen["lr"].items():
        assert lr == pytest.approx(_linear_decay(0.01, 14 - step, 4, 0.001)), step
    # a branch whose config differs from its trunk's in anything but its budget is refused before it writes
    from blocklab.errors import ConfigError

    other = [o if o != "optim.lr=0.01" else "optim.lr=0.02" for o in WSD]
    with pytest.raises(ConfigError, match=r"optim.lr: 0.01 -> 0.02"):
        run_in_process([*other, f"optim.branch_from={trunk}", "optim.branch_step=10", "trainer.max_steps=14"],
                       tmp_path / "other")
    assert not (tmp_path / "other" / "results.json").exists()
    with pytest.raises(ConfigError, match="no kept checkpoint at step 5"):
        run_in_process([*WSD, f"optim.branch_from={trunk}", "optim.branch_step=5", "trainer.max_steps=14"],
                       tmp_path / "missing")
