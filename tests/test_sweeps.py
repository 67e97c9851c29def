"""Sweep files expand to the expected jobs, every job config is valid, a sweep resumes after a kill,
and the report renders in a real browser."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import blocklab.modifications  # noqa: F401 - ${modifications:} in the modifications sweep's params
from blocklab.errors import ConfigError
from blocklab.report.build import check_plots
from blocklab.train.run import prepare
from blocklab.train.job import one_job_at_a_time
from conftest import CONF, ROOT, compose_config, report_page
from helpers import wait_until

SWEEPS = CONF / "sweep"
EXPECTED_JOBS = {"head_count": 36, "pe_copy": 21, "pe_addition": 21, "pe_lm": 21, "init_depth": 108,
                 "norm_placement": 24, "activations": 24, "attention_variants": 12, "causal_mask": 6,
                 "rank_collapse": 36, "attention_scale": 12, "addition_format": 12, "attention_kinds": 60,
                 "sparse_patterns": 24, "length_gen_copy": 36, "length_gen_addition": 36, "attention_cost": 48, "architecture": 12, "architecture_lm": 6, "norm_type": 48, "init_depth_rezero": 24,
                 "ffn_width": 24, "recipe": 24, "moe": 12, "modifications": 183, "frontier": 33, "lr_sensitivity": 90,
                 "value_residual_depth": 18, "muon_lr": 42,
                 "attention_patterns": 12, "mlm_nsp": 6, "recall": 72, "context_extension": 54,
                 "activations_ladder": 45, "head_count_ladder": 30, "moe_ladder": 30,
                 "recipe_ladder": 30, "activations_tokens": 36, "attention_kinds_ladder": 60,
                 "modifications_ladder": 90}


def expand(name: str) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper makes from a sweep file's params (glob(*) expands
    to the group's files, as in a real multirun)."""
    params = OmegaConf.load(SWEEPS / f"{name}.yaml")["hydra"]["sweeper"]["params"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        overrides = parser.parse_overrides([f"{key}={value}" for key, value in params.items()])
        return BasicSweeper.split_arguments(overrides, max_batch_size=None)[0]


def test_every_exercise_has_a_sweep_file():
    assert {p.stem for p in SWEEPS.glob("*.yaml")} == set(EXPECTED_JOBS)


def test_every_exercise_but_the_proof_is_named_in_a_sweep_header():
    """Exercises 1.1-1.14 each have a sweep that names them; 1.6 is a proof, answered by a test."""
    named = set()
    for path in SWEEPS.glob("*.yaml"):
        header = " ".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        for listing in re.findall(r"[Ee]xercises? ((?:1\.\d+(?:, | and )?)+)", header):
            named |= set(re.findall(r"1\.\d+", listing))
    assert {f"1.{i}" for i in range(1, 15)} - {"1.6"} <= named


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_a_bar_never_pools_settings(name):
    """A bar's error bar is an interval over the seeds of one setting: every key the sweep varies (but the seed)
    is one of its `by` keys or fixed by its `where`."""
    values: dict[str, set] = {}
    for job in expand(name):
        for override in job:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    varied = {key for key, seen in values.items() if len(seen) > 1} - {"seed"}
    for plot in OmegaConf.load(SWEEPS / f"{name}.yaml").study.get("plots", []):
        if plot.kind == "bar":
            by = [plot.by] if isinstance(plot.by, str) else list(plot.by)
            assert varied <= {*by, *plot.get("where", {})}, (plot.metric, varied - {*by, *plot.get("where", {})})


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_every_plot_a_sweep_file_asks_for_passes_the_report_check(name, tmp_path):
    """A plot spec the report would refuse fails here, not after the sweep has trained."""
    study = OmegaConf.to_container(compose_config([f"sweep={name}"], tmp_path).study, resolve=True)
    assert study.get("plots"), name
    check_plots(study)


@pytest.mark.parametrize("name", sorted(EXPECTED_JOBS))
def test_sweep_expands_to_valid_jobs(name, tmp_path):
    jobs = expand(name)
    assert len(jobs) == EXPECTED_JOBS[name]
    header = (SWEEPS / f"{name}.yaml").read_text().splitlines()[:8]
    assert any(f"python train.py -m sweep={name}" in line for line in header)  # the documented command
    assert any("min on 2 CPU cores" in line for line in header)  # the stated time budget
    # A job's seed never decides whether its config is valid: check one seed of each setting.
    settings = {tuple(o for o in job if not o.startswith("seed=")): job for job in jobs}
    for i, job in enumerate(settings.values()):
        cfg = compose_config([f"sweep={name}", *job], tmp_path / str(i))
        assert cfg.study.name == name and (cfg.trainer.max_steps > 0 or cfg.trainer.resume_from is not None)
        if cfg.trainer.resume_from is not None:  # a continuation of another sweep's runs, which are not here:
            with pytest.raises(ConfigError, match=f"trainer.resume_from={cfg.trainer.resume_from}: .* is not a "
                                                  "finished BlockLab run"):
                prepare(cfg)  # refused in one line, as its launch would be; the rest checked without the source
            cfg = compose_config([f"sweep={name}", *job, "trainer.resume_from=null", "trainer.max_steps=1"],
                                 tmp_path / str(i))
        prepare(cfg)  # raises ConfigError on an invalid combination
    scaled = compose_config([f"sweep={name}", "study.scale=4"], tmp_path / "scaled")
    assert scaled.trainer.max_steps == 4 * compose_config([f"sweep={name}"], tmp_path / "base").trainer.max_steps
    bigger = [line for line in header if "study.scale=4" in line]  # where the header says the 4x study goes
    for line in bigger:
        assert f"writes {sweep_dirs([f'sweep={name}', 'study.scale=4'])[0]})" in line, line


@pytest.mark.parametrize("name", ["pe_copy", "pe_addition", "pe_lm"])
def test_position_sweeps_enumerate_every_scheme(name):
    """`pos: glob(*)`: a new conf/pos file joins the position sweeps by itself; today's jobs are the ones
    the typed list `none,sinusoidal,learned,t5_bias,rope,alibi,fire` made (their folder names included)."""
    jobs = expand(name)
    typed = {("pos=" + pos, f"seed={seed}") for pos in ("none", "sinusoidal", "learned", "t5_bias", "rope", "alibi",
                                                         "fire")
             for seed in range(3)}
    assert {tuple(job) for job in jobs} == typed
    assert {job[0].removeprefix("pos=") for job in jobs} == {p.stem for p in (CONF / "pos").glob("*.yaml")}


def test_sparse_patterns_jobs_are_sized_so_the_supports_decide(tmp_path):
    """Every sparse job has the sweep's window, whose reach through the model's layers is shorter than periodic's
    period and than keyed's longest training length; strided's stride is the period and global holds the first
    token; full attention has no window."""
    for i, job in enumerate(expand("sparse_patterns")):
        cfg = compose_config(["sweep=sparse_patterns", *job], tmp_path / str(i))
        if cfg.attn.pattern is None:
            assert cfg.attn.window is None and prepare(cfg).model_cfg.attn_label == "mha"
            continue
        reach = cfg.model.n_layers * (cfg.attn.window - 1)
        assert reach < (cfg.task.period if cfg.task.name == "periodic" else cfg.task.max_len)
        if cfg.task.name == "periodic" and cfg.attn.pattern == "strided":
            assert cfg.attn.stride == cfg.task.period
        if cfg.attn.pattern == "global":
            assert cfg.attn.n_global >= 1


def sweep_dirs(overrides: list[str]) -> tuple[str, str]:
    """hydra.sweep.dir and .subdir as a multirun resolves them (job num 7, overrides `seed=1`)."""
    from blocklab.cli import main  # noqa: F401  registers the config's resolvers, as the Hydra app does

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    cfg.hydra.job.num, cfg.hydra.job.override_dirname = 7, "seed=1"
    return cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir


def test_sweep_files_write_to_their_study_folder_and_other_multiruns_to_a_dated_one():
    assert sweep_dirs(["sweep=pe_copy"]) == ("outputs/sweeps/pe_copy", "seed=1")
    assert sweep_dirs(["sweep=causal_mask", "study.scale=1"]) == ("outputs/sweeps/causal_mask", "seed=1")
    # a bigger study is another experiment: its jobs must not be skipped as the 1x ones' (nor overwrite them)
    assert sweep_dirs(["sweep=causal_mask", "study.scale=4"]) == ("outputs/sweeps/causal_mask-scale4", "seed=1")
    assert sweep_dirs(["sweep=causal_mask", "study.scale=0.5"]) == ("outputs/sweeps/causal_mask-scale0.5", "seed=1")
    directory, subdir = sweep_dirs([])
    assert directory.startswith("outputs/multirun/") and len(Path(directory).parts) == 4 and subdir == "7"
    for path in SWEEPS.glob("*.yaml"):  # the layout is defined once, in config.yaml
        assert "dir:" not in path.read_text(), path.name


def test_a_launch_that_would_reuse_a_job_trained_otherwise_or_mix_scales_is_refused_before_any_work(tmp_path):
    """A sweep file's folder skips finished jobs and resumes interrupted ones: a job found there stands for this
    launch's only if it trained this launch's config, and one launch cannot sweep study.scale (two scales would
    share the folder and the job names)."""
    from blocklab.errors import ConfigError
    from blocklab.results import write_results
    from blocklab.train.sweep import check_sweep_jobs

    folder = tmp_path / "sweep"
    job = ["sweep=pe_copy", "pos=rope", "seed=0", f"hydra.sweep.dir={folder}"]
    with pytest.raises(ConfigError, match=r"^study.scale takes one value per launch of a sweep file \(1, 2 asked\)"):
        check_sweep_jobs([*job, "study.scale=1,2"])

    run_dir = folder / "pos=rope,seed=0"
    (run_dir / ".hydra").mkdir(parents=True)
    write_results(run_dir, {"status": "completed"})
    saved = compose_config(job[:-1])
    OmegaConf.save(saved, run_dir / ".hydra" / "config.yaml", resolve=True)
    assert check_sweep_jobs(job) == 1  # the same config: skipped as finished
    assert check_sweep_jobs([*job, "logger=none", "diagnostics=none"]) == 1  # nothing that changes results

    saved.optim.lr = saved.optim.lr * 2  # e.g. the sweep file was edited after the job ran
    OmegaConf.save(saved, run_dir / ".hydra" / "config.yaml", resolve=True)
    with pytest.raises(ConfigError) as refused:
        check_sweep_jobs(job)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"{run_dir} was trained with another config")
    assert f"optim.lr: {saved.optim.lr}" in message and "study.name=NEW_NAME" in message
    assert (run_dir / "results.json").exists()  # refused, not cleaned up

    (run_dir / "results.json").unlink()  # an interrupted job, whose checkpoint would be resumed, is held to it too
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match="optim.lr"):
        check_sweep_jobs(job)
    steps = saved.trainer.max_steps  # a folder named by hand (hydra.sweep.dir) holds one scale as well
    with pytest.raises(ConfigError, match=f"trainer.max_steps: {steps} -> {2 * steps}"):
        check_sweep_jobs([*job, "study.scale=2"])


