"""experiments/bench_pack_latency.py runs on the CPU (the smoke test: the GPU host runs
the same code) and reports the host's launch parts it wraps, then unwraps them."""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import bench_pack_latency  # noqa: E402
from kvcached_pd.transport import pack as pack_mod  # noqa: E402


def test_each_op_and_path_is_timed_with_its_host_parts_and_the_wraps_undone(tmp_path):
    real = pack_mod._on_device
    out = tmp_path / "pl.json"
    result = bench_pack_latency.main(["--device", "cpu", "--small", "--calls", "3",
                                      "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["sizes"]["0.25"].keys() == result["sizes"]["0.25"].keys()
    entry = result["sizes"]["0.25"]
    for op in ("pack[triton]_idle", "unpack[triton]_busy", "pack[single_view]_idle",
               "unpack[single_view]_idle"):
        assert entry[op]["host_ms"] > 0
        assert entry[op]["host__on_device_ms"] > 0, "the block ids' copy was not timed"
        assert math.isnan(entry[op]["device_ms"])  # no CUDA events on the CPU
    assert entry["tag_idle"]["host_ms"] > 0 and entry["tag_pinned_idle"]["host_ms"] > 0
    assert pack_mod._on_device is real, "the timing wrapper stayed in place"
