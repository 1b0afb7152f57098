"""The descriptor bounds check reads vLLM 0.33's strided rows as strictly as per-block ones.

vLLM 0.33 hands NIXL Nx5 rows ``(addr, len, dev, stride, count)``: ``count`` blocks,
``stride`` apart. The check must treat a row as every block it names, i.e. the bytes
``addr .. addr + (count - 1) x stride + len``: reading only ``addr .. addr + len`` (the
per-block form) would pass a row whose first block is in kvcached's physical budget and
whose other blocks run into the unmapped rest of its virtual reservation. Pure numpy
over a hand-made plan; no vLLM needed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcached_pd.errors import LayoutMismatch
from kvcached_pd.patches.nixl_registration import RegistrationPlan, _check_descs

BASE, PAGE, BUDGET, VIRTUAL = 0x10000, 4096, 10, 40  # one layer: 10 of 40 blocks physical


def plan() -> RegistrationPlan:
    return RegistrationPlan(kv_caches={}, budget_blocks=BUDGET,
                            allowed=[(BASE, BASE + BUDGET * PAGE)],
                            virtual=[(BASE, BASE + VIRTUAL * PAGE)])


def strided(addr: int, count: int, length: int = PAGE, stride: int = PAGE) -> np.ndarray:
    return np.array([[addr, length, 0, stride, count]], dtype=np.uint64)


def test_a_strided_row_over_the_budget_counts_every_block():
    p = plan()
    _check_descs(strided(BASE, BUDGET), p)
    per_block = plan()
    _check_descs([(BASE + i * PAGE, PAGE, 0) for i in range(BUDGET)], per_block)
    assert p.num_descs_checked == per_block.num_descs_checked == BUDGET


@pytest.mark.parametrize("row", [
    strided(BASE, BUDGET + 1),  # one block past the budget
    strided(BASE, BUDGET, stride=PAGE + 1),  # its last block ends 9 bytes past
    strided(BASE + (BUDGET - 1) * PAGE, 2),  # starts on the last physical block
], ids=["count", "stride", "start"])
def test_a_strided_row_reaching_past_the_budget_is_refused(row):
    with pytest.raises(LayoutMismatch, match="outside the physical budget"):
        _check_descs(row, plan())


def test_rows_that_describe_no_kvcached_block_are_not_counted():
    p = plan()
    _check_descs(strided(BASE, 0), p)  # count 0: no bytes
    _check_descs(strided(BASE + VIRTUAL * PAGE, 5), p)  # ordinary memory after it
    assert p.num_descs_checked == 0
