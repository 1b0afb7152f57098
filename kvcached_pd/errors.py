"""Errors kvcached-pd raises on purpose; each message says what to change."""


class KvcachedPdError(RuntimeError):
    """A configuration kvcached-pd refuses because it would move KV wrongly."""


class UnsupportedConfiguration(KvcachedPdError):
    """kvcached + NIXL in a configuration no patch can make correct."""


class LayoutMismatch(KvcachedPdError):
    """A KV cache tensor whose memory layout kvcached-pd cannot describe to NIXL."""
