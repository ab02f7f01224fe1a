import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Running megatron-core on CPU (test support kept out of the installed packages).
MEGATRON_ON_CPU = HERE.parents[1] / "megatron_on_cpu"

# Scenario modules are imported by name in the rank processes. Python 3.11's fork server
# ignores the parent's sys.path, so the directories also go on PYTHONPATH, which it inherits
# (see harness.py).
for directory in (str(MEGATRON_ON_CPU), str(HERE)):
    sys.path.insert(0, directory)
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(HERE), str(MEGATRON_ON_CPU), os.environ.get("PYTHONPATH")]))


def pytest_sessionstart(session):
    """Stops at once, in one line, when the installed extension lacks the in-process reference
    collectives the tests compare with (built without the cargo feature test-ops)."""
    import pytest

    from sdp4bit import _native

    if not hasattr(_native.ops(), "simulate_grad_reduce_scatter"):
        pytest.exit("sdp4bit's extension was built without the tests' in-process references "
                    "(torch.ops.sdp4bit.simulate_*): install it with `SDP4BIT_TEST_OPS=1 pip "
                    "install .`, as bash scripts/test.sh does", returncode=4)
