"""Old run folders keep their meaning (issue 54, item 9) for the two keys whose new default changes what a run
computes: pos.yarn_ramp (new default reference; a YaRN run saved before it ramped as the paper prints it) and
attn.latent_norm (new default true; an MLA run saved before it had no latent norm). A folder saved without them reads
as paper and false: an interrupted run resumes only as it started, a finished sweep job is not reused as the new
setting, and an old MLA checkpoint still loads (as generate and analyze load it)."""
import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from blocklab.checkpoint import CHECKPOINT_CONFIG_KEY, CHECKPOINT_FILES_KEY, file_digests
from blocklab.errors import ConfigError
from blocklab.results import CHECKPOINT, MODEL_FILE, SAVED_CONFIG
from blocklab.train.resume import config_differences
from blocklab.train.run import prepare
from conftest import FAST, compose_config, run_in_process

# Both behaviours as an old run had them, set explicitly so the run trains them (RoPE's frequencies under YaRN,
# MLA without the latent norm); `make_old` then takes the two keys out, as a folder saved before them lacks them.
YARN = ["pos=rope", "pos.scaling=yarn", "pos.scaling_factor=2"]
OLD = [*YARN, "attn=mla", "pos.yarn_ramp=paper", "attn.latent_norm=false"]
NEW_KEYS = (("pos", "yarn_ramp"), ("attn", "latent_norm"))


def make_old(run_dir):
    """The folder as a BlockLab from before the two keys wrote it: its saved config, its model.json and the config
    its checkpoint carries lack them, and the checkpoint's record of the files matches the files."""
    config = OmegaConf.to_container(OmegaConf.load(run_dir / SAVED_CONFIG))
    model = json.loads((run_dir / MODEL_FILE).read_text())
    ckpt = torch.load(run_dir / CHECKPOINT, map_location="cpu", weights_only=True)
    for group, key in NEW_KEYS:
        del config[group][key], model[group]["options"][key], ckpt[CHECKPOINT_CONFIG_KEY][group][key]
    OmegaConf.save(OmegaConf.create(config), run_dir / SAVED_CONFIG)
    (run_dir / MODEL_FILE).write_text(json.dumps(model, indent=2) + "\n")
    ckpt[CHECKPOINT_FILES_KEY] = file_digests(run_dir, list(ckpt[CHECKPOINT_FILES_KEY]))
    torch.save(ckpt, run_dir / CHECKPOINT)


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """One finished run, trained as an old MLA YaRN run was, then made old."""
    run_dir = tmp_path_factory.mktemp("old") / "run"
    run_in_process([*FAST, *OLD], run_dir)
    make_old(run_dir)
    return run_dir


def test_an_old_interrupted_run_resumes_as_it_started(old_run, tmp_path):
    """Its own command, at today's defaults, resumes it with the old behaviour's values of the keys its folder
    lacks (the new defaults would compute another function), and says so."""
    run_dir = tmp_path / "run"
    shutil.copytree(old_run, run_dir)
    (run_dir / "results.json").unlink()  # what an interruption leaves
    resumed = prepare(compose_config([*FAST, *YARN, "attn=mla"], run_dir))
    assert resumed.start_step == 20
    assert resumed.model_cfg.pos.options["yarn_ramp"] == "paper"
    assert resumed.model_cfg.attn.options["latent_norm"] is False
    assert resumed.config["pos"]["yarn_ramp"] == "paper" and resumed.config["attn"]["latent_norm"] is False


def test_an_old_run_refuses_a_resume_that_sets_the_new_behaviour(old_run, tmp_path, monkeypatch):
    """A command that sets a new key itself (pos.yarn_ramp=reference) asks for another function: refused."""
    from blocklab.train import resume

    run_dir = tmp_path / "run"
    shutil.copytree(old_run, run_dir)
    (run_dir / "results.json").unlink()
    monkeypatch.setattr(resume, "keys_set_now", lambda: frozenset({"pos.yarn_ramp"}))
    with pytest.raises(ConfigError) as refused:
        prepare(compose_config([*FAST, *YARN, "attn=mla", "pos.yarn_ramp=reference"], run_dir))
    assert "pos.yarn_ramp: 'paper' -> 'reference'" in str(refused.value)


def test_an_old_mla_checkpoint_loads_as_it_trained(old_run):
    """Setup.from_run_dir(...).trained_model() is how generate and analyze load a run."""
    from blocklab.experiment import Setup

    setup = Setup.from_run_dir(old_run)
    assert setup.model_cfg.attn.options["latent_norm"] is False
    assert setup.model_cfg.pos.options["yarn_ramp"] == "paper"
    model = setup.trained_model()  # strict load: a latent norm would be a missing key
    assert all(block.attn.latent_norm is None for block in model.blocks)
    assert torch.isfinite(model(torch.zeros(1, 5, dtype=torch.long))).all()


