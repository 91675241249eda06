"""The TailError family.

Every error carries plain-string state only and defines ``__reduce__`` so it survives
pickling across Ray workers and DDP processes unchanged (Ray re-raises remote errors on
the caller; an exception that fails to unpickle there hides the real cause).
"""

from __future__ import annotations


class TailError(Exception):
    """Base of every error tail-ray raises on purpose."""


class ConfigError(TailError, ValueError):
    """A setting is out of range or inconsistent; the message says which and how to fix it."""


class CodecError(TailError):
    """A payload is truncated, corrupted, of the wrong version, or asks for an absurd size.

    ``layer`` and ``field`` name where decoding stopped, so a bad peer can be found.
    """

    def __init__(self, message: str, *, layer: str | None = None, field: str | None = None) -> None:
        self.message = message
        self.layer = layer
        self.field = field
        where = []
        if layer is not None:
            where.append(f"layer {layer!r}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_codec_error, (self.message, self.layer, self.field))


def _rebuild_codec_error(message: str, layer: str | None, field: str | None) -> CodecError:
    return CodecError(message, layer=layer, field=field)
