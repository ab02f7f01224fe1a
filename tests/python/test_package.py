"""What ``import sdp4bit`` gives (the README's snippets work after it alone), and what the
package asks of the environment it installs into (pyproject.toml) and of the network."""

import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import sdp4bit
assert "deepspeed" not in sys.modules, "import sdp4bit imported DeepSpeed"
assert callable(sdp4bit.deepspeed.initialize) and callable(sdp4bit.fsdp.enable)
try:
    sdp4bit.no_such_thing
except AttributeError as error:
    assert "no attribute 'no_such_thing'" in str(error), error
else:
    raise AssertionError("an unknown attribute was found")
"""


def test_the_integrations_are_there_after_a_bare_import():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd="/", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_ngc_prerelease_torch_satisfies_the_requirement():
    """NGC's torch is versioned like 2.9.0a0+<sha>, which PEP 440 orders before 2.9: the
    requirement must accept it, or pip pulls a second torch over the container's."""
    [torch_requirement] = [Requirement(r) for r in pyproject()["project"]["dependencies"]
                           if Requirement(r).name == "torch"]
    accepted = ["2.9.0a0+40ec155e58", "2.10.0a0+gitdeadbee", "2.9.1+cu128", "2.11.0+cu130",
                "2.15.0"]
    refused = ["2.8.0", "2.8.0a0+abc", "2.16.0a0+abc", "2.16.0"]
    for version in accepted:
        assert torch_requirement.specifier.contains(version), version
    for version in refused:
        assert not torch_requirement.specifier.contains(version), version
    # Control: the requirement as it was written before refuses NGC's build.
    assert not SpecifierSet(">=2.9,<2.16").contains("2.9.0a0+40ec155e58")


def test_build_requirements_are_floors_not_pins():
    requires = [Requirement(r) for r in pyproject()["build-system"]["requires"]]
    assert requires and all(s.operator == ">=" for r in requires for s in r.specifier), requires


def test_only_a_tree_with_vendored_crates_builds_offline_from_them(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import build_native
    assert build_native.vendored_sources(tmp_path) == []
    (tmp_path / "vendor").mkdir()
    assert build_native.vendored_sources(tmp_path) == [
        "--offline", "--config", 'source.crates-io.replace-with="vendored-sources"',
        "--config", f'source.vendored-sources.directory="{tmp_path / "vendor"}"']
