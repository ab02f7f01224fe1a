"""The portable wheel (scripts/build_wheel.py, docs/install.md): its cache of extensions compiled
at first import, and, where the test command built one (SDP4BIT_WHEEL, the wheel's path), the
wheel installed without cargo into a fresh virtual environment seeing the packages of each of
SDP4BIT_WHEEL_ENVS (os.pathsep-separated; the newest torch, under Python 3.12 where the machine
has it, and the floor, both with megatron-core), where it imports, runs 4 processes and runs
the main job."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
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


#: A first import in a child process whose compile is replaced by a stand-in: it records its
#: start in argv[2], waits argv[3] seconds (killed there, when the test kills it) and writes a
#: library as the real one would; the child prints what `library` returned.
FIRST_IMPORT = """
import json, os, sys, time
from pathlib import Path
from sdp4bit import _jit

def compile_stand_in(bundle, directory, torch_record):
    directory.mkdir(parents=True, exist_ok=True)
    with open(sys.argv[2], "a") as starts:
        starts.write(f"{os.getpid()} baton={(directory / _jit.TORCH_BATON).exists()}\\n")
    (directory / _jit.TORCH_BATON).write_text("")  # what torch's builder holds while it runs
    time.sleep(float(sys.argv[3]))
    (directory / f"{_jit.NAME}.so").write_bytes(b"")
    (directory / _jit.TORCH_BATON).unlink()
    (directory / _jit.DONE).write_text(json.dumps(torch_record))
    return directory / f"{_jit.NAME}.so"

_jit.compile_library = compile_stand_in
print(_jit.library(Path(sys.argv[1])))
"""


def first_import(bundle: Path, starts: Path, seconds: float) -> subprocess.Popen:
    """A child process importing the bundle's extension through `_jit.library`."""
    package_root = str(Path(_jit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root,
                                                         os.environ.get("PYTHONPATH", "")])}
    # Run from the bundle's directory: `python -c` puts its working directory first on sys.path,
    # and a checkout there holds an sdp4bit without the installed extension.
    return subprocess.Popen([sys.executable, "-c", FIRST_IMPORT, str(bundle), str(starts),
                             str(seconds)], env=env, cwd=bundle.parent, stdout=subprocess.PIPE,
                            text=True)


@pytest.fixture
def bundle(monkeypatch, tmp_path) -> Path:
    """A bundle directory with a manifest, and the extension cache in the test's directory."""
    monkeypatch.setenv(_jit.CACHE_VAR, str(tmp_path / "cache"))
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / _jit.MANIFEST).write_text(json.dumps(MANIFEST))
    return tmp_path / "bundle"


def test_concurrent_first_imports_compile_once(bundle, tmp_path):
    starts = tmp_path / "starts"
    children = [first_import(bundle, starts, 3.0) for _ in range(3)]
    libraries = {child.communicate(timeout=120)[0].strip() for child in children}
    assert [child.returncode for child in children] == [0, 0, 0]
    assert len(libraries) == 1 and libraries.pop().endswith(f"{_jit.NAME}.so")
    assert len(starts.read_text().splitlines()) == 1  # the control: a count that can be 3


def test_a_compile_killed_half_way_blocks_no_later_import(bundle, tmp_path):
    starts = tmp_path / "starts"
    killed = first_import(bundle, starts, 600.0)
    while not starts.exists():  # the stand-in has begun and holds torch's lock file
        assert killed.poll() is None, "the first import ended before it compiled"
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    later = first_import(bundle, starts, 0.0)
    assert later.communicate(timeout=60)[0].strip().endswith(f"{_jit.NAME}.so")
    # The later import compiled (a second start) after removing the dead compile's lock file.
    assert [line.split()[1] for line in starts.read_text().splitlines()] == ["baton=False"] * 2


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


