"""The image's command works: the Dockerfile installs exactly pyproject's pinned stack and then
the package, and runs pyproject's console script as a non-root user on a volume. Without a
Docker daemon, the package is installed here the way the image installs it (non-editable, from
the files the Dockerfile copies) and its `titan-async` runs on this venv's pinned stack."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile in order, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, arguments = (pending + line).strip().split(maxsplit=1)
        result.append((keyword.upper(), arguments))
        pending = ""
    return result


def arguments(keyword: str) -> list[str]:
    return [args for kind, args in instructions() if kind == keyword]


def run_step(fragment: str) -> list[str]:
    """The one RUN instruction containing `fragment`, split into shell words."""
    (step,) = [args for args in arguments("RUN") if fragment in args]
    return shlex.split(step)


def test_image_runs_the_console_script_as_a_non_root_user_on_a_volume():
    assert json.loads(arguments("ENTRYPOINT")[-1]) == ["titan-async"]
    assert PYPROJECT["project"]["scripts"]["titan-async"] == "titan_async.cli:main"
    user = arguments("USER")[-1].split(":")[0]
    assert user not in ("0", "root")
    assert arguments("WORKDIR")[-1] in json.loads(arguments("VOLUME")[-1])
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "**/__pycache__"} <= set(ignored)


def test_dependency_layer_installs_exactly_the_pinned_stack_of_this_venv(tmp_path):
    words = run_step("requirements.txt")
    start = words.index("python")
    assert words[start + 1] == "-c" and words[start + 3] == ">"
    program, requirements = words[start + 2], words[start + 4]
    assert words[start + 5:] == ["&&", "pip", "install", "--no-cache-dir", "-r", requirements]
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    listed = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, check=True)
    pins = PYPROJECT["project"]["dependencies"]
    assert listed.stdout.split() == pins
    for pin in pins:
        name, version = pin.split("==")
        assert metadata.version(name) == version, f"this venv does not match the image: {pin}"


def test_console_script_of_the_image_install_runs(tmp_path):
    source, site = tmp_path / "src", tmp_path / "site"
    source.mkdir()
    for copy in arguments("COPY"):
        *paths, destination = copy.split()
        for path in paths:
            copied = source / (path if destination in ("./", ".") else destination)
            if (REPO / path).is_dir():
                shutil.copytree(REPO / path, copied, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(REPO / path, copied)
    assert run_step("--no-deps")[:5] == ["pip", "install", "--no-cache-dir", "--no-deps", "."]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True)

    def packages(root: Path) -> set[str]:
        return {str(p.parent.relative_to(root)) for p in (root / "titan_async").rglob("__init__.py")}

    missing = packages(REPO) - packages(site)
    assert not missing, f"pip install . leaves out {sorted(missing)} (pyproject.toml [tool.setuptools] packages)"

    # -S: no .pth files, so the editable checkout cannot stand in for what the image installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}

    def titan_async(*args: str) -> str:
        result = subprocess.run([sys.executable, "-S", str(site / "bin" / "titan-async"), *args],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    usage = titan_async("--help")
    assert usage.startswith("usage: titan-async") and "report" in usage
    shown = titan_async("config", "show", "--config", "debug_cpu_pp2_fsdp2")
    assert shown.startswith(f"# resolved from {site / 'titan_async' / 'train_configs'}")
    assert "pipeline_parallel_degree = 2" in shown
