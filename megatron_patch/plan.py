"""Deprecated alias of :mod:`sdp4bit.plan` (``python -m sdp4bit.plan``); it goes in the next
release."""

import sys
import warnings

from sdp4bit.plan import main

warnings.warn("megatron_patch.plan moved to sdp4bit.plan (python -m sdp4bit.plan); the alias "
              "goes in the next release", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    main(sys.argv[1:])
