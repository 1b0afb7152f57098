"""The `vllm serve` command lines the harness builds parse with vLLM's own parser.

Skipped where vLLM is not installed. On a CPU-only machine vLLM cannot infer its device
while building the parser, so the test pins the CPU platform first.

run: <python with vllm> -m pytest experiments/tests/test_serve_args_vllm.py -q
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pd_modes  # noqa: E402
import pd_servers  # noqa: E402

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def serve_parser():
    import vllm.platforms as platforms

    if platforms.current_platform.device_type in ("", None):
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
    import importlib

    # where `vllm serve`'s parser lives: vLLM 0.33+, 0.30-0.32, <= 0.29
    for module in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                   "vllm.entrypoints.openai.cli_args"):
        try:
            make_arg_parser = importlib.import_module(module).make_arg_parser
            break
        except (ImportError, AttributeError):
            continue
    else:
        raise AssertionError("no make_arg_parser in any module vLLM 0.20-0.33 keeps it in")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("mode_name", list(pd_modes.MODES))
def test_every_mode_parses(serve_parser, mode_name):
    mode = pd_modes.MODES[mode_name]
    settings = pd_servers.ServeSettings(model="/tmp/tiny", max_model_len=4096,
                                        gpu_memory_utilization=0.04, kv_cache_bytes=2 << 30,
                                        vllm_cmd=["vllm", "serve"])
    roles = [("single", mode.single)] if not mode.is_pd else \
        [("prefill", mode.prefill), ("decode", mode.decode)]
    for role, cfg in roles:
        kvt = None if role == "single" else pd_modes.kv_transfer_config(
            mode.connector, "kv_producer" if role == "prefill" else "kv_consumer", f"{mode_name}-x")
        args = pd_servers.serve_args(settings, 18100, cfg.block_size, kvt)
        ns = serve_parser.parse_args(["--model", args[0], *args[1:]])
        assert ns.port == 18100 and ns.enforce_eager and ns.enable_prefix_caching is False
        assert ns.block_size == cfg.block_size and ns.kv_cache_memory_bytes == 2 << 30
        assert ns.max_model_len == 4096 and ns.disable_uvicorn_access_log
        if kvt is None:
            assert ns.kv_transfer_config is None
        else:
            cfg_obj = ns.kv_transfer_config
            assert cfg_obj.kv_connector == mode.connector
            assert cfg_obj.kv_load_failure_policy == "fail"
            assert cfg_obj.engine_id == f"{mode_name}-x"
            assert cfg_obj.kv_role in ("kv_producer", "kv_consumer")


def test_cuda_graphs_drop_enforce_eager(serve_parser):
    """--cuda-graphs (COLO_CUDA_GRAPHS=1) leaves vLLM its default CUDA graphs; the default
    stays eager, as every committed result before 2026-11-27d was measured."""
    for graphs in (False, True):
        settings = pd_servers.ServeSettings(model="/tmp/tiny", max_model_len=4096,
                                            gpu_memory_utilization=0.04, kv_cache_bytes=None,
                                            vllm_cmd=["vllm", "serve"], cuda_graphs=graphs)
        args = pd_servers.serve_args(settings, 18100, 16, None)
        ns = serve_parser.parse_args(["--model", args[0], *args[1:]])
        assert ns.enforce_eager is (not graphs)


def test_logging_config_loads_in_vllm(tmp_path):
    path = pd_servers.write_vllm_logging_config(str(tmp_path / "logging.json"))
    import logging.config

    config = json.loads(open(path).read())
    logging.config.dictConfig(config)  # the formatter class must import from vLLM
    assert logging.getLogger("kvcached_pd").handlers


def test_every_load_flavour_parses_and_prefill_graphs_reach_vllm(serve_parser):
    """The load harness's flavours (pd_modes.LOAD_FLAVOURS) parse too; the prefill-graph
    ones hand vLLM capture sizes up to its 8192-token step, the others leave its default."""
    settings = pd_servers.ServeSettings(model="/tmp/tiny", max_model_len=4096,
                                        gpu_memory_utilization=0.04, kv_cache_bytes=None,
                                        vllm_cmd=["vllm", "serve"], cuda_graphs=True)
    for mode in pd_modes.load_modes(list(pd_modes.LOAD_FLAVOURS)):
        roles = {"single": mode.single} if not mode.is_pd else \
            {"prefill": mode.prefill, "decode": mode.decode}
        for role, cfg in roles.items():
            args = pd_servers.serve_args(settings, 18100, cfg.block_size, None, cfg.serve_args)
            ns = serve_parser.parse_args(["--model", args[0], *args[1:]])
            cc = ns.compilation_config
            sizes = cc.get("cudagraph_capture_sizes") if isinstance(cc, dict) else \
                getattr(cc, "cudagraph_capture_sizes", None)
            graphs = mode.name in ("kvpd-push-p-sync-pgraphs", "kvcached-single-graphs",
                                   "kvpd-push-p-sync-pgraphs-sm60") \
                and role in ("prefill", "single")
            if graphs:
                assert sizes == pd_modes.PREFILL_GRAPH_SIZES and sizes[-1] == 8192, (mode, role)
            else:
                assert not sizes, (mode.name, role, sizes)
