"""The flag protocol of the resident staged kernel (``staged_kernel="resident"``), as pure Python.

A resident staged transfer has two sides that meet only through two 32-bit flags per staging slot:

* the copy-engine stream, which moves chunk ``c`` between host memory and its slot (DMA), and
* one resident kernel, which moves chunk ``c`` between its slot and the L1 pool.

Chunks get increasing numbers over the stager's life (the first is 1). The DMA side writes
``slot_ready[slot] = number`` after each DMA; the kernel writes ``slot_done[slot] = number`` after each
copy. :func:`number_chunks` gives each chunk the two waits that make this safe:

* load (DMA fills the slot, kernel empties it): the DMA of a chunk waits for ``slot_done`` to reach the
  number of the slot's previous chunk (that chunk was scattered); the kernel waits for ``slot_ready`` to
  reach the chunk's own number (its DMA landed).
* backup (kernel fills the slot, DMA empties it): the kernel waits for ``slot_ready`` to reach the number
  of the slot's previous chunk (that chunk's DMA drained it); the DMA waits for ``slot_done`` to reach the
  chunk's own number (it was gathered).

Each side handles its chunks in order, and transfers on one engine follow each other: a transfer's
kernel starts after the previous transfer's kernel, and its DMAs after the previous transfer's kernel
ended too (the copy-engine stream waits for it). :func:`check_protocol` plays that out step by step and
raises if the two sides could deadlock or a slot could be overwritten before its chunk was consumed;
the tests run it on random transfers. ``CudaTransferEngine._staged_resident`` numbers its chunks with
:func:`number_chunks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class ResidentChunk(NamedTuple):
    """One chunk's slot, number and waits (0: no wait)."""

    slot: int
    number: int
    kernel_wait: int  # the kernel copies the chunk once slot_ready[slot] >= kernel_wait
    dma_wait: int  # the DMA of the chunk starts once slot_done[slot] >= dma_wait


def number_chunks(slots: Sequence[int], last: list[int], first_number: int, to_host: bool) -> list[ResidentChunk]:
    """Number the chunks of one transfer, which use ``slots`` in order.

    ``last[s]`` is the number of the last chunk that used slot ``s`` (0 for none); it is updated in
    place. ``first_number`` is the number of this transfer's first chunk.
    """
    out = []
    for k, s in enumerate(slots):
        num = first_number + k
        prev = last[s]
        last[s] = num
        if to_host:
            out.append(ResidentChunk(s, num, kernel_wait=prev, dma_wait=num))
        else:
            out.append(ResidentChunk(s, num, kernel_wait=num, dma_wait=prev))
    return out


class ProtocolError(AssertionError):
    """The resident protocol could deadlock or lose data for these transfers."""


def check_protocol(transfers: Sequence[Sequence[ResidentChunk]], n_slots: int, to_host: bool) -> int:
    """Play back-to-back transfers of one direction to the end; return the number of chunk moves.

    The kernel and the DMA side each take their next chunk only when its wait is met (flags start at 0).
    Races show only when one side runs ahead, so the transfers are played twice: once with the DMA side
    moving whenever it can and the kernel only when the DMA side is stuck, once the other way round.
    Raises :class:`ProtocolError` when neither side can move before every chunk is done (a deadlock), or
    when a slot is written while it still holds a chunk the other side has not consumed, or consumed
    when it does not hold the chunk expected.
    """
    moves = 0
    for favour_dma in (True, False):
        moves = _play(transfers, n_slots, to_host, favour_dma)
    return moves


def _play(transfers: Sequence[Sequence[ResidentChunk]], n_slots: int, to_host: bool, favour_dma: bool) -> int:
    slot_ready = [0] * n_slots
    slot_done = [0] * n_slots
    holds: list[int | None] = [None] * n_slots  # the chunk number a slot holds and nobody has consumed
    pos = {"kernel": [0, 0], "dma": [0, 0]}  # (transfer, next chunk of it) of each side
    n = len(transfers)
    moves = 0

    def fill(s: int, num: int) -> None:
        if holds[s] is not None:
            raise ProtocolError(f"slot {s} overwritten by chunk {num} before chunk {holds[s]} was consumed")
        holds[s] = num

    def drain(s: int, num: int) -> None:
        if holds[s] != num:
            raise ProtocolError(f"slot {s} consumed as chunk {num} but holds {holds[s]}")
        holds[s] = None

    def move(c: ResidentChunk, wait_on: list[int], wait: int, publish: list[int], fills: bool) -> bool:
        """Move chunk ``c`` once ``wait_on[slot] >= wait``: fill or drain its slot, publish its number."""
        nonlocal moves
        if wait_on[c.slot] < wait:
            return False
        (fill if fills else drain)(c.slot, c.number)
        publish[c.slot] = c.number
        moves += 1
        return True

    def step_kernel() -> bool:
        """One move of the kernel side; False when it cannot move. Kernels run one transfer after another."""
        t, i = pos["kernel"]
        if t >= n:
            return False
        chunks = transfers[t]
        if i == len(chunks):
            pos["kernel"] = [t + 1, 0]
            return True
        if not move(chunks[i], slot_ready, chunks[i].kernel_wait, slot_done, fills=to_host):
            return False
        pos["kernel"] = [t, i + 1]
        return True

    def step_dma() -> bool:
        """One move of the DMA side; its transfer t starts after the kernel of t - 1 ended, and ends
        after its own kernel ended (the stream waits for it)."""
        t, i = pos["dma"]
        kt = pos["kernel"][0]
        if t >= n or kt < t:
            return False
        chunks = transfers[t]
        if i == len(chunks):
            if kt > t:
                pos["dma"] = [t + 1, 0]
                return True
            return False
        if not move(chunks[i], slot_done, chunks[i].dma_wait, slot_ready, fills=not to_host):
            return False
        pos["dma"] = [t, i + 1]
        return True

    first, second = (step_dma, step_kernel) if favour_dma else (step_kernel, step_dma)
    while pos["kernel"][0] < n or pos["dma"][0] < n:
        if not first() and not second():
            raise ProtocolError(f"deadlock: kernel at (transfer, chunk) {tuple(pos['kernel'])}, "
                                f"DMA at {tuple(pos['dma'])}")
    if any(h is not None for h in holds):
        raise ProtocolError(f"chunks left unconsumed in slots: {holds}")
    return moves
