"""kvcached-pd: vLLM prefill/decode disaggregation over NIXL on kvcached's elastic KV cache.

Importing this package imports nothing of vLLM, torch or wrapt. ``activate()`` checks
the environment gate and, when it is open, arms the patch table (see
``kvcached_pd.patches``).
"""

__version__ = "0.1.0"


def activate():
    from kvcached_pd.activation import activate as _activate

    return _activate()
