"""The CPU description beside bench figures, the warning for bfloat16 on a CPU that emulates it, and glibc's malloc
set to keep the memory a step frees."""
import ctypes
import platform
import subprocess
import sys

import pytest

from blocklab import hardware
from conftest import FAST, run_in_process


@pytest.fixture
def cpuinfo(monkeypatch):
    def set_flags(flags: str):
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: {"model name": "Test CPU", "flags": flags})
    return set_flags


@pytest.mark.parametrize("flags, native", [("fpu avx avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                           ("avx2 amx_tile amx_bf16", True), ("", None)])
def test_native_bf16_reads_the_cpu_flags(cpuinfo, flags, native):
    cpuinfo(flags)
    assert hardware.native_bf16() is native


def test_describe_names_the_cpu_and_only_the_flags_that_pick_kernels(cpuinfo):
    cpuinfo("fpu sse avx avx2 fma avx512_bf16 avx512f")
    machine = hardware.describe()
    assert machine["cpu"] == "Test CPU" and machine["native_bf16"] is True
    assert machine["flags"] == ["avx2", "fma", "avx512f", "avx512_bf16"]  # fpu, sse, avx are not listed


def test_bf16_on_an_emulating_cpu_warns_with_the_fix_and_nothing_else_does(cpuinfo):
    cpuinfo("avx2 fma")
    line = hardware.precision_warning("cpu", "bf16-mixed")
    assert "Test CPU" in line and "17x slower" in line and "trainer.precision=32-true" in line
    assert hardware.precision_warning("cpu", "32-true") is None
    cpuinfo("avx2 avx512_bf16")
    assert hardware.precision_warning("cpu", "bf16-mixed") is None
    cpuinfo("")  # cannot tell: no warning rather than a false one
    assert hardware.precision_warning("cpu", "bf16-mixed") is None


def test_a_bf16_run_on_an_emulating_cpu_prints_the_warning_once_and_trains(cpuinfo, capsys, tmp_path):
    cpuinfo("avx2 fma")
    run_in_process([*FAST, "trainer.precision=bf16-mixed"], tmp_path / "run")
    err = capsys.readouterr().err
    assert err.count("trainer.precision=bf16-mixed on a CPU without native bfloat16") == 1
    assert (tmp_path / "run" / "results.json").exists()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere nothing is set")
def test_kept_freed_memory_spares_each_training_step_its_page_faults():
    """The default copy model's steps after 30 of warm-up, each variant in a process of its own: glibc's default
    hands part of a step's freed activations back to the kernel, and the next step faults them in again."""
    from blocklab.bench.malloc import train_steps

    faults = {variant: train_steps(variant, "full", 1, 30, 1, 30)["faults_per_step"] for variant in ("default", "kept")}
    for _ in range(2):  # glibc's default raises its thresholds as blocks come and go: a process can settle early,
        if faults["default"] >= 100:  # and then there is nothing to spare; another process measures it again
            break
        faults["default"] = train_steps("default", "full", 1, 30, 1, 30)["faults_per_step"]
    # A kept process can still grow its heap once in a while under load, but not at every step.
    assert faults["default"] >= 100 and faults["kept"] <= faults["default"] / 10, faults


def test_without_glibc_malloc_is_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda *args, **kwargs: ("", ""))
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: pytest.fail("no libc to call on this system"))
    assert hardware.keep_freed_memory.__wrapped__() is False


def test_a_run_keeps_freed_memory_for_its_next_step(monkeypatch, tmp_path):
    import blocklab.train.run

    calls = []
    monkeypatch.setattr(blocklab.train.run, "keep_freed_memory", lambda: calls.append(True))
    run_in_process(FAST, tmp_path / "run")
    assert calls == [True] and (tmp_path / "run" / "results.json").exists()
