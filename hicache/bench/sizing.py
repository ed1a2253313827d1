"""How much L2 the workload wants: the smallest capacity on the hit-rate curve that comes within
``SIZING_MARGIN`` of the infinite-capacity bound, as an L2 size, checked by replaying the trace with it.

The curve (:class:`~hicache.bench.run.CurvePoint`) is the eviction policy replayed on one tier of each
capacity. Under the write-through policies L2 holds a copy of what L1 holds as well as what L1 evicted
(an inclusive hierarchy), so an L2 of a capacity read off the curve behaves like one tier of that
capacity: that is the size suggested (never less than the L1). ``write_back`` keeps fewer copies and
needs somewhat less. The suggestion is then replayed (same L1, policies and trace; no L3) and the hit
rate it reached is reported beside the curve's, so the figure printed is measured, not estimated. The
curve is sampled at the fractions asked for (``--capacities``): the answer is the smallest sampled
capacity that is enough, not the smallest that would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from hicache.bench.units import human_bytes, human_tokens

SIZING_MARGIN = 0.02  # "enough": within 2 points of the hit rate unlimited capacity would give


class _Point(Protocol):
    fraction: float
    capacity_tokens: int
    policy: float


@dataclass(frozen=True)
class Sizing:
    """An L2 size that should bring the run within the margin of its ``bound``."""

    l2_tokens: int  # suggested L2 capacity
    fraction: float  # of the working set, on the curve
    curve_hit_rate: float  # the policy's on one tier of that capacity
    bound: float  # infinite capacity
    l1_tokens: int
    current_l2_tokens: int
    checked_hit_rate: float | None = None  # replayed with the suggested L2 (None: not checked)

    def checked(self, hit_rate: float) -> Sizing:
        return replace(self, checked_hit_rate=hit_rate)

    def describe(self, bytes_per_token: int, write_policy: str = "") -> str:
        """One line for the report."""
        n = self.l2_tokens
        text = (f"an L2 of {human_tokens(n)} tokens ({human_bytes(n * bytes_per_token)}; now "
                f"{human_tokens(self.current_l2_tokens)}) should reach about {self.curve_hit_rate:.1%} "
                f"(bound {self.bound:.1%}): `--l2 {n}`")
        got = self.checked_hit_rate
        if got is not None:
            text += f"; replayed with it: {got:.1%}"
            if got < self.curve_hit_rate - SIZING_MARGIN and write_policy == "write_through_selective":
                text += (" (write_through_selective drops pages evicted from L1 before their first reuse: "
                         "`--write-policy write_through` keeps them)")
        return text

    def to_dict(self) -> dict[str, float | int | None]:
        return dict(vars(self))


def size_for_bound(hit_rate: float, bound: float, l1_tokens: int, l2_tokens: int,
                   curve: Sequence[_Point], margin: float = SIZING_MARGIN) -> Sizing | None:
    """The L2 to try when the run fell short of ``bound`` by more than ``margin``: the smallest sampled
    capacity whose hit rate is within ``margin`` of the bound (at least ``l1_tokens``), when that is more
    than the configured ``l2_tokens``. ``None`` when the run is close enough, the curve never comes close
    (too coarse, or empty), or the configured L2 is already that large (the gap is not one of capacity:
    L3 misses, a write policy that drops pages, a remote target's other traffic)."""
    if hit_rate >= bound - margin:
        return None
    enough = [p for p in sorted(curve, key=lambda p: p.capacity_tokens) if p.policy >= bound - margin]
    if not enough:
        return None
    p = enough[0]
    need = max(p.capacity_tokens, l1_tokens)
    if need <= l2_tokens:
        return None
    return Sizing(need, p.fraction, p.policy, bound, l1_tokens, l2_tokens)
