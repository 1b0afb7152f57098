"""Staged, coalesced KV transport: the data plane beneath vLLM's NIXL control plane.

- :mod:`.layout`: any attention layer's cache as one logical, zero-copy view;
- :mod:`.format`: the canonical packed format of one request's KV in an extent;
- :mod:`.pack`: gather blocks into an extent (prefill), scatter back (decode);
  :mod:`.pack_triton`: the same as one Triton launch for all layers;
- :mod:`.staging`: the registered staging buffer and its extent allocator;
- :mod:`.sizing`: how large each worker's staging is;
- :mod:`.trace`: one log line per handoff event (``KVCACHED_PD_TRACE``).

kvcached-pd's KV connector (:mod:`kvcached_pd.connector`) builds the data path from them.
"""
