"""What the CPU can do, for the bench's figures and for precision choices. Speed figures depend on it: the same
bfloat16 step runs ~1.8x faster than float32 on a Zen 5 with AVX512-BF16 and ~17x slower on an AVX2-only EPYC."""
import ctypes
import ctypes.util
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

# The flags that decide which kernels torch's CPU build can use; the rest of /proc/cpuinfo's list is noise here.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_tile")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # a bfloat16 dot product in hardware (x86); else converted


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def native_bf16() -> bool | None:
    """Whether the CPU multiplies bfloat16 in hardware; None where that cannot be told (no /proc/cpuinfo flags):
    ARM and x86 report it differently, and guessing wrong would put a false warning on every run."""
    flags = cpu_flags()
    if not flags:
        return None
    return any(flag in flags for flag in NATIVE_BF16_FLAGS) or "bf16" in flags  # "bf16": ARMv8.6 BFloat16


def use_threads(trainer: dict, share: int | None = None) -> None:
    """Pin torch's CPU threads for a run: trainer.threads, where set; else `share` (a job's share of the cores beside
    other jobs), where given; else the count the process started with (torch's default of every physical core, or
    OMP_NUM_THREADS). Pinned even where the count does not change: torch.set_num_threads is also what turns off MKL's
    dynamic threading (mkl_set_dynamic(false)), under which MKL may run a matrix product on fewer threads than asked,
    by heuristics of its own that differ between CPUs, and so round it differently from a process that called it (a
    test's own process, a sweep job). Every run then computes on exactly the thread count results.json records, the
    condition of bit-identical resumes and reruns (docs/running.md)."""
    torch.set_num_threads(trainer.get("threads") or share or torch.get_num_threads())


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it documents on 64-bit systems.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a training step frees, for the next step to reuse. By default glibc
    hands large blocks straight back to the kernel (mmap, and trimming the heap's top), so a step can page-fault
    its activations back in, zero-filled (`python -m blocklab.bench malloc` counts the faults and times the step).
    Blocks up to 32 MiB now come from the heap, and up to 1 GiB of free heap stays mapped. A process's peak memory
    is unchanged; it just does not shrink back after the peak. False where there is no glibc (macOS, musl): nothing
    changes there."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def describe() -> dict:
    """The CPU the figures were taken on: model, torch's kernel level, the kernel-relevant flags, threads; the GPU
    torch sees, if any."""
    flags = cpu_flags()
    return {"cpu": cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "flags": [flag for flag in KERNEL_FLAGS if flag in flags], "native_bf16": native_bf16(),
            "threads": torch.get_num_threads(),
            "gpu": f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if torch.cuda.is_available() else None}


def machine_label(device: torch.device | None = None) -> str:
    """Where a run's numbers come from, as results.json records it: the GPU, or the CPU with the kernel level torch
    picked for it, and torch's version. Kernels differ in round-off, and beyond the training lengths a seed's
    score can move with that, so runs from two machines are not the same experiment."""
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, torch {torch.__version__}"
    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()} kernels, torch {torch.__version__}"


@lru_cache(maxsize=1)
def source_commit() -> str | None:
    """The git commit of the code that runs (this package's checkout), with "+modified" when its files differ from
    that commit; None outside a git checkout (an installed wheel). A findings page cites it."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        same = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("" if same.returncode == 0 else "+modified")


def precision_warning(accelerator: str | None, precision: str) -> str | None:
    """One line when bf16-mixed is asked for on a CPU that converts bfloat16 in software, with the measured cost."""
    if precision != "bf16-mixed" or accelerator not in (None, "cpu", "auto") or torch.cuda.is_available() \
            or native_bf16() is not False:
        return None
    return (f"warning: trainer.precision=bf16-mixed on a CPU without native bfloat16 ({cpu_model()}, "
            f"{torch.backends.cpu.get_cpu_capability()}, no avx512_bf16/amx_bf16): measured ~17x slower than float32 "
            "on such a CPU (experiment=nanogpt_baby: ~1,040 vs 60 ms a step); use trainer.precision=32-true")


def finish_queued_work(device: torch.device) -> None:
    """Wait for what was queued on a GPU (its kernels run after the Python call returns), so a timing ends when
    the work does; a CPU ran it already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accelerator_error(accelerator: str | None) -> str | None:
    """One line, before any work, when a CUDA accelerator is asked for where torch sees no CUDA device."""
    if accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        return None
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    return (f"trainer.accelerator={accelerator} needs a CUDA GPU, and torch sees none (torch {torch.__version__}, "
            f"{build}); on a GPU machine install torch's CUDA wheel, or train here with trainer=cpu")
