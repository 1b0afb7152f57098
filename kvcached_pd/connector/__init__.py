"""kvcached-pd's KV connector (``kv_connector_module_path="kvcached_pd.connector"``,
``kv_connector="KvcachedPDConnector"``); the autopatch also routes vLLM's
``NixlConnector`` name here when the staged transport is on.

The class is loaded on first access (PEP 562), so that the patch layer can import the
connector's light modules (``stats``, ``wire``) before vLLM is imported.
"""

__all__ = ["KvcachedPDConnector", "StagedHandshakeMetadata"]


def __getattr__(name: str):
    if name in __all__:
        from kvcached_pd.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
