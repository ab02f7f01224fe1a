"""The DeepSpeed versions this integration is tested with: it replaces internals of DeepSpeed's
ZeRO optimizers (methods of ``DeepSpeedZeroOptimizer``, the stage 3 parameter coordinator,
module-level collectives), which other versions change without notice. The range is the
package extra ``sdp4bit[deepspeed]`` (pyproject.toml) and is checked before DeepSpeed builds
an engine and when sdp4bit attaches to its optimizer."""

from __future__ import annotations

from ..errors import Sdp4bitError

#: The tested DeepSpeed versions (PEP 440), as the ``deepspeed`` extra declares them.
TESTED_DEEPSPEED = ">=0.19.8,<0.19.9"


def check_deepspeed_version(version: str | None = None) -> None:
    """Raises :class:`Sdp4bitError` naming `version` (default: the installed DeepSpeed's) and
    the tested range unless the range holds it."""
    # DeepSpeed's own dependency, imported here so that importing sdp4bit does not need it.
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        import deepspeed

        version = deepspeed.__version__
    try:
        tested = Version(version) in SpecifierSet(TESTED_DEEPSPEED)
    except InvalidVersion:
        tested = False
    if not tested:
        raise Sdp4bitError(
            f"DeepSpeed {version} is installed; sdp4bit's DeepSpeed integration replaces "
            f"internals of DeepSpeed's ZeRO optimizers and is tested with DeepSpeed "
            f"{TESTED_DEEPSPEED} only (pip install 'sdp4bit[deepspeed]' installs a tested "
            f'version), or remove the "sdp4bit" config section')
