import os
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)

# Scenario modules are imported by name in the rank processes. Python 3.11's fork server
# ignores the parent's sys.path, so the directory also goes on PYTHONPATH, which it inherits
# (see harness.py).
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
