"""The portable wheel (scripts/build_wheel.py, docs/install.md): its cache of extensions compiled
at first import, and, where the test command built one (SDP4BIT_WHEEL, the wheel's path, and
SDP4BIT_WHEEL_TORCH, a virtual environment with the torch to check it with), the wheel
installed into a fresh virtual environment without cargo, imported, and run on 4 processes."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sdp4bit import _jit, _torch_abi

ROOT = Path(__file__).resolve().parents[2]
TORCH = {"torch": "2.15.0+cu132", "cxx11_abi": True}
MANIFEST = {"digest": "0123456789abcdef" * 4, "sources": [], "features": ["ffi"]}


def test_the_cache_is_one_entry_per_bundle_torch_abi_and_python(monkeypatch, tmp_path):
    monkeypatch.setenv(_jit.CACHE_VAR, str(tmp_path))
    entry = _jit.build_dir(MANIFEST, TORCH, "cpython-311")
    assert entry == tmp_path / "0123456789abcdef-torch2.15.0-cxx11abi1-cpython-311"
    assert _jit.build_dir(MANIFEST, {**TORCH, "torch": "2.15.0+cu128"}, "cpython-311") == entry
    others = [_jit.build_dir(MANIFEST, {**TORCH, "torch": "2.9.1+cu128"}, "cpython-311"),
              _jit.build_dir(MANIFEST, {**TORCH, "cxx11_abi": False}, "cpython-311"),
              _jit.build_dir(MANIFEST, TORCH, "cpython-312"),
              _jit.build_dir({**MANIFEST, "digest": "f" * 64}, TORCH, "cpython-311")]
    assert len({entry, *others}) == 5


def test_only_a_completed_compile_for_this_torch_is_taken_from_the_cache(tmp_path):
    library = tmp_path / f"{_jit.NAME}.so"
    library.write_bytes(b"")
    assert _jit.cached_library(tmp_path, TORCH) is None  # compiled, but not recorded as done
    (tmp_path / _jit.DONE).write_text(json.dumps({**TORCH, "torch": "2.9.1+cu128"}))
    assert _jit.cached_library(tmp_path, TORCH) is None  # done for another torch
    (tmp_path / _jit.DONE).write_text(json.dumps({**TORCH, "torch": "2.15.0+cu130"}))
    assert _jit.cached_library(tmp_path, TORCH) == library
    library.unlink()
    assert _jit.cached_library(tmp_path, TORCH) is None


def test_without_ninja_the_first_import_says_what_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setitem(sys.modules, "ninja", None)  # `import ninja` raises ImportError
    with pytest.raises(ImportError, match=r"needs ninja on PATH or the ninja package \(pip "
                                          r"install ninja\), and g\+\+"):
        _jit._put_ninja_on_path()


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The wheel the test command built; the tests that need it fail where it must have been
    built (SDP4BIT_REQUIRE_WHEEL=1), and skip elsewhere."""
    path = os.environ.get("SDP4BIT_WHEEL")
    if not path:
        if os.environ.get("SDP4BIT_REQUIRE_WHEEL") == "1":
            pytest.fail("SDP4BIT_REQUIRE_WHEEL=1 but SDP4BIT_WHEEL is unset")
        pytest.skip("no portable wheel built here (the test command builds one: SDP4BIT_WHEEL)")
    return Path(path)


def test_the_wheel_carries_the_core_and_the_glue_sources_but_no_extension(wheel):
    major, minor = platform.libc_ver()[1].split(".")[:2]  # the glibc the core was built with
    assert re.fullmatch(rf"sdp4bit-[0-9.]+-py3-none-manylinux_{major}_{minor}_x86_64\.whl",
                        wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        manifest = json.loads(archive.read("sdp4bit/_bundle/manifest.json"))
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert not [n for n in names if n.endswith(".so")]
    assert manifest["features"] == ["ffi"]  # not the tests' in-process references
    for source in manifest["sources"]:
        assert f"sdp4bit/_bundle/cpp/{source}" in names
    assert "sdp4bit/_bundle/lib/libsdp4bit.a" in names
    assert b"Requires-Dist: torch<2.16,>=2.9.0a0" in metadata


def run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """Runs ``args``; returns its standard output."""
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_fresh_environment_without_cargo_installs_it_and_runs_four_ranks(wheel, tmp_path):
    torch_venv = Path(os.environ["SDP4BIT_WHEEL_TORCH"])
    venv = tmp_path / "venv"
    subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/env.sh" && '
                                  f'sdp4bit_torch_view "{venv}" "{torch_venv}"'], check=True)
    python = str(venv / "bin" / "python")
    path = os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    assert shutil.which("cargo", path=path) is None, "cargo is on the fresh environment's PATH"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CARGO", "SDP4BIT_NATIVE_DIR")}
    env.update(PATH=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.setdefault(_jit.CACHE_VAR, str(tmp_path / "extensions"))
    # --no-index: the requirement on torch is met by the environment's torch, or this fails.
    run([python, "-m", "pip", "install", "--quiet", "--no-index", str(wheel)], env, tmp_path)
    # The environment's torch, read without importing sdp4bit: the selftest imports it first.
    torch = json.loads(run([python, "-c", "import json, torch; print(json.dumps({'torch': "
                                          "torch.__version__, 'cxx11_abi': "
                                          "bool(torch._C._GLIBCXX_USE_CXX11_ABI)}))"], env,
                           tmp_path))
    done = subprocess.run([python, "-m", "sdp4bit.selftest", "--no-source"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 2, done.stdout + done.stderr  # no GPU here: nothing checked
    [line] = [s for s in done.stdout.splitlines() if s.startswith("extension")]
    assert "compiled at first import: " in line, line
    assert Path(env[_jit.CACHE_VAR]) in Path(line.split(": ", 1)[1]).parents, line
    assert f"-torch{_torch_abi.tag_of(torch)}-" in line, line  # compiled for this venv's torch
    out = run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(ROOT / "examples" / "quickstart.py")], env, tmp_path)
    error = float(re.search(r"relative error ([0-9.]+)", out).group(1))
    assert error < 0.5 and "replicas identical: True" in out, out
