"""The launcher never calls the CUDA runtime on a GPU node, so that the workers it forks can use
CUDA. This machine has no GPU, so torch skips every CUDA path here; the test presents it as a
node with one GPU the way NVML would, and has each CUDA runtime entry point log its caller."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, fresh_environment, sets
from test_fork_safe_start import RUN, forked_after_cuda
from titan_async.core import platform
from titan_async.model.llama import ModelSection, build_model_spec
from titan_async.run import process

pytestmark = pytest.mark.skipif(not torch.cuda._is_compiled(), reason="a CPU-only build of torch has no CUDA runtime to call")

NVML_COUNT = "_device_count_nvml"
"""The NVML count `simulate_gpu_node` logs beside the runtime calls: the launcher saw the GPU."""


def simulate_gpu_node(calls_file: str) -> None:
    """Make this interpreter a node whose NVML counts one SM90 GPU: each NVML count and each CUDA
    runtime entry point appends a JSON line (the call, and the titan_async / torchtitan / torchao
    frames that made it, then the innermost two) to `calls_file`; a runtime entry point then
    answers as that GPU would, or raises where no answer fits. A child forked from this process
    (the launcher's elastic agent, and so its workers) gets torch's functions back and becomes
    the CPU-only process that this machine runs. Self-contained: its source runs in a fresh
    interpreter before titan_async is imported."""
    import json
    import os
    import sys
    import traceback
    from types import SimpleNamespace

    import torch

    gpu = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 << 30,
                          multi_processor_count=132, warp_size=32, gcnArchName="")
    answers = {
        torch.cuda: {"_device_count_nvml": 1, "_lazy_init": None, "init": None, "current_device": 0,
                     "set_device": None, "get_device_properties": gpu, "get_device_capability": (gpu.major, gpu.minor),
                     "get_device_name": gpu.name, "mem_get_info": (gpu.total_memory, gpu.total_memory),
                     "synchronize": None},
        torch._C: {"_cuda_init": None, "_cuda_getDeviceCount": 1, "_cuda_getDevice": 0, "_cuda_setDevice": None,
                   "_cuda_exchangeDevice": 0, "_cuda_maybeExchangeDevice": 0, "_cuda_synchronize": None,
                   "_cuda_getCurrentStream": RuntimeError, "_cuda_getDefaultStream": RuntimeError,
                   "_cuda_setStream": RuntimeError, "_cuda_canDeviceAccessPeer": RuntimeError,
                   "_cuda_hasPrimaryContext": RuntimeError, "_cuda_getCurrentBlasHandle": RuntimeError,
                   "_cuda_memoryStats": RuntimeError, "_cuda_emptyCache": RuntimeError,
                   "_cuda_ipc_collect": RuntimeError, "_cuda_sleep": RuntimeError},
    }
    originals = {(owner, name): getattr(owner, name) for owner, names in answers.items() for name in names}

    def log(name: str) -> None:
        frames = traceback.extract_stack()[:-2]
        shown = [f for i, f in enumerate(frames)
                 if i >= len(frames) - 2 or any(package in f.filename for package in ("titan_async", "torchtitan", "torchao"))]
        stack = [f"{f.filename.rpartition('site-packages/')[2]}:{f.lineno} {f.name}" for f in shown[-14:]]
        with open(calls_file, "a") as out:
            out.write(json.dumps({"call": name, "stack": stack}) + "\n")

    def recorder(name: str, answer):
        def recorded(*args, **kwargs):
            log(name)
            if answer is RuntimeError:
                raise RuntimeError(f"{name}: a CUDA runtime call on a simulated GPU node")
            return answer
        return recorded

    def become_cpu_process() -> None:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        platform = sys.modules.get("titan_async.core.platform")
        if platform is None or platform._device_type != "cuda":
            return
        platform._device_type = None
        utils = sys.modules.pop("torchtitan.tools.utils", None)  # configure() refuses once torchtitan chose a device
        platform.configure()
        if utils is not None:
            sys.modules["torchtitan.tools.utils"] = utils
        for name, module in list(sys.modules.items()):
            if name.startswith(("torchtitan", "titan_async")):
                if getattr(module, "device_type", None) == "cuda":
                    module.device_type = "cpu"
                if getattr(module, "device_module", None) is torch.cuda:
                    module.device_module = torch.cpu

    for owner, name in originals:
        setattr(owner, name, recorder(name, answers[owner][name]))
    os.register_at_fork(after_in_child=become_cpu_process)


def launch_on_gpu_node(run_dir: Path, calls_file: Path, *extra: str) -> subprocess.CompletedProcess:
    """`titan-async RUN --run-dir run_dir EXTRA` from a fresh interpreter that `simulate_gpu_node`
    has made a GPU node, logging its NVML counts and CUDA runtime calls to `calls_file`."""
    code = f"{inspect.getsource(simulate_gpu_node)}\nsimulate_gpu_node({str(calls_file)!r})\nfrom titan_async.cli import main\nmain()"
    return subprocess.run([sys.executable, "-c", code, *RUN, "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=fresh_environment())


def recorded_calls(calls_file: Path) -> list[dict]:
    """What `simulate_gpu_node` logged, in call order."""
    return [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []


def test_launcher_with_float8_makes_no_cuda_runtime_call_on_a_gpu_node(tmp_path: Path) -> None:
    """On a node whose NVML counts a GPU, the launcher of two workers checks a float8 run (the
    capability check included) and forks them without one CUDA runtime call, its imports
    included: the workers start by fork, able to use CUDA, and train."""
    calls_file = tmp_path / "cuda_calls.jsonl"
    result = launch_on_gpu_node(tmp_path / "run", calls_file, *sets("model.float8=rowwise"))
    calls = recorded_calls(calls_file)
    runtime_calls = [call for call in calls if call["call"] != NVML_COUNT]
    assert not runtime_calls, "the launcher called the CUDA runtime:\n" + "\n".join(json.dumps(c, indent=1) for c in runtime_calls)
    assert calls, "the launcher never asked NVML: the simulated GPU went unseen"
    assert result.returncode == 0, result.stderr[-5000:]
    assert "workers start by spawn" not in result.stderr
    assert forked_after_cuda(tmp_path / "run") == ["no", "no"]


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), None])
def test_a_launcher_checks_float8_by_nvml_and_leaves_the_linears_to_its_workers(monkeypatch, capability) -> None:
    """Where this process may not use the CUDA runtime, a float8 model spec keeps plain linears
    (the workers convert them) and a GPU older than SM89 by NVML is refused; where NVML cannot
    say (None), the workers' conversion checks."""
    from torchtitan.models.common import Linear

    monkeypatch.setattr(process, "may_use_cuda_runtime", lambda: False)
    monkeypatch.setattr(platform, "cuda_capability", lambda: capability)
    section = ModelSection(dim=64, n_layers=2, n_heads=4, float8="rowwise")
    if capability == (8, 0):
        with pytest.raises(ValueError, match=r"compute capability 8\.9 or later; this one has 8\.0"):
            build_model_spec(section, 256)
        return
    linears = [getattr(parent, attr) for _, _, parent, attr in build_model_spec(section, 256).model.traverse(Linear.Config)]
    assert linears and all(type(linear) is Linear.Config for linear in linears)
