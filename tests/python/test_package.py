"""What ``import sdp4bit`` gives: the README's snippets work after it alone."""

import subprocess
import sys

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
