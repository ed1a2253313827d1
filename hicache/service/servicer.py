"""RPC handlers of ``hicache.v1.HiCache`` over one :class:`hicache.cache.HiCache`: :class:`HiCacheServicer`.

The handlers live by concern, composed here: the request lifecycle -- Match, MatchStream, Prefetch,
Allocate, Commit, Release -- in :mod:`.request_rpcs`; the node-level RPCs -- Stats, Flush, pins, Clear,
WatchEvents, GetPoolInfo, Attach -- in :mod:`.node_rpcs`; page bytes for peers -- ReadPages, WritePages --
in :mod:`.page_rpcs`; what they share (admission, the caller, the request tables, idle expiry, shutdown) in
:mod:`.servicer_base`.

Hot path: Match runs inline on the event loop (a radix walk: ~20 us for 8k tokens; page keys are only
hashed when the store is asked or the caller wants them); L3 lookups, prefetch, L2 -> L1 loads and page
streams run on a worker thread. Match and Allocate may still block the loop briefly, on backups in flight
(allocation under pressure, ``write_back`` evictions) or on a full L3 write queue
(``writeback_when_full: block``). Every handler first validates (:mod:`.validation`), then acts, so a
call rejected for its input changes nothing; one refused for room may have evicted unlocked pages
first. Every RPC counts against ``serve.max_concurrency`` (RESOURCE_EXHAUSTED beyond it) and is timed
into ``hicache_rpc_seconds`` (:mod:`.rpc`); a MatchStream counts per message, not for its life.

Deadlines: gRPC cancels a handler whose deadline passed; Prefetch cuts its wait for the L3 run to the
time remaining, while ReadPages and WritePages wait as the prefetch policy says. What becomes of a Match
cancelled mid-way, or whose reply was lost, is :mod:`.request_rpcs`'s.

Tenants (:mod:`.auth`). Every caller is a :class:`~hicache.service.auth.Principal`: with auth off or one
``serve.auth_token``, one that may do everything; with ``serve.auth_tokens_file``, each token acts for its
tenants only. The tenant a call acts for is its ``namespace.tenant`` (the node's ``model.tenant`` when
empty). Match, MatchStream, Pin, ReadPages and WritePages for a tenant the token may not act for end with
PERMISSION_DENIED (a MatchStream message: that reply) before the cache is touched. Request ids are per token
(one token's Allocate / Commit / Prefetch / Release never reaches another's requests: NOT_FOUND, as an
unknown id), and so are pins (Unpin, ListPins: only the pins made for the token's tenants). WatchEvents
sends a token limited to some tenants only their pages' events, numbered 1, 2, 3, ... for that subscriber
(gap-free, as the hub numbers them for one that sees everything). Clear by a token limited to some tenants
drops only those tenants' pages; a Clear of every tenant's pages, and Flush (it waits on every tenant's
writes), need an admin token. Attach maps the whole L1 pool (every tenant's pages): tokens for every tenant
only. Stats and GetPoolInfo are node-wide figures any token may read.
"""

from __future__ import annotations

from hicache.service.node_rpcs import NodeRpcs
from hicache.service.page_rpcs import PageRpcs
from hicache.service.request_rpcs import RequestRpcs


class HiCacheServicer(RequestRpcs, NodeRpcs, PageRpcs):
    """Every RPC of ``hicache.v1.HiCache``; built with :class:`~hicache.service.servicer_base.ServicerBase`'s
    arguments (the cache, ``serve``, metrics, the event hub, the shared pool, the request TTL, auth)."""