def test_a_job_folder_written_by_a_packed_sweep_resumes_and_is_reused(tmp_path):
    """Seed packing is gone (docs/decisions/seed-packing.md), but folders its sweeps wrote saved study.pack_seeds in
    their config: an interrupted job resumes from its checkpoint, and a finished one is still skipped as finished."""
    from blocklab.results import write_results
    from blocklab.train.run import run
    from blocklab.train.sweep import check_sweep_jobs

    folder = tmp_path / "sweep"
    job = ["sweep=pe_copy", "pos=rope", "seed=0", "trainer.max_steps=3", "trainer.val_check_interval=3",
           "task.eval_examples=4", "logger=none", "diagnostics=none"]
    run_dir = folder / "pos=rope,seed=0,task.eval_examples=4,trainer.max_steps=3,trainer.val_check_interval=3"
    config = compose_config(job)
    config.run_dir = str(run_dir)  # a job folder's name holds `=`, which an override's value cannot
    run(config)  # a real checkpoint at step 3
    (run_dir / "results.json").unlink()  # what an interruption leaves
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"))
    saved["study"]["pack_seeds"] = True
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    assert prepare(config).start_step == 3
    write_results(run_dir, {"status": "completed"})
    assert check_sweep_jobs([*job, f"hydra.sweep.dir={folder}"]) == 1


