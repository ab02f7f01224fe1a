import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Running megatron-core on CPU (test support kept out of the installed packages).
CPU_SUPPORT = HERE.parents[1] / "cpu_support"

# Scenario modules are imported by name in the rank processes. Python 3.11's fork server
# ignores the parent's sys.path, so the directories also go on PYTHONPATH, which it inherits
# (see harness.py).
for directory in (str(CPU_SUPPORT), str(HERE)):
    sys.path.insert(0, directory)
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(HERE), str(CPU_SUPPORT), os.environ.get("PYTHONPATH")]))
