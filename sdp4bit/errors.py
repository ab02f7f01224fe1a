"""The exception every failure of the Rust core or the extension surfaces as."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: Prefix the extension puts on every message it raises.
_PREFIX = "sdp4bit: "


class Sdp4bitError(RuntimeError):
    """A config, topology, input or collective problem, with a message that names it."""


@contextlib.contextmanager
def translated_errors(collective: str | None = None) -> Iterator[None]:
    """Re-raises the extension's RuntimeErrors as :class:`Sdp4bitError` (other errors pass),
    naming `collective` (e.g. "gradient reduce-scatter of bucket 3 at step 7") after the
    extension's message where given, so that a rank whose peer died or stalled says which of
    sdp4bit's collectives it was in."""
    try:
        yield
    except Sdp4bitError:
        raise
    except RuntimeError as error:
        message = str(error)
        at = message.find(_PREFIX)
        if at < 0:
            raise
        # torch appends a C++ backtrace on some builds; the first line is the message.
        text = message[at + len(_PREFIX):].split("\nException raised from")[0].strip()
        if collective is not None:
            text = f"{text} (in sdp4bit's {collective})"
        raise Sdp4bitError(text) from None
