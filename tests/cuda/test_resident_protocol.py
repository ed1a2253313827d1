"""The resident staged kernel's flag protocol (pure Python, runs anywhere): chunk numbering and waits
never deadlock and never overwrite a slot before its chunk was consumed, and the checker catches
numberings that would."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.transfer.resident_protocol import ProtocolError, ResidentChunk, check_protocol, number_chunks


def _transfers(sizes: list[int], n_slots: int, to_host: bool, start_slot: int = 0) -> list[list[ResidentChunk]]:
    """Back-to-back transfers of ``sizes`` chunks, slots taken in turn as the engine's stager does."""
    last = [0] * n_slots
    nxt, num = start_slot % n_slots, 1
    out = []
    for size in sizes:
        slots = [(nxt + k) % n_slots for k in range(size)]
        nxt = (nxt + size) % n_slots
        out.append(number_chunks(slots, last, num, to_host))
        num += size
    return out


@settings(max_examples=200, deadline=None)
@given(n_slots=st.integers(1, 6), sizes=st.lists(st.integers(1, 20), min_size=1, max_size=5),
       to_host=st.booleans(), start=st.integers(0, 5))
def test_numbering_never_deadlocks_or_overwrites(n_slots: int, sizes: list[int], to_host: bool, start: int) -> None:
    transfers = _transfers(sizes, n_slots, to_host, start)
    assert check_protocol(transfers, n_slots, to_host) == 2 * sum(sizes)  # every chunk moved by both sides


def test_number_chunks_waits() -> None:
    last = [0, 0]
    load = number_chunks([0, 1, 0], last, 1, to_host=False)
    assert [(c.kernel_wait, c.dma_wait) for c in load] == [(1, 0), (2, 0), (3, 1)]
    assert last == [3, 2]
    back = number_chunks([1, 0], last, 4, to_host=True)
    assert [(c.kernel_wait, c.dma_wait) for c in back] == [(2, 4), (3, 5)]


def test_checker_catches_a_load_that_refills_a_slot_too_early() -> None:
    transfers = _transfers([5], 2, to_host=False)
    broken = [[c._replace(dma_wait=0) for c in transfers[0]]]  # DMA no longer waits for the scatter
    with pytest.raises(ProtocolError, match="overwritten"):
        check_protocol(broken, 2, to_host=False)


def test_checker_catches_a_backup_dma_before_the_gather() -> None:
    transfers = _transfers([3], 2, to_host=True)
    broken = [[c._replace(dma_wait=0) for c in transfers[0]]]
    with pytest.raises(ProtocolError, match="consumed"):
        check_protocol(broken, 2, to_host=True)


def test_checker_catches_a_deadlock() -> None:
    transfers = _transfers([3], 2, to_host=False)
    broken = [[c._replace(kernel_wait=c.number + 1) for c in transfers[0]]]  # waits for a flag never written
    with pytest.raises(ProtocolError, match="deadlock"):
        check_protocol(broken, 2, to_host=False)
