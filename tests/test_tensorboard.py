"""The offline dashboard: a sweep logged to TensorBoard holds each job's HParams (choices, swept overrides) and
results (results.json's scalars), read back with TensorBoard's own reader and served by a real `tensorboard`
over HTTP; with W&B a sweep ends with one comparison table; several loggers are one option that lists them."""
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

from blocklab.errors import ConfigError
from blocklab.experiment import run_config
from blocklab.results import read_results
from blocklab.train.hparams import result_metrics
from blocklab.train.loggers import check_loggers, logger_configs, sweep_end
from conftest import compose_config, run_cli
from helpers import wait_until

# Two tiny jobs of the causal_mask study that differ in one swept override (attn.causal) and nothing else.
SWEEP = ["-m", "sweep=causal_mask", "seed=0", "attn.causal=true,false", "logger=tensorboard", "diagnostics=none",
         "trainer.max_steps=4", "trainer.val_check_interval=4", "task.eval_examples=8", "task.eval_lengths=[4,20]"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, str]:
    sweep_dir = tmp_path_factory.mktemp("dashboard") / "causal_mask"
    proc = run_cli([*SWEEP, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir, proc.stdout + proc.stderr


def jobs(sweep_dir: Path) -> dict[bool, Path]:
    """Each job's folder by its attn.causal."""
    found = {"attn.causal=true" in map(str.lower, read_results(p.parent)["overrides"]): p.parent
             for p in sweep_dir.glob("*/results.json")}
    assert set(found) == {True, False}
    return found


def hparams_content(folder: Path) -> dict:
    events = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    return events, events.PluginTagToContent(metadata.PLUGIN_NAME)


def test_each_job_logs_its_choices_as_hparams_and_its_results_as_metrics(sweep):
    sweep_dir, output = sweep
    for causal, job in jobs(sweep_dir).items():
        results = read_results(job)
        events, content = hparams_content(job / "tensorboard")
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        hparams = MessageToDict(start)["hparams"]
        assert hparams["attn.causal"] is causal  # the swept override
        assert {k: hparams[k] for k in results["choices"]} == results["choices"] and hparams["task"] == "copy"
        end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
        assert MessageToDict(end)["status"] == "STATUS_SUCCESS"
        expected = {"final_val_loss": results["final_val_loss"], "params": results["params"],
                    "exact_match@20": results["eval"][1]["exact_match"], "token_acc@4": results["eval"][0]["token_acc"],
                    "decode.kv_cache_bytes_per_token": results["decode"]["kv_cache_bytes_per_token"]}
        for name, value in expected.items():
            assert math.isclose(events.Scalars(f"results/{name}")[-1].value, value, rel_tol=1e-6), name
        assert events.Scalars("val/loss")  # the curves, as before
    # TensorBoard prints nothing to a run's console (Hydra's launch lines name the logger option)
    assert not [line for line in output.splitlines() if re.search("tensorflow|tensorboard|warn", line, re.I)
                and "[HYDRA]" not in line and not line.startswith("warning: in-distribution exact match")]


def test_the_sweep_ends_with_one_experiment_whose_filters_are_every_value_each_choice_took(sweep):
    sweep_dir, _ = sweep
    _, content = hparams_content(sweep_dir / "tensorboard")
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    infos = {info.name: MessageToDict(info) for info in experiment.hparam_infos}
    assert infos["attn.causal"]["domainDiscrete"] == [False, True] and infos["attn.causal"]["differs"]
    assert infos["norm"]["domainDiscrete"] == ["pre_ln"] and not infos["norm"].get("differs")
    assert infos["seed"]["type"] == "DATA_TYPE_FLOAT64"
    metrics = [info.name.tag for info in experiment.metric_infos]
    measured = {name for job in jobs(sweep_dir).values() for name in result_metrics(read_results(job))}
    assert sorted(metrics) == sorted(f"results/{name}" for name in measured)  # not the training curves
    assert {"results/final_val_loss", "results/exact_match@20"} <= set(metrics)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tensorboard_serves_both_jobs_hparams_and_filters_them_by_choice(sweep, tmp_path):
    sweep_dir, _ = sweep
    port = free_port()
    tensorboard = shutil.which("tensorboard", path=str(Path(sys.executable).parent))
    assert tensorboard, "the tensorboard command is installed with the package"
    with open(tmp_path / "tensorboard.log", "w") as log:
        server = subprocess.Popen([tensorboard, "--logdir", str(sweep_dir), "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}/data/plugin/hparams"
    try:
        experiment = {}

        def hparams_loaded() -> bool:  # it loads the logdir in the background
            try:
                experiment.update(post(f"{base}/experiment", {"experimentName": ""}))
            except OSError:
                return False
            return bool(experiment.get("hparamInfos"))

        assert wait_until(hparams_loaded, server, timeout=90, every=0.5), (tmp_path / "tensorboard.log").read_text()
        assert {"name": "attn.causal", "differs": True}.items() <= next(
            i for i in experiment["hparamInfos"] if i["name"] == "attn.causal").items()
        request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
                   "allowedStatuses": ["STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_UNKNOWN", "STATUS_RUNNING"],
                   "colParams": [{"hparam": "attn.causal"}, {"metric": {"group": "", "tag": "results/final_val_loss"}}]}
        groups = post(f"{base}/session_groups", request)["sessionGroups"]
        only_causal = post(f"{base}/session_groups", {**request, "colParams": [
            {"hparam": "attn.causal", "filterDiscrete": [True]}]})["sessionGroups"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    job = jobs(sweep_dir)
    assert {g["name"] for g in groups} == {f"{job[True].name}/tensorboard", f"{job[False].name}/tensorboard"}
    for group in groups:
        results = read_results(job[group["hparams"]["attn.causal"]])
        [value] = [m["value"] for m in group["metricValues"] if m["name"]["tag"] == "results/final_val_loss"]
        assert math.isclose(value, results["final_val_loss"], rel_tol=1e-6)
    assert [g["name"] for g in only_causal] == [f"{job[True].name}/tensorboard"]


def test_with_wandb_a_sweep_ends_with_one_comparison_table_of_all_jobs(sweep, tmp_path):
    sweep_dir = shutil.copytree(sweep[0], tmp_path / "causal_mask")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}, "study": {"name": "causal_mask"},
                               "logger": compose_config(["logger=wandb_tensorboard"]).logger})
    sweep_end(config)
    sweep_end(config)  # a relaunch that ran no job: the same rows, no second table
    [run] = (sweep_dir / "wandb").glob("offline-run-*")
    [table_file] = run.glob("files/media/table/sweep/comparison_*.table.json")
    table = json.loads(table_file.read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    for causal, job in jobs(sweep_dir).items():
        [row] = [r for r in rows if r["job"] == job.name]
        results = read_results(job)
        assert row["attn.causal"] is causal and row["status"] == "completed" and row["norm"] == "pre_ln"
        assert math.isclose(row["final_val_loss"], results["final_val_loss"])
        assert row["exact_match@20"] == results["eval"][1]["exact_match"]
    assert len(rows) == 2
    assert (sweep_dir / "tensorboard").is_dir()  # the TensorBoard logger's sweep-end step ran too


def test_several_loggers_are_one_option_that_lists_them():
    def logger_group(overrides):  # the resolved `logger` group, as a run has it (RunConfig)
        return run_config(compose_config(overrides))["logger"]

    both = logger_configs(logger_group(["logger=wandb_tensorboard", "logger.wandb.mode=online"]))
    assert {key: cfg["_target_"].rsplit(".", 1)[1] for key, cfg in both.items()} == {
        "logger.wandb": "WandbLogger", "logger.tensorboard": "TensorBoardLogger"}
    assert both["logger.wandb"]["mode"] == "online"
    check_loggers(logger_group(["logger=wandb_tensorboard"]))
    assert logger_configs(logger_group(["logger=none"])) == {}
    with pytest.raises(ConfigError, match=r"^logger.mode, logger.project not taken by .*TensorBoardLogger; .*"
                                          r"logger=wandb_tensorboard"):
        check_loggers(logger_group(["logger=[wandb,tensorboard]"]))