def test_the_sweep_check_composes_each_jobs_config_as_hydra_would(tmp_path):
    """Jobs that differ only in seed share one composition in the pre-launch check: each job's config must still
    equal its own composition, a value that interpolates the seed included."""
    from blocklab.overrides import sweep_jobs
    from blocklab.train.sweep import job_configs

    jobs = sweep_jobs(["sweep=pe_copy", "seed=0,1,2", "+task.stream_seed=${seed}"])
    assert len(jobs) > 3 and len({tuple(j) for j in jobs}) == len(jobs)
    expected = [OmegaConf.to_container(compose_config(job), resolve=True) for job in jobs]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        shared = job_configs(jobs, lambda settings: compose("config", [*settings, "run_dir=unused"]))
    assert shared == expected
    assert {c["task"]["stream_seed"] for c in shared} == {0, 1, 2} == {c["seed"] for c in shared}


def launcher(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config", overrides=overrides,
                                              return_hydra_config=True).hydra.launcher)


def test_sweeps_run_jobs_side_by_side_except_those_that_time_them():
    """Side by side, jobs share the cores and the memory bus: a sweep whose question is speed runs one at a time."""
    assert launcher(["sweep=pe_copy"])["n_jobs"] == -1
    for timed in ("attention_cost", "attention_variants", "attention_kinds"):
        assert one_job_at_a_time(launcher([f"sweep={timed}"])), timed


