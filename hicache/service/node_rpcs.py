"""The node-level RPCs of ``hicache.v1.HiCache``: Stats, Flush, Pin / Unpin / ListPins, Clear, WatchEvents,
GetPoolInfo and Attach.

None of them names a request id. Stats and GetPoolInfo are node-wide figures any token may read. Flush
waits on every tenant's L3 writes (at most ``timeout_s``, 0: no bound, cut to the deadline) and needs an
admin token; so does a Clear of every tenant's pages, while Clear by a token limited to some tenants drops
only those tenants' pages. Pins are per token: Pin for a tenant the token may not act for is
PERMISSION_DENIED, and Unpin and ListPins see only the pins made for the token's tenants (another's pin is
NOT_FOUND, as an unknown one). WatchEvents sends a token limited to some tenants only their pages' events,
numbered 1, 2, 3, ... for that subscriber (:func:`tenant_events`). Attach maps the whole L1 pool (every
tenant's pages): tokens for every tenant only, and only when ``serve.shared_pool`` is on.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import AsyncIterator

import grpc
import numpy as np

from hicache.cache import PinInfo
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.service.auth import Principal
from hicache.service.hostid import host_id
from hicache.service.rpc import Ctx, streaming, unary
from hicache.service.servicer_base import ServicerBase, blocking, denied, within_deadline
from hicache.service.validation import ServiceError, invalid, precondition, token_bytes

DEFAULT_EVENT_QUEUE = 4096
MAX_EVENT_QUEUE = 1 << 20


async def tenant_events(events: AsyncIterator[pb.Event], digests: set[bytes]) -> AsyncIterator[pb.Event]:
    """The hub's ``events`` cut to the runs of the namespaces ``digests``, numbered for this subscriber: each
    event kept gets the next number (1, 2, 3, ...), a snapshot the number of the last event sent before it, so
    the stream is as gap-free as the hub's and says nothing of the events left out (not even how many)."""
    n = 0
    async for ev in events:
        runs = [r for r in ev.runs if r.namespace_digest in digests]
        if ev.kind == pb.Event.SNAPSHOT:
            yield pb.Event(sequence=n, kind=ev.kind, runs=runs, server_id=ev.server_id,
                           snapshot_continues=ev.snapshot_continues)
        elif runs:
            n += 1
            yield pb.Event(sequence=n, kind=ev.kind, runs=runs, server_id=ev.server_id)


