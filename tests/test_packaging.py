"""Packaging: building the wheel, and what `pip install` does to an environment that already has torch.

The installs run this interpreter's pip against scratch venvs (`pip --python`). The NVIDIA NGC case
uses fake distributions (metadata only), which is all pip's resolver reads; the plain case installs
the real torch this suite runs on (the version scripts/setup_venv.sh pins) and then moe-dispatch.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

import moe_dispatch
from moe_dispatch.integrations.megatron import TESTED_MEGATRON_CORE

ROOT = Path(__file__).resolve().parents[1]
# The build's inputs, copied so that setuptools' build/ and egg-info never land in the checkout.
SOURCES = ("moe_dispatch", "setup.cfg", "pyproject.toml", "README.md")
# A Python warning forwarded from the build backend (BuildBackendWarning, SetuptoolsDeprecationWarning,
# ...); pip's own "WARNING:" lines about the machine's index configuration are not the project's.
PY_WARNING = re.compile(r"\b[A-Z][A-Za-z]*Warning\b")
# NGC containers' torch: 26.01 is the last on 2.10, 26.02 the first on 2.11.
NGC_2_10 = "2.10.0a0+a36e1d39eb.nv26.01"
NGC_2_11 = "2.11.0a0+eb65b36914.nv26.02"


def _env() -> dict[str, str]:
    # The suite runs with PYTHONPATH at the checkout, which would put a second moe_dispatch (and
    # its egg-info) into every scratch venv's view.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=_env(), cwd=cwd,
                          timeout=240)


def _pip(venv: Path, *args: str | Path) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", *args)


def _venv(path: Path) -> Path:
    proc = _run(sys.executable, "-m", "venv", "--without-pip", path)
    assert proc.returncode == 0, proc.stderr
    return path


def _site_packages(venv: Path) -> Path:
    return Path(_run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())


def _fake_dist(venv: Path, name: str, version: str) -> None:
    """An installed distribution as pip sees one: a dist-info directory, no code."""
    info = _site_packages(venv) / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _installs(report: Path) -> dict[str, str]:
    """The distributions a pip --report says it installs (or would), by name."""
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def _no_python_warnings(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not PY_WARNING.search(out), out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def built(source, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The wheel pip builds (in an isolated build env: no torch there), and pip's output."""
    out = tmp_path_factory.mktemp("wheel")
    proc = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, source)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("moe_dispatch-*.whl")
    return wheel, proc


@pytest.fixture(scope="module")
def metadata(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(name).decode())


def _requirement(metadata, name: str) -> Requirement:
    (req,) = [r for r in map(Requirement, metadata.get_all("Requires-Dist")) if r.name == name]
    return req


def test_build_is_quiet_and_reads_the_package_version(built, metadata):
    _no_python_warnings(built[1])
    # setup.cfg's `attr:` read moe_dispatch.__version__ without importing it (torch is absent there).
    assert metadata["Version"] == moe_dispatch.__version__
    assert metadata["License-Expression"] == "Apache-2.0"


def test_torch_floor_admits_ngc_prereleases_of_the_tested_floor(metadata):
    torch_req = _requirement(metadata, "torch")
    assert torch_req.marker is None
    for version in (NGC_2_11, "2.11.0", "2.13.0+cpu"):
        assert torch_req.specifier.contains(version, prereleases=True), (torch_req, version)
    for version in (NGC_2_10, "2.10.0", "2.6.0a0+ecf3bae40a.nv25.01"):
        assert not torch_req.specifier.contains(version, prereleases=True), (torch_req, version)
    # The floor is a torch the suite runs on: this one, or the GPU machine's 2.11.
    assert torch_req.specifier.contains(torch.__version__, prereleases=True)


def test_megatron_extra_is_the_tested_range(metadata):
    (req,) = [r for r in map(Requirement, metadata.get_all("Requires-Dist"))
              if r.name == "megatron-core" and r.marker is not None and r.marker.evaluate({"extra": "megatron"})]
    low, high = TESTED_MEGATRON_CORE
    assert req.specifier.contains(low) and req.specifier.contains(high)
    below = f"{low}rc1"  # sorts just below the lowest tested release
    above = ".".join(map(str, Version(high).release[:2] + (Version(high).micro + 1,)))
    for outside in (below, above, f"{above}rc1", "0.20.0", "1.0.0"):
        assert not req.specifier.contains(outside, prereleases=True), (req, outside)


@pytest.mark.parametrize("installed, kept", [(NGC_2_11, True), (NGC_2_10, False)])
def test_pip_keeps_an_ngc_torch_at_or_above_the_floor(built, tmp_path, installed, kept):
    venv = _venv(tmp_path / "venv")
    _fake_dist(venv, "torch", installed)
    _fake_dist(venv, "numpy", "2.1.0")
    report = tmp_path / "report.json"
    proc = _pip(venv, "install", "--dry-run", "--no-index", "--report", report, built[0])
    if kept:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert _installs(report) == {"moe-dispatch": moe_dispatch.__version__}
    else:
        # Below the floor pip replaces it with whatever torch it finds, or (no index) fails.
        assert (proc.returncode != 0 and "torch" in proc.stderr) or "torch" in _installs(report), proc.stderr


def test_pip_install_keeps_an_installed_torch(built, tmp_path):
    venv = _venv(tmp_path / "venv")
    wanted = Version(torch.__version__).public  # as scripts/setup_venv.sh pins it
    # --no-compile: byte-compiling torch's thousands of modules would triple the test's time.
    proc = _pip(venv, "install", "-q", "--no-compile", f"torch=={wanted}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    show = [venv / "bin" / "python", "-c", "import torch; print(torch.__version__, torch.__file__)"]
    before = _run(*show).stdout
    report = tmp_path / "report.json"
    proc = _pip(venv, "install", "-q", "--no-compile", "--report", report, built[0])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch" not in _installs(report) and "moe-dispatch" in _installs(report)
    assert _run(*show).stdout == before and before.startswith(torch.__version__)


def test_editable_install_is_quiet(source, tmp_path):
    venv = _venv(tmp_path / "venv")
    _no_python_warnings(_pip(venv, "install", "--no-deps", "-e", source))
    # Run outside the checkout: `python -c` puts the working directory first on sys.path.
    spec = _run(venv / "bin" / "python", "-c", "import importlib.util as u; print(u.find_spec('moe_dispatch').origin)",
                cwd=tmp_path)
    assert Path(spec.stdout.strip()) == source / "moe_dispatch" / "__init__.py", spec.stderr


def test_the_setup_venv_environment_meets_every_pin(metadata):
    """The venv scripts/setup_venv.sh builds: `pip check` is clean, and every requirement of the
    package and of its test extra is met. pip check reads no extras, so the second half is ours:
    numpy 2.4 beside the test extra's numpy<2.4 passes pip check."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not the venv scripts/setup_venv.sh builds")
    proc = _run(sys.executable, "-m", "pip", "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unmet = []
    for req in map(Requirement, metadata.get_all("Requires-Dist")):
        if req.marker is not None and not req.marker.evaluate({"extra": "test"}):
            continue  # another extra's
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req}: {req.name} {version} installed")
    assert not unmet, "; ".join(unmet) + " (bash scripts/setup_venv.sh installs every pin in one pip run)"