def test_an_old_finished_sweep_job_is_not_reused_as_the_new_setting(tmp_path):
    """A sweep folder's finished job is skipped only if it trained this launch's config: an old YaRN job is the paper
    ramp, an old MLA job the layer without the norm, so a launch at the new defaults is refused naming the key; an old
    job whose setting never read the key (RoPE unscaled, or MHA) is still reused."""
    from hydra import compose, initialize_config_dir

    from blocklab.overrides import job_dirname, sweep_jobs
    from blocklab.paths import CONF_DIR
    from blocklab.results import write_results
    from blocklab.train.sweep import check_sweep_jobs

    folder = tmp_path / "sweep"

    def finished_old_job(overrides, drop):
        job = ["sweep=pe_copy", "pos=rope", "seed=0", *overrides, f"hydra.sweep.dir={folder}"]
        settings = [o for o in sweep_jobs(job)[0] if not o.startswith("hydra.")]  # as check_sweep_jobs names jobs
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
            naming = compose("config", [*settings, "run_dir=unused"], return_hydra_config=True) \
                .hydra.job.config.override_dirname
        run_dir = folder / job_dirname(settings, naming)
        (run_dir / ".hydra").mkdir(parents=True)
        write_results(run_dir, {"status": "completed"})
        saved = OmegaConf.to_container(compose_config(["sweep=pe_copy", "pos=rope", "seed=0", *overrides]),
                                       resolve=True)
        for group, key in drop:
            del saved[group][key]
        OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
        return job

    job = finished_old_job(["pos.scaling=yarn", "pos.scaling_factor=2"], [("pos", "yarn_ramp")])
    with pytest.raises(ConfigError, match=r"pos.yarn_ramp: 'paper' -> 'reference'"):
        check_sweep_jobs(job)
    shutil.rmtree(folder)
    job = finished_old_job(["attn=mla"], [("attn", "latent_norm"), ("pos", "yarn_ramp")])
    with pytest.raises(ConfigError, match=r"attn.latent_norm: False -> True"):
        check_sweep_jobs(job)
    shutil.rmtree(folder)
    assert check_sweep_jobs(finished_old_job([], [("pos", "yarn_ramp")])) == 1  # unscaled RoPE: reused


def test_a_missing_key_reads_as_the_old_behaviour_only_where_the_run_read_it():
    saved = OmegaConf.to_container(compose_config([*YARN, "attn=mla"]), resolve=True)
    current = OmegaConf.to_container(compose_config([*YARN, "attn=mla"]), resolve=True)
    for group, key in NEW_KEYS:
        del saved[group][key]
    assert config_differences(saved, current) == ["attn.latent_norm: False -> True",
                                                  "pos.yarn_ramp: 'paper' -> 'reference'"]
    unscaled = OmegaConf.to_container(compose_config([]), resolve=True)  # pos=rope, scaling none, attn=mha
    old_unscaled = {**unscaled, "pos": {k: v for k, v in unscaled["pos"].items() if k != "yarn_ramp"}}
    assert config_differences(old_unscaled, unscaled) == []
    assert config_differences(old_unscaled, unscaled, frozenset({"pos.yarn_ramp"})) == \
        ["pos.yarn_ramp: None -> 'reference'"]  # set on the command line: differs, as any key added since


def test_a_model_json_without_the_keys_reads_as_it_trained():
    """ModelConfig.from_dict (how generate and analyze read model.json): an MLA model.json without latent_norm reads
    false, so weights without a latent norm load strictly; a YaRN one without yarn_ramp reads paper; an unscaled
    RoPE one stays without it (the scheme's default, reference, should it be scaled later: analyze --eval-scaling).
    A config built from the yaml groups, even groups that lack the keys, records them at their present defaults."""
    import dataclasses

    from blocklab.model import ModelConfig, build_model
    from blocklab.model.config import PosConfig

    cfg = ModelConfig(attn=dataclasses.replace(ModelConfig().attn, kind="mla", options={"latent_norm": False}),
                      pos=PosConfig("rope", options={"scaling": "yarn", "scaling_factor": 2.0, "original_context": 8,
                                                     "yarn_ramp": "paper"}))
    old = dataclasses.asdict(cfg)
    del old["attn"]["options"]["latent_norm"], old["pos"]["options"]["yarn_ramp"]
    loaded = ModelConfig.from_dict(old)
    assert loaded.attn.options["latent_norm"] is False and loaded.pos.options["yarn_ramp"] == "paper"
    torch.manual_seed(0)
    weights = build_model(cfg).state_dict()
    assert not any("latent_norm" in key for key in weights)
    build_model(loaded).load_state_dict(weights)  # strict: the same parameters
    unscaled = dataclasses.asdict(ModelConfig(pos=PosConfig("rope", options={"scaling": "none"})))
    assert "yarn_ramp" not in ModelConfig.from_dict(unscaled).pos.options
    groups = {"model": {}, "norm": {}, "pos": {"name": "rope", "scaling": "yarn"}, "attn": {"kind": "mla"},
              "act": {}, "init": {}}
    built = ModelConfig.from_groups(groups, vocab_size=20, max_len=64)
    assert built.attn.options["latent_norm"] is True and built.pos.options["yarn_ramp"] == "reference"
