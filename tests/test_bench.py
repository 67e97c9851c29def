"""Smoke test of the benchmark suite at tiny size: every benchmark runs and writes its JSON fields.
No timing thresholds: figures at this size mean nothing."""
import json
import math

import pytest

from blocklab.bench.__main__ import main
from blocklab.bench.suites import BENCHMARKS

FIELDS = {
    "step": {"matmul_peak_gflops", "matmul_peak_gflops_bf16", "tokens_per_step"},
    "overhead": {"overhead", "pairs"},
    "startup": {"first_step_s", "multirun_per_job_s", "debug_run_s"},
    "attention": set(),
    "decode": {"new_tokens"},
    "activations": set(),
    "launch": {"sweep"},
    "malloc": set(),
    "kernels": {"device"},
    "masked": {"threads"},
    "debug_mqar": {"copy_runs_s"},
}
ROW_FIELDS = {
    "step": {"axis", "variant", "ms", "tokens_per_s", "gflop_per_step", "peak_fraction", "vs_nope"},
    "overhead": {"loop", "precision", "ms"},
    "startup": {"measure", "s"},
    "attention": {"length", "pos", "path", "ms", "peak_mb"},
    "decode": {"attn", "mode", "ms", "tokens_per_s", "kv_cache_bytes"},
    "activations": {"act", "ms", "vs_fastest"},
    "launch": {"way", "s", "runs", "exact_match_in", "final_train_loss", "vs_one_after_another"},
    "malloc": {"threads", "malloc", "ms_per_step", "faults_per_step", "vs_default"},
    "kernels": {"device", "precision", "length", "pos", "kernel", "ms", "vs_nope_auto", "peak_mb"},
    "masked": {"task", "logits at", "vocab", "positions", "ms_median", "ms_best"},
    "debug_mqar": {"kind", "mqar_s", "copy_mha_s", "vs_copy_mha", "cpu_vs_copy_mha", "met"},
}


# startup, launch and debug_mqar start many processes (~1 min each at tiny size)
SLOW = ("startup", "launch", "debug_mqar")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BENCHMARKS])
def test_benchmark_runs_at_tiny_size_and_writes_json(name, tmp_path):
    out = tmp_path / "bench.json"
    assert main([name, "--size", "tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["benchmarks"][name]
    assert FIELDS[name] <= set(result)
    assert result["rows"] and all(ROW_FIELDS[name] <= set(row) for row in result["rows"])
    assert result["targets"]
    if name == "startup":  # every launch was measured (a job the probe cannot see would leave NaN)
        assert all(math.isfinite(row["s"]) and row["s"] >= 0 for row in result["rows"])  # W&B's finish: ~5 ms
        # The debug run's phases follow one another: they add up to its wall time, and W&B's init and finish lie
        # inside the phases they belong to.
        s = {row["measure"].strip(): row["s"] for row in result["rows"]}
        phases = {k.split(". ", 1)[0]: v for k, v in s.items() if k[:1].isdigit()}
        assert sorted(phases) == ["1", "2", "3", "4"] and all(v > 0 for v in phases.values())
        assert sum(phases.values()) == pytest.approx(s["debug run, default logger (W&B offline): start to exit"],
                                                     abs=0.03)
        assert s["in it: wandb.init"] <= phases["1"] and s["in it: W&B run finish"] <= phases["4"]
    if name == "debug_mqar":  # each kind timed between two copy runs, its ratio to their mean and the verdict on it
        assert len(result["copy_runs_s"]) == len(result["rows"]) + 1
        for row in result["rows"]:
            assert row["vs_copy_mha"] == pytest.approx(row["mqar_s"] / row["copy_mha_s"], abs=0.01)
            assert row["met"] == result["targets"][f"{row['kind']}_vs_copy_mha"]["met"]
    if name == "launch":  # every way ran the whole sweep and found what the others found
        assert [row["way"] for row in result["rows"]] == ["jobs one after another", "jobs side by side"]
        assert {row["runs"] for row in result["rows"]} == {4}
        assert max(r["final_train_loss"] for r in result["rows"]) - min(r["final_train_loss"] for r in result["rows"]) \
            < 0.05
    for verdict in result["targets"].values():
        assert {"value", "target", "met", "off_by"} <= set(verdict)
        assert verdict["met"] == (verdict["off_by"] == 0.0)


def test_decode_reports_smaller_caches_for_fewer_kv_heads(tmp_path):
    out = tmp_path / "bench.json"
    main(["decode", "--size", "tiny", "--out", str(out)])
    rows = json.loads(out.read_text())["benchmarks"]["decode"]["rows"]
    size = {r["attn"]: r["kv_cache_bytes"] for r in rows if r["mode"] == "cached"}
    assert size["mha"] == 2 * size["gqa"] == 4 * size["mqa"] > 0


def test_step_and_overhead_measure_bf16_mixed_beside_float32(tmp_path):
    out = tmp_path / "bench.json"
    main(["step", "overhead", "--size", "tiny", "--out", str(out)])
    bench = json.loads(out.read_text())["benchmarks"]
    assert {"variant": "bf16-mixed", "axis": "precision"}.items() <= next(
        r for r in bench["step"]["rows"] if r["axis"] == "precision").items()
    assert {(r["loop"], r["precision"]) for r in bench["overhead"]["rows"]} == {
        (loop, p) for loop in ("lightning", "plain") for p in ("32-true", "bf16-mixed")}
    assert {"lightning_vs_plain", "lightning_vs_plain_bf16"} <= set(bench["overhead"]["targets"])
    assert bench["overhead"]["pairs"] >= 1  # Lightning steps each timed beside a plain step


def test_a_miss_too_small_to_round_still_reads_as_a_miss():
    from blocklab.bench.common import verdict

    missed = verdict(1.0002, 1.0)
    assert missed["met"] is False and missed["off_by"] == 0.001
    assert verdict(1.0, 1.0) == {"value": 1.0, "target": 1.0, "met": True, "off_by": 0.0}
