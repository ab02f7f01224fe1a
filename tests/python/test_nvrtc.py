"""Where a torch process finds NVRTC: importing sdp4bit hands the core the ``nvidia/*/lib``
directories on sys.path (``SDP4BIT_NVRTC_DIRS``), where a CUDA torch's wheels put NVRTC, so the
kernels compile with LD_LIBRARY_PATH unset. The core's search of those directories (the
driver's major version first, the error listing where it looked) is tested on the emulated
driver (tests/cuda_driver_emulation/images.rs)."""

from __future__ import annotations

import os
import subprocess
import sys

from sdp4bit import _native


def test_nvrtc_dirs_are_the_nvidia_lib_dirs_on_sys_path(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    for lib in ["nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib", "nvidia/cublas/include"]:
        (site / lib).mkdir(parents=True)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path / "missing"), str(site), str(site)])
    assert _native.nvrtc_dirs() == [site / "nvidia/cu13/lib", site / "nvidia/cuda_nvrtc/lib"]


def _torch_process(code: str, **env_changes: str) -> str:
    """The output of ``code`` run after ``import sdp4bit`` in a fresh interpreter with
    LD_LIBRARY_PATH, SDP4BIT_NVRTC_LIBRARY and SDP4BIT_NVRTC_DIRS unset, as in a torch user's
    process, and ``env_changes``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "SDP4BIT_NVRTC_LIBRARY", _native.NVRTC_DIRS_VAR)}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-c", f"import os, sdp4bit, torch; {code}"],
                          cwd="/tmp", env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_importing_sdp4bit_passes_the_wheel_dirs_unless_set(tmp_path):
    wheel = tmp_path / "site-packages/nvidia/cu13/lib"
    wheel.mkdir(parents=True)
    show = f"print(os.environ[{_native.NVRTC_DIRS_VAR!r}])"
    dirs = _torch_process(show, PYTHONPATH=str(tmp_path / "site-packages")).split(os.pathsep)
    assert dirs[0] == str(wheel), dirs
    assert dirs[1:] == [str(d) for d in _native.nvrtc_dirs()], dirs
    assert _torch_process(show, **{_native.NVRTC_DIRS_VAR: "/mine"}) == "/mine"


def test_a_torch_process_without_ld_library_path_finds_the_wheels_nvrtc():
    """The NVRTC the core reports in a torch user's process: the torch wheels' where they hold
    one (the CUDA torch of the test environment does), else an error naming both variables."""
    report = _torch_process("print(torch.ops.sdp4bit.nvrtc_report())")
    wheels = [p for d in _native.nvrtc_dirs() for p in d.glob("libnvrtc.so.*[0-9]")]
    if wheels:
        assert any(report.endswith(f"({p})") for p in wheels), (report, wheels)
    else:
        assert report.startswith("not found: "), report
        assert "SDP4BIT_NVRTC_LIBRARY" in report and "SDP4BIT_NVRTC_DIRS" in report, report
