"""Activate kvcached-pd from a checkout: ``PYTHONPATH=<repo> vllm serve ...``.

Python imports the first ``sitecustomize`` on ``sys.path`` and no other, so this one
would shadow an existing one (a distribution's, a virtualenv's, another tool's). It
runs that shadowed module first, then calls ``kvcached_pd.activate()``, which reads the
environment gate before importing anything; with the gate closed nothing further is
imported. Errors are reported and never stop the interpreter from starting.
"""

import importlib.util
import os
import sys


def _chain_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        try:
            if os.path.abspath(entry or os.getcwd()) == here:
                continue
        except (TypeError, ValueError):
            continue
        candidate = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is None or spec.loader is None:
                return
            module = importlib.util.module_from_spec(spec)
            sys.modules["_shadowed_sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def _activate_kvcached_pd() -> None:
    # This checkout's directory is on sys.path (that is how this file was found), so
    # kvcached_pd imports from here.
    from kvcached_pd.config import gate_open

    if gate_open():
        from kvcached_pd import activate

        activate()


for _step in (_chain_shadowed_sitecustomize, _activate_kvcached_pd):
    try:
        _step()
    except Exception as _exc:  # noqa: BLE001 - never break interpreter start-up
        sys.stderr.write(f"kvcached-pd sitecustomize: {_step.__name__} failed: {_exc!r}\n")
