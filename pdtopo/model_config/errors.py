"""CheckpointError: a model config value pdtopo cannot serve exactly, with where it was read.

Raised while a model config is read (`config.json` of a checkpoint, or the `model:` group) for
anything that would change the model's math in a way pdtopo does not implement. The launcher's
pre-flight turns it into an exit-2 error before any program starts; a runtime process that meets
it fails its start with the same text.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(ValueError):
    """`where`: the file (or config group) read; `key`: the offending key; `value`: its value."""

    def __init__(self, where: str, key: str, value: Any, message: str) -> None:
        self.where, self.key, self.value, self.message = where, key, value, message
        super().__init__(f"{where}: {key}={value!r}: {message}")
