"""Replacing methods and functions of the frameworks sdp4bit plugs into (megatron-core,
DeepSpeed), and putting the originals back: the one bookkeeping every integration uses."""

from __future__ import annotations


class Patches:
    """A set of replaced attributes ``owner.name`` (owner a class or module), each remembered
    with its original, looked up by the attribute's name (unique within one set), so that the
    replacement can call it and :meth:`restore` can put it back. Installing is idempotent: a
    second :meth:`install` of the same attribute keeps the first original."""

    def __init__(self) -> None:
        self._originals: dict[str, tuple[object, object]] = {}

    def install(self, owner: object, name: str, replacement: object) -> None:
        """Sets ``owner.name = replacement``, remembering the original the first time."""
        if name in self._originals:
            known, _ = self._originals[name]
            if known is not owner:
                raise ValueError(f"{name} is already patched on another owner")
        else:
            self._originals[name] = (owner, getattr(owner, name))
        setattr(owner, name, replacement)

    def original(self, name: str):
        """What ``owner.name`` was before :meth:`install` replaced it."""
        return self._originals[name][1]

    def installed(self, name: str) -> bool:
        """Whether the attribute `name` is replaced."""
        return name in self._originals

    def restore(self) -> None:
        """Puts every original back."""
        for name, (owner, original) in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()