def test_the_wheel_is_tagged_with_the_oldest_glibc_its_core_links_against(
        wheel, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import glibc_floor

    with zipfile.ZipFile(wheel) as archive:
        core = Path(archive.extract("sdp4bit/_bundle/lib/libsdp4bit.a", tmp_path))
    release, needed = glibc_floor.floor(core)
    assert len(needed) > 50  # the core's glibc calls were read: a check that sees them
    assert wheel.name.endswith(f"-py3-none-{glibc_floor.platform_tag(core)}.whl")
    # Ubuntu 22.04's glibc, the base of NGC's PyTorch containers before 24.04, links it.
    assert release <= (2, 35), sorted(n for n, r in needed.items() if r > (2, 35))


def test_the_wheel_carries_the_core_and_the_glue_sources_but_no_extension(wheel):
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


#: The environments the test command checks the wheel with; where it sets none, one
#: placeholder that the `wheel` fixture skips.
WHEEL_ENVS = [p for p in os.environ.get("SDP4BIT_WHEEL_ENVS", "").split(os.pathsep) if p] or [
    "unset"]


@pytest.fixture(scope="module", params=WHEEL_ENVS)
def fresh_environment(wheel, request, tmp_path_factory):
    """A fresh virtual environment seeing the packages of one of SDP4BIT_WHEEL_ENVS (torch and
    the rest), no cargo on its PATH, the wheel installed offline; its Python, environment
    variables and directory, shared by the tests of that environment."""
    if request.param == "unset":
        pytest.fail("a wheel was built (SDP4BIT_WHEEL) but no environment to check it with")
    home = tmp_path_factory.mktemp("fresh")
    venv = home / "venv"
    subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/env.sh" && '
                                  f'sdp4bit_torch_view "{venv}" "{request.param}"'], check=True)
    python = str(venv / "bin" / "python")
    path = os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    assert shutil.which("cargo", path=path) is None, "cargo is on the fresh environment's PATH"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CARGO", "SDP4BIT_NATIVE_DIR")}
    env.update(PATH=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.setdefault(_jit.CACHE_VAR, str(home / "extensions"))
    # --no-index: the requirement on torch is met by the environment's torch, or this fails.
    run([python, "-m", "pip", "install", "--quiet", "--no-index", str(wheel)], env, home)
    return python, env, home


def test_a_fresh_environment_without_cargo_installs_it_and_runs_four_ranks(fresh_environment):
    python, env, home = fresh_environment
    # The environment's torch, read without importing sdp4bit: the selftest imports it first.
    torch = json.loads(run([python, "-c", "import json, torch; print(json.dumps({'torch': "
                                          "torch.__version__, 'cxx11_abi': "
                                          "bool(torch._C._GLIBCXX_USE_CXX11_ABI)}))"], env,
                           home))
    done = subprocess.run([python, "-m", "sdp4bit.selftest", "--no-source"], env=env,
                          cwd=home, capture_output=True, text=True, timeout=900)
    assert done.returncode == 2, done.stdout + done.stderr  # no GPU here: nothing checked
    [line] = [s for s in done.stdout.splitlines() if s.startswith("extension")]
    assert "compiled at first import: " in line, line
    assert Path(env[_jit.CACHE_VAR]) in Path(line.split(": ", 1)[1]).parents, line
    assert f"-torch{_torch_abi.tag_of(torch)}-" in line, line  # compiled for this venv's torch
    out = run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(ROOT / "examples" / "quickstart.py")], env, home)
    error = float(re.search(r"relative error ([0-9.]+)", out).group(1))
    assert error < 0.5 and "replicas identical: True" in out, out


def test_the_main_job_runs_from_the_wheel(fresh_environment):
    """The README's main job (megatron-core's GPT on 4 ranks, the sdp4bit preset) with the
    package from the wheel, in an environment seeing the main job's packages."""
    python, env, home = fresh_environment
    out = run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(ROOT / "examples" / "gpt_cpu" / "train.py"), "--ranks-per-node", "2",
               "--steps", "3", "--log-every", "1", "--corpus-bytes", "400000"], env, home)
    assert "megatron-core GPTModel" in out and "DistributedOptimizer" in out, out
    assert "skipped steps 0; replicas bit-identical: True" in out, out
    assert "x less" in out and "MiB saved" in out, out
