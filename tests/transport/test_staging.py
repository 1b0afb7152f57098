"""The staging extent allocator never overlaps, leaks or crashes on a full buffer."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvcached_pd.transport import staging
from kvcached_pd.transport.staging import ExtentAllocator, StagingBuffer, StagingError

ALIGNMENT = 256
CAPACITY = 64 * ALIGNMENT


def _reserved(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def check_invariants(allocator: ExtentAllocator) -> None:
    live = allocator.live_extents()
    free = allocator.free_ranges()
    spans = sorted([(e.offset, e.offset + _reserved(e.nbytes)) for e in live] + free)
    # Live reservations and free ranges tile [0, capacity) exactly: no overlap, no hole.
    position = 0
    for start, end in spans:
        assert start == position and end > start
        position = end
    assert position == allocator.capacity_bytes
    for extent in live:
        assert extent.offset % ALIGNMENT == 0
        assert 0 <= extent.offset and extent.end <= allocator.capacity_bytes
    # Free neighbours are always coalesced.
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(free, free[1:]))
    used = sum(_reserved(e.nbytes) for e in live)
    assert allocator.used_bytes == used
    assert allocator.used_bytes + allocator.free_bytes == allocator.capacity_bytes
    assert allocator.num_live == len(live)
    assert allocator.largest_free == max((end - start for start, end in free), default=0)
    assert sum(allocator.owners().values()) == used


class AllocatorMachine(RuleBasedStateMachine):
    extents = Bundle("extents")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = ExtentAllocator(CAPACITY, ALIGNMENT)
        self.freed = []

    @rule(target=extents, nbytes=st.integers(1, CAPACITY // 4), owner=st.integers(0, 5))
    def alloc(self, nbytes, owner):
        largest = self.allocator.largest_free
        extent = self.allocator.alloc(nbytes, owner)
        # First fit over coalesced ranges: it fails only when nothing large enough is free.
        assert (extent is None) == (_reserved(nbytes) > largest)
        if extent is not None:
            assert extent.nbytes == nbytes and extent.owner == owner
        return extent

    @rule(extent=consumes(extents))
    def free(self, extent):
        if extent is None or not self.allocator.is_live(extent):
            return  # failed allocation, or already released by an abort
        self.allocator.free(extent)
        self.freed.append(extent)

    @rule(owner=st.integers(0, 5))
    def abort(self, owner):
        held = [e for e in self.allocator.live_extents() if e.owner == owner]
        assert self.allocator.release_owner(owner) == len(held)
        self.freed.extend(held)
        assert owner not in self.allocator.owners()

    @rule()
    def double_free_raises(self):
        if self.freed:
            with pytest.raises(StagingError, match="not live"):
                self.allocator.free(self.freed[-1])

    @invariant()
    def tiles_capacity(self):
        check_invariants(self.allocator)

    def teardown(self):
        for extent in self.allocator.live_extents():
            self.allocator.free(extent)
        check_invariants(self.allocator)
        assert self.allocator.free_ranges() == [(0, CAPACITY)]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_ten_thousand_alloc_abort_cycles_leak_nothing() -> None:
    rng = random.Random(0)
    allocator = ExtentAllocator(1 << 20, ALIGNMENT)
    live = []
    for cycle in range(10_000):
        extent = allocator.alloc(rng.randint(1, 1 << 16), owner=f"req-{cycle}")
        if extent is not None:
            live.append(extent)
        if live and rng.random() < 0.5:
            victim = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                allocator.free(victim)
            else:
                assert allocator.release_owner(victim.owner) == 1
    check_invariants(allocator)
    for extent in live:
        allocator.free(extent)
    assert allocator.used_bytes == 0 and allocator.num_live == 0
    assert allocator.free_ranges() == [(0, 1 << 20)]


def test_full_buffer_returns_none_and_recovers() -> None:
    allocator = ExtentAllocator(4 * ALIGNMENT, ALIGNMENT)
    first = allocator.alloc(3 * ALIGNMENT, "a")
    assert allocator.alloc(2 * ALIGNMENT, "b") is None
    second = allocator.alloc(1, "b")
    assert allocator.alloc(1, "c") is None and allocator.free_bytes == 0
    allocator.free(first)
    assert allocator.alloc(3 * ALIGNMENT, "c") is not None
    allocator.free(second)


def test_stale_handle_to_a_reused_offset_is_refused() -> None:
    allocator = ExtentAllocator(4 * ALIGNMENT, ALIGNMENT)
    stale = allocator.alloc(100, "a")
    allocator.free(stale)
    fresh = allocator.alloc(100, "a")
    assert fresh.offset == stale.offset
    with pytest.raises(StagingError, match="not live"):
        allocator.free(stale)
    assert allocator.is_live(fresh)


def test_foreign_extent_is_refused() -> None:
    other = ExtentAllocator(4 * ALIGNMENT, ALIGNMENT).alloc(10, "x")
    with pytest.raises(StagingError, match="not live"):
        ExtentAllocator(4 * ALIGNMENT, ALIGNMENT).free(other)


@pytest.mark.parametrize(
    "capacity, alignment, nbytes, message",
    [(1000, 256, 1, "multiple of 256"), (1024, 100, 1, "power of two"), (1024, 256, 0, "positive")],
)
def test_bad_arguments_are_refused(capacity, alignment, nbytes, message) -> None:
    with pytest.raises(ValueError, match=message):
        ExtentAllocator(capacity, alignment).alloc(nbytes, "a")


def test_concurrent_alloc_and_free_keep_extents_disjoint() -> None:
    allocator = ExtentAllocator(1 << 16, ALIGNMENT)
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(2000):
                extent = allocator.alloc(rng.randint(1, 2048), owner=seed)
                if extent is not None:
                    mine.append(extent)
                if mine and rng.random() < 0.5:
                    allocator.free(mine.pop(rng.randrange(len(mine))))
            for extent in mine:
                allocator.free(extent)
        except Exception as error:  # surfaced below; a thread's exception is otherwise lost
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    # Switch threads as often as the interpreter allows, so an unlocked section races.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert not errors
    assert allocator.free_ranges() == [(0, 1 << 16)]


def test_staging_buffer_views_are_typed_and_disjoint() -> None:
    buffer = StagingBuffer(8 * ALIGNMENT, "cpu", ALIGNMENT)
    a = buffer.alloc(3 * 4 * 2, "a")
    b = buffer.alloc(ALIGNMENT, "b")
    view_a = buffer.view(a, torch.bfloat16, (3, 4))
    view_a.fill_(1.5)
    buffer.view(b).fill_(7)
    assert view_a.shape == (3, 4) and bool((view_a == 1.5).all())
    assert view_a.data_ptr() == buffer.tensor.data_ptr() + a.offset
    assert bool((buffer.view(b) == 7).all())
    with pytest.raises(ValueError, match="does not cover"):
        buffer.view(a, torch.bfloat16, (5, 4))
    with pytest.raises(ValueError, match="whole torch.float32"):
        buffer.view(buffer.alloc(6, "c"), torch.float32)
    buffer.free(a)
    with pytest.raises(StagingError, match="not live"):
        buffer.view(a)


def test_staging_buffer_allocation_failure_names_the_setting(monkeypatch) -> None:
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(staging.torch, "empty", out_of_memory)
    with pytest.raises(StagingError, match="4096 MiB.*KVCACHED_PD_STAGING_MB"):
        StagingBuffer(4 << 30, "cpu")