def sweep_cmd(sweep_dir: Path) -> list[str]:
    """Two workers (hydra.launcher.n_jobs=2): two of the four jobs at a time on any number of cores."""
    return [sys.executable, str(ROOT / "train.py"), "-m", "sweep=causal_mask", "seed=0,1", "logger=wandb",
            "trainer.max_steps=30", "trainer.val_check_interval=30", "task.eval_examples=16", "diagnostics=none",
            "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep_dir}"]


def test_sweep_survives_a_kill_resumes_and_reports(tmp_path):
    sweep_dir = tmp_path / "causal_mask"
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = subprocess.Popen(sweep_cmd(sweep_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: list(sweep_dir.glob("*/results.json")), proc, timeout=300, every=0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]  # still running: the kill lands mid-sweep
    os.killpg(proc.pid, signal.SIGKILL)  # kill the whole sweep once the first pair finishes, before the second does
    proc.wait()
    finished = {p: p.read_bytes() for p in sweep_dir.glob("*/results.json")}
    assert 1 <= len(finished) <= 2

    rerun = subprocess.run(sweep_cmd(sweep_dir), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stdout.count("skip ") == len(finished)
    results = sorted(sweep_dir.glob("*/results.json"))
    assert len(results) == 4
    assert all(json.loads(p.read_text())["status"] == "completed" for p in results)
    assert all(p.read_bytes() == data for p, data in finished.items())  # finished results untouched

    # W&B: the runs of one launch share a group, job_type is the task, tags are the swept overrides.
    job_dir = next(sweep_dir.glob("attn.causal=False,*seed=1,*"))  # stable name: the job's overrides
    run = next(job_dir.glob("wandb/offline-run-*"))
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent))
    summary = json.loads(subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(run)],
                                        capture_output=True, text=True, timeout=120).stdout)
    assert "attn.causal=False" in summary["tags"] and "seed=1" in summary["tags"]
    records = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(run)], capture_output=True, text=True,
                             timeout=120).stdout
    assert '"job_type":"copy"' in records and '"run_group":"causal_mask-' in records

    report = subprocess.run([sys.executable, "-m", "blocklab.report", str(sweep_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    index = sweep_dir / "report" / "index.html"
    page = index.read_text()
    assert "<h2>causal_mask</h2>" in page and "What the numbers show" in page and "data:image/png;base64," in page
    summary_csv = (sweep_dir / "report" / "summary.csv").read_text().splitlines()
    assert len(summary_csv) == 5 and "exact_match_in" in summary_csv[0]
    # Each setting's row in the metrics table: the mean of its two seeds' final_train_loss, from results.json.
    table = re.search(r"<table class=.metrics.>(.*?)</table>", page, re.S).group(1)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)]
    by_setting = {row[0]: row for row in cells if row}
    for causal in ("True", "False"):
        losses = [json.loads(p.read_text())["final_train_loss"] for p in results
                  if f"attn.causal={causal}" in p.parent.name]
        assert len(losses) == 2 and f"{sum(losses) / 2:.3f}" in by_setting[causal], by_setting
    render_in_browser(index)


def render_in_browser(index: Path) -> None:
    """Open the report in headless Chromium: its tables and every image must actually render."""
    with report_page(index) as page:
        assert page.locator("table").count() >= 1 and page.locator("table.metrics tbody tr").count() == 2
        images = page.locator("img")
        assert images.count() >= 2
        assert page.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 100)")
        assert page.locator("h2").first.inner_text() == "causal_mask"


