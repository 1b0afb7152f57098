"""experiments/bench_remote_unpack.py's parts that run without a GPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_remote_unpack as bench  # noqa: E402

from kvcached_pd.transport import pack_graph  # noqa: E402


def test_the_first_shape_is_the_products():
    # the sweep's first row is what the servers run, whatever pack_graph's constants become
    assert bench.SHAPES[0] == (pack_graph.BLOCK, pack_graph.PROGRAMS_PER_SM,
                               pack_graph.NUM_WARPS)


@pytest.mark.parametrize("text", ["1000/16/4", "1024/0/4", "1024/16/3", "1024/16", "a/b/c"])
def test_shapes_refuse_what_triton_cannot_launch(text):
    with pytest.raises(ValueError):
        bench.parse_shapes(text)


def test_shapes_and_the_table():
    assert bench.parse_shapes("2048/8/8,1024/16/4") == ((2048, 8, 8), (1024, 16, 4))
    row = {"block": 2048, "programs_per_sm": 8, "warps": 8, "mib": 1024.0,
           "local_pack_ms": 0.5915, "local_unpack_ms": 0.5948}
    table = bench.render({"devices": ["H200"], "peer_access": False, "rows": [row]})
    assert "2048/8/8" in table and "0.5915" in table and table.splitlines()[-1].endswith("-")
