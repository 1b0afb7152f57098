"""The KV layout as vLLM itself resolves it, with and without kvcached-pd.

Each case runs in a process where kvcached-pd never ran (forked: ``tests.support.subproc``),
through the real activation path (the
``vllm.general_plugins`` entry point vLLM loads), and asks vLLM's own resolver:
``get_kv_connector_cache_layout`` up to 0.28, ``resolve_kv_cache_layout`` (run once
in the EngineCore) from 0.29.
"""

from __future__ import annotations

import pytest

from tests.conftest import vllm_release
from tests.support import subproc

RESOLVE = r"""
import json, tempfile
from vllm.plugins import load_general_plugins
load_general_plugins()
from tests.support import vllm_nixl_worker as vw
config = vw.make_vllm_config(vw.write_tiny_llama(tempfile.mkdtemp()), connector=CONNECTOR)
from vllm.config import set_current_vllm_config
with set_current_vllm_config(config):
    try:
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        layout = resolve_kv_cache_layout(config, [["LBNHC", "LBHNC"]]).name
    except ImportError:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
        layout = get_kv_cache_layout()
print(json.dumps({"layout": layout}))
"""

KVCACHED = dict(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1", KVCACHED_CONTIGUOUS_LAYOUT="false")
CONNECTORS = ["NixlConnector"] + (["NixlPushConnector"] if vllm_release() >= (0, 24) else [])
HEAD_MAJOR = {"HND", "LBHNC"}
TOKEN_MAJOR = {"NHD", "LBNHC"}


def resolve(connector: str, **env) -> str:
    code = RESOLVE.replace("CONNECTOR", repr(connector))
    return subproc.run_forked_json(code, env=subproc.clean_env(**env))["layout"]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_nixl_asks_for_head_major_without_kvcached(connector):
    assert resolve(connector) in HEAD_MAJOR


@pytest.mark.parametrize("connector", CONNECTORS)
def test_kvcached_gets_token_major_in_every_nixl_mode(connector):
    assert resolve(connector, **KVCACHED) in TOKEN_MAJOR
