"""kvcached-pd's KV connector (``kv_connector_module_path="kvcached_pd.connector"``,
``kv_connector="KvcachedPDConnector"``); the autopatch also routes vLLM's
``NixlConnector`` name here when the staged transport is on."""

from kvcached_pd.connector.connector import KvcachedPDConnector, StagedHandshakeMetadata

__all__ = ["KvcachedPDConnector", "StagedHandshakeMetadata"]
