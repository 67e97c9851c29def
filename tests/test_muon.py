"""optim=muon: torch.optim.Muon on the hidden matrices and AdamW on the rest, as one optimizer object.

The oracle for the update is torch itself (torch.optim.Muon and AdamW, 2.13.0) built by hand on the split the
references make (Keller Jordan's Muon README, "Muon is Scalable"'s Moonlight examples): hidden matrices to Muon;
embeddings, the output head, norms and biases to AdamW. The test checks the split against a list written out here
for the tiny model, and one step of the combined optimizer against the two torch optimizers stepped apart."""
import copy

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.experiment import Setup
from blocklab.model import build_model
from blocklab.optim import MuonWithAdamW, build_optimizer, hidden_matrices, optimizer_errors
from blocklab.results import read_results
from blocklab.train.module import restore_error
from blocklab.train.run import prepare
from conftest import FAST, compose_config, run_in_process

MUON = ["optim=muon", "logger=none", "diagnostics=none", "model.d_model=32"]


def setup_for(overrides):
    return Setup.from_config(compose_config([*MUON, *overrides]))


def test_the_hidden_matrices_are_every_block_linear_and_nothing_else():
    setup = setup_for([])
    model = build_model(setup.model_cfg)
    names = {id(p): name for name, p in model.named_parameters()}
    hidden = sorted(names[id(p)] for p in hidden_matrices(model))
    expected = sorted(f"blocks.{i}.{part}.weight" for i in range(setup.model_cfg.n_layers)
                      for part in ("attn.qkv_proj", "attn.out_proj", "ffn.in_proj", "ffn.out_proj"))
    assert hidden == expected, hidden
    optimizer = build_optimizer(model, dict(setup.config["optim"]))
    muon, adamw = optimizer.optimizers
    in_adamw = sorted(names[id(p)] for group in adamw.param_groups for p in group["params"])
    assert "tok_emb.weight" in in_adamw and not any(name in hidden for name in in_adamw)
    assert len(in_adamw) + len(hidden) == len(names)  # every parameter, once (the tied head is tok_emb.weight)


def test_one_step_equals_torch_muon_and_adamw_stepped_apart():
    setup = setup_for([])
    torch.manual_seed(0)
    model = build_model(setup.model_cfg)
    twin = copy.deepcopy(model)
    optim = dict(setup.config["optim"])
    combined = build_optimizer(model, optim)
    hidden = hidden_matrices(twin)
    ids = {id(p) for p in hidden}
    rest = [p for p in twin.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(hidden, lr=optim["lr"], weight_decay=optim["weight_decay"], momentum=0.95,
                            nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": optim["weight_decay"]},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=optim["lr"], betas=tuple(optim["betas"]), fused=True)
    batch = next(iter(setup.task.train_batches(0)))
    for net, step in ((model, combined.step), (twin, lambda: (muon.step(), adamw.step()))):
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(net(batch["input"]).flatten(0, 1), batch["target"].flatten(),
                                                     ignore_index=-100)
            loss.backward()
            step()
            net.zero_grad()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_schedule_reaches_both_groups():
    setup = setup_for([])
    model = build_model(setup.model_cfg)
    optimizer = build_optimizer(model, dict(setup.config["optim"]))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.25)
    assert isinstance(optimizer, MuonWithAdamW) and schedule.get_last_lr()
    assert {group["lr"] for inner in optimizer.optimizers for group in inner.param_groups} == \
        {0.25 * setup.config["optim"]["lr"]}


def test_a_muon_run_trains_clips_and_resumes_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, "optim=muon", "trainer.gradient_clip_val=1.0"]
    run_in_process(args, run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["choices"]["optim"] == "muon"
    (run_dir / "results.json").unlink()
    assert prepare(compose_config(args, run_dir)).start_step == 20  # Muon's saved state passes restore_error
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert set(state["optimizer_states"][0]) == {"muon", "adamw"}
    del state["optimizer_states"][0]["muon"]["state"][0]["momentum_buffer"]
    setup = Setup.from_config(compose_config(args, run_dir))
    assert "Muon's" in restore_error(state, setup.model_cfg)


def test_bad_options_are_one_line_before_any_work():
    assert optimizer_errors({"name": "muon", "adjust_lr": "x"}) == \
        ["optim.adjust_lr='x' is unknown; use one of ['match_rms_adamw', 'original']"]
    assert "optim.momentum" in optimizer_errors({"name": "adamw", "momentum": 0.9})[0]
    assert "optim.name='sgd' is unknown" in optimizer_errors({"name": "sgd"})[0]
    with pytest.raises(ConfigError, match="optim.ns_steps"):
        setup_for(["optim.ns_steps=0"])