def job_dir_name(overrides: list[str]) -> str:
    """A sweep job's folder name (hydra.job.override_dirname), as Hydra composes it from the job's overrides."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True).hydra.job.override_dirname


@pytest.mark.parametrize("extras", [
    ["logger=none", "diagnostics=none", "checkpoint_every=7"],
    ["logger.mode=online", "diagnostics.every_n_steps=50", "resume=false", "run_dir=elsewhere", "study.scale=2",
     "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweep.dir=elsewhere"],
])
def test_job_names_leave_out_what_does_not_change_results(extras):
    """A relaunch with another logger, diagnostics or checkpoint schedule finds the same finished jobs."""
    assert job_dir_name(["sweep=pe_copy", *extras, "pos=rope", "seed=0"]) == "pos=rope,seed=0"
    assert job_dir_name(["sweep=pe_copy", "pos=rope", "seed=0"]) == "pos=rope,seed=0"


@pytest.mark.parametrize("group", ["logger", "diagnostics"])
def test_every_key_of_logger_and_diagnostics_stays_out_of_job_names(group):
    """Hydra matches excluded keys exactly: each key these groups define must be listed in config.yaml."""
    from blocklab.naming import names_the_job

    for option in (CONF / group).glob("*.yaml"):
        cfg = compose_config([f"{group}={option.stem}"])
        for key in OmegaConf.to_container(cfg[group]):
            assert not names_the_job(f"{group}.{key}=x"), f"{group}.{key} ({option.name}) would name sweep jobs"
    assert names_the_job("pos=rope") and names_the_job("+model.d_ff=8")
    assert not names_the_job("hydra/launcher=joblib") and not names_the_job("hydra.launcher.n_jobs=2")


def test_a_sweep_job_trains_with_the_step_count_its_file_interpolates(run_dir):
    """A sweep file's trainer.max_steps is ${mul:N,${study.scale}}: the trainer must get it resolved (every other
    sweep test overrides max_steps, which hid a trainer built from an unresolved copy)."""
    from blocklab.results import read_results
    from conftest import run_in_process

    run_in_process(["sweep=attention_cost", "attn=mha", "task.block_size=256", "logger=none"], run_dir)
    assert read_results(run_dir)["steps"] == 20


def test_a_fixed_example_budget_gives_each_batch_size_its_own_step_count(tmp_path):
    """norm_type's ${div:38400,${task.batch_size}}: 38,400 examples are 600 steps at batch 64 and 9,600 at batch 4
    (by hand), 4x at study.scale=4; a batch size that does not divide the budget is refused, not rounded."""
    import blocklab

    steps = {b: compose_config(["sweep=norm_type", f"task.batch_size={b}"], tmp_path / str(b)).trainer.max_steps
             for b in (4, 64)}
    assert steps == {4: 9600, 64: 600}
    assert compose_config(["sweep=norm_type", "task.batch_size=4", "study.scale=4"], tmp_path / "s4").trainer.max_steps == 38400
    with pytest.raises(ValueError, match="div needs two positive integers"):
        blocklab._div(38400, 7)
