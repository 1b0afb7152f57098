"""Staged, coalesced KV transport: the data plane beneath vLLM's NIXL control plane.

- :mod:`.layout`: any attention layer's cache as one logical, zero-copy view;
- :mod:`.format`: the canonical packed format of one request's KV in an extent;
- :mod:`.pack`: gather blocks into an extent (prefill), scatter back (decode);
- :mod:`.staging`: the registered staging buffer and its extent allocator;
- :mod:`.staged`: the pull-mode data path built from them (state and steps), hooked into
  vLLM by :mod:`kvcached_pd.patches.staged_transport`.
"""
