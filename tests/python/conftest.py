import sys
from pathlib import Path

# Scenario modules are imported by name in the spawned rank processes.
sys.path.insert(0, str(Path(__file__).resolve().parent))
