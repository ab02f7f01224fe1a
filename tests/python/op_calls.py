"""Counts the calls into the extension's ops (``torch.ops.sdp4bit``), to show that training
steps make none: the config is resolved once and cached on the frozen ``Config``."""

from __future__ import annotations

import collections
import contextlib

import torch

from sdp4bit import _native


@contextlib.contextmanager
def counted():
    """While active, every op of ``torch.ops.sdp4bit`` but the tests' in-process references
    (``simulate_*``) counts its calls; yields the counter (op name -> calls)."""
    namespace = _native.ops()
    names = [name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("sdp4bit::") and not name.startswith("sdp4bit::simulate_")]
    assert "resolve_config" in names, names
    calls = collections.Counter()

    def counting(name, op):
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        return call

    for name in names:
        setattr(namespace, name, counting(name, getattr(namespace, name)))
    try:
        yield calls
    finally:
        for name in names:
            delattr(namespace, name)


def assert_none(calls: collections.Counter, during: str) -> None:
    """Fails naming the ops called `during` something, if any was."""
    assert not calls, f"calls into torch.ops.sdp4bit {during}: {dict(calls)}"