class NodeRpcs(ServicerBase):
    """Stats, Flush, pins, Clear, WatchEvents, GetPoolInfo and Attach (see the module docstring)."""

    @staticmethod
    def _admin(who: Principal, what: str) -> None:
        if not who.admin:
            raise denied(f"{what} acts on every tenant's pages: it needs an admin token")

    @unary
    async def Stats(self, request: pb.StatsRequest, context: Ctx) -> pb.StatsResponse:
        st = self.cache.stats()
        reg = self.cache.metrics.registry

        def val(name: str, **labels: str) -> int:
            v = reg.get_sample_value(name, labels or None)
            return int(v or 0)

        storage = st.get("storage")
        return pb.StatsResponse(
            l1_pages_total=st["l1_pages_total"], l1_pages_used=st["l1_pages_used"],
            l1_pages_cached=st["l1_pages_cached"], l1_pages_locked=st["l1_pages_locked"],
            l2_pages_total=st["l2_pages_total"], l2_pages_used=st["l2_pages_used"],
            l2_pages_cached=st["l2_pages_cached"], writeback_queue_pages=st["writeback_queue_pages"],
            lookups=val("hicache_lookups_total"), lookup_tokens=val("hicache_lookup_tokens_total"),
            hit_tokens_l1=val("hicache_hit_tokens_total", tier="l1"),
            hit_tokens_l2=val("hicache_hit_tokens_total", tier="l2"),
            hit_tokens_l3=val("hicache_hit_tokens_total", tier="l3"),
            open_requests=self.open_requests, event_sequence=self.hub.sequence,
            storage_pages_written=storage.sets if storage else 0, storage_pages_read=storage.gets if storage else 0,
            storage_errors=storage.errors if storage else 0,
            storage_corrupt_pages=storage.corrupt_pages if storage else 0,
            storage_bytes_written=storage.bytes_written if storage else 0,
            storage_stored_bytes_written=storage.stored_bytes_written if storage else 0,
            pins=st["pins"], pinned_l1_pages=st["pinned_l1_pages"], pinned_l2_pages=st["pinned_l2_pages"],
        )

    @unary
    async def Flush(self, request: pb.FlushRequest, context: Ctx) -> pb.FlushResponse:
        self._admin(self._who(context), "Flush")
        t = request.timeout_s
        if not math.isfinite(t) or t < 0:
            raise invalid(f"timeout_s: must be a finite number >= 0, got {t}")
        report = await blocking(self.cache.flush, within_deadline(t if t > 0 else None, context))
        if report is None:
            return pb.FlushResponse(has_storage=False, complete=True)
        return pb.FlushResponse(has_storage=True, written_pages=report.written_pages,
                                failed_pages=report.failed_pages, dropped_pages=report.dropped_pages,
                                pending_pages=report.pending_pages, complete=report.complete)

    @staticmethod
    def _pin_pb(info: PinInfo) -> pb.PinInfo:
        return pb.PinInfo(pin_id=info.pin_id, l1_pages=info.l1_pages, l2_pages=info.l2_pages,
                          namespace=info.namespace)

    @unary
    async def Pin(self, request: pb.PinRequest, context: Ctx) -> pb.PinInfo:
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        ns = self._ns(request.namespace, self._who(context))
        try:
            info = self.cache.pin(np.frombuffer(tb, dtype="<u4"), ns)
        except ValueError as e:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, str(e)) from None
        self._pin_tenants[info.pin_id] = ns.tenant
        return self._pin_pb(info)

    def _pin_visible(self, who: Principal, pin_id: int) -> bool:
        """Whether the caller may see (and end) pin ``pin_id``: one made for a tenant it acts for."""
        if who.every_tenant:
            return True
        tenant = self._pin_tenants.get(pin_id)
        return tenant is not None and who.may_act_for(tenant)

    @unary
    async def Unpin(self, request: pb.UnpinRequest, context: Ctx) -> pb.PinInfo:
        try:
            if not self._pin_visible(self._who(context), request.pin_id):
                raise KeyError(request.pin_id)  # another tenant's pin: as if there were none
            info = self.cache.unpin(request.pin_id)
        except KeyError:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"pin_id: no pin {request.pin_id}") from None
        self._pin_tenants.pop(request.pin_id, None)
        return self._pin_pb(info)

    @unary
    async def ListPins(self, request: pb.ListPinsRequest, context: Ctx) -> pb.ListPinsResponse:
        who = self._who(context)
        return pb.ListPinsResponse(pins=[self._pin_pb(p) for p in self.cache.pins()
                                         if self._pin_visible(who, p.pin_id)])

    @unary
    async def Clear(self, request: pb.ClearRequest, context: Ctx) -> pb.ClearResponse:
        who = self._who(context)
        if who.tenants is None:  # every tenant's pages: node-wide
            self._admin(who, "Clear")
            l1, l2 = await blocking(self.cache.clear)
        else:  # a token limited to some tenants clears theirs alone
            l1, l2 = await blocking(self.cache.clear, [self.cache.ns.with_tenant(t) for t in who.tenants])
        return pb.ClearResponse(l1_pages=l1, l2_pages=l2)

    @streaming
    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Ctx) -> AsyncIterator[pb.Event]:
        who = self._who(context)
        if request.max_queue > MAX_EVENT_QUEUE:
            raise invalid(f"max_queue: at most {MAX_EVENT_QUEUE}")
        events = self.hub.stream(self.cache.snapshot, request.max_queue or DEFAULT_EVENT_QUEUE)
        if who.tenants is None:
            async for ev in events:
                yield ev
            return
        async for ev in tenant_events(events, {self.cache.ns.with_tenant(t).digest for t in who.tenants}):
            yield ev

    def pool_info(self) -> pb.PoolInfo:
        lay = self.cache.layout
        ns = self.cache.ns
        return pb.PoolInfo(
            layout=pb.KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                               dtype=lay.dtype, page_size=lay.page_size, attention=lay.attention,
                               describe=lay.describe(), bytes_per_page=lay.bytes_per_page),
            num_pages=self.num_pages, device=str(self.cache.device_pool.device), model=ns.model,
            revision=ns.revision, tp_rank=ns.tp_rank, tp_size=ns.tp_size, namespace_digest=ns.digest,
            host_pid=os.getpid(), hostname=socket.gethostname(), host_id=host_id(),
        )

    @unary
    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context: Ctx) -> pb.PoolInfo:
        return self.pool_info()

    @unary
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.PoolInfo:
        if not self._who(context).every_tenant:
            raise denied("attach: the shared L1 pool holds every tenant's pages: it needs a token for every "
                         "tenant")
        if self.shared is None:
            raise precondition("attach: this server's L1 pool is not shared (serve.shared_pool is false)")
        info = self.pool_info()
        self.shared.fill(info)
        return info
