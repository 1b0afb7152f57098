"""A pytest plugin that hides vLLM: the release-independent tests run once, with it.

The test command runs the suite once per vLLM release of the matrix (eight of them), but
most of the suite never touches vLLM: the packed format and kernels, the staging
allocator, the side channel and its fuzzing, the settings, the experiments' harnesses.
Those run once, in a pytest process started with ``-p tests.support.no_vllm``, where
``import vllm`` raises ImportError and vLLM's distribution metadata is not found. A test
that passes there cannot depend on which vLLM is installed; one that needs vLLM fails
there, which is how a file that does not belong in that group is caught
(``scripts/test.sh``'s ``RELEASE_INDEPENDENT`` list).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import sys


class _HideVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ImportError(f"vLLM is hidden in this test group (tests.support.no_vllm): "
                              f"{fullname}")
        return None


def _hidden(real):
    def lookup(name, *args, **kwargs):
        if str(name).lower().replace("_", "-") == "vllm":
            raise metadata.PackageNotFoundError(name)
        return real(name, *args, **kwargs)

    return lookup


if any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
    raise RuntimeError("tests.support.no_vllm: vLLM was imported before the plugin loaded")
sys.meta_path.insert(0, _HideVllm())
metadata.version = _hidden(metadata.version)
metadata.distribution = _hidden(metadata.distribution)
