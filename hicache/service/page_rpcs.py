"""The page-bytes RPCs of ``hicache.v1.HiCache``, for peers on other hosts: ReadPages and WritePages.

ReadPages matches its tokens (L1, L2, then L3 when the node has a store, prefetching as the prefetch policy
says), loads what it found onto L1 and streams the pages' canonical bytes (:mod:`.pages`), at most
``PAGE_CHUNK_BYTES`` (and half of ``serve.max_message_bytes``) a message, at least one page; the request it
opened is released when the stream ends, even when the peer went away mid-stream. It counts as a lookup
once its load is under way: one refused for room counts nothing.

WritePages takes a header (tokens, namespace, ``first_page``) and then the bytes of pages ``first_page..``
of those tokens' full pages, exactly that many bytes. The tenant is checked before any data is read; the
pages before ``first_page`` must already be cached here (FAILED_PRECONDITION otherwise, refused before any
L2 -> L1 load when L1 and L2 together lack them). The pages this node lacks are written into fresh L1
pages and committed as the engine's Commit would; it is no lookup (a peer's pages) and never asks L3.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.service.decode import Undecodable
from hicache.service.pages import gather_pages, scatter_pages
from hicache.service.rpc import Ctx, streaming, unary
from hicache.service.servicer_base import ServicerBase, blocking, denied
from hicache.service.validation import invalid, precondition, shown, token_bytes

PAGE_CHUNK_BYTES = 4 << 20  # ReadPages: at most this much page data per message (at least one page)


class PageRpcs(ServicerBase):
    """ReadPages and WritePages (see the module docstring)."""

    @streaming
    async def ReadPages(self, request: pb.ReadPagesRequest, context: Ctx) -> AsyncIterator[pb.PageChunk]:
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        ns = self._ns(request.namespace, self._who(context))
        # counted as a lookup once its load is under way (_load): a ReadPages refused for room counts nothing
        req = await blocking(functools.partial(self.cache.match, defer_count=True), np.frombuffer(tb, dtype="<u4"),
                             ns)
        try:
            if self.cache.storage is not None:
                await blocking(self.cache.prefetch, req)
            load = await blocking(self._load, req)
            dev = load.device_indices
            if request.max_pages:
                dev = dev[: request.max_pages]
            bpp = self.cache.layout.bytes_per_page
            per = max(1, min(PAGE_CHUNK_BYTES, self.serve.max_message_bytes // 2) // bpp)
            total = len(dev)
            for lo in range(0, total, per):
                chunk = dev[lo: lo + per]
                data = await blocking(gather_pages, self.cache.device_pool, chunk)
                yield pb.PageChunk(first_page=lo, num_pages=len(chunk), page_keys=req.keys[lo: lo + len(chunk)],
                                   data=data, total_pages=total)
        finally:
            self.cache.release(req)  # quick; runs even when the peer went away mid-stream

    @unary
    async def WritePages(self, request_iterator: AsyncIterator[pb.WritePagesChunk],
                         context: Ctx) -> pb.CommitResponse:
        header: pb.WritePagesHeader | None = None
        buf = bytearray()
        limit = 0
        tb = b""
        bpp = self.cache.layout.bytes_per_page
        async for msg in request_iterator:
            if isinstance(msg, Undecodable):
                raise invalid(msg.message)
            part = msg.WhichOneof("part")
            if header is None:
                if part != "header":
                    raise invalid("write pages: the first message must carry the header")
                header = msg.header
                # the tenant first: a token refused for it gets PERMISSION_DENIED before its data is read
                tenant = header.namespace.tenant or self.cache.ns.tenant
                if not self._who(context).may_act_for(tenant):
                    raise denied(f"namespace.tenant {shown(tenant)}: this token may not act for that tenant")
                tb = token_bytes(header.tokens, header.token_ids, self.max_tokens)
                n = len(tb) // (self.page_size * 4)
                if header.first_page >= n:
                    raise invalid(f"header.first_page: {header.first_page} but the tokens have {n} full pages")
                limit = (n - header.first_page) * bpp
                continue
            if part != "data":
                raise invalid("write pages: only the first message may carry a header")
            if len(buf) + len(msg.data) > limit:
                raise invalid(f"data: more than the {limit} bytes of pages {header.first_page}.. of the tokens")
            buf += msg.data
        if header is None:
            raise invalid("write pages: empty stream")
        if len(buf) != limit:
            raise invalid(f"data: {len(buf)} bytes, pages {header.first_page}.. need {limit}")
        ns = self._ns(header.namespace, self._who(context))
        return await blocking(self._write_pages, tb, ns, header.first_page, bytes(buf))

    def _write_pages(self, tb: bytes, ns: Any, first: int, data: bytes) -> pb.CommitResponse:
        cache = self.cache
        tokens = np.frombuffer(tb, dtype="<u4")
        req = cache.match(tokens, ns, l3=False, keys=False, count=False)  # a peer's pages, not a lookup
        try:
            if req.l1_pages + req.l2_pages < first:  # refused before any L2 -> L1 load moves pages
                raise precondition(f"header.first_page: pages before {first} must be cached here; "
                                   f"this node has the first {req.l1_pages + req.l2_pages}")
            have = len(self._load(req).device_indices)
            if have < first:
                raise precondition(f"header.first_page: pages before {first} must be cached here; "
                                   f"this node has the first {have}")
            n = req.num_pages
            bpp = cache.layout.bytes_per_page
            res = None
            new = np.empty(0, dtype=np.int64)
            if n > have:
                new = cache.alloc(req, n - have)
                scatter_pages(cache.device_pool, new, data[(have - first) * bpp:])
            res = cache.commit(req, tokens, np.concatenate([req.device_indices, new]))
            return pb.CommitResponse(new_pages=res.new_pages, reused_pages=res.reused_pages,
                                     backed_up_pages=res.backed_up_pages, device_indices=req.device_indices.tolist())
        finally:
            cache.release(req)

