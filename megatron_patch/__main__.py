"""``python -m megatron_patch SCRIPT [ARGS...]``: see :mod:`megatron_patch.launcher`."""

import sys

from .launcher import main

main(sys.argv[1:])
