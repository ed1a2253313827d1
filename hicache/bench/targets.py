"""What a trace is replayed against.

A :class:`Target` serves one request the way a serving engine drives the cache -- match, prefetch the
L3 run, load back, allocate pages for the rest of the prompt and the output, commit, release -- and
says how many prompt tokens each tier hit and how many were not recomputed.

* :class:`InProcessTarget` -- a :class:`~hicache.cache.HiCache` in this process. For hit-rate purposes
  the KV layout may be tiny (one layer, one head, ``head_dim`` 1): copies are then negligible and the
  hit rate is the same as with the real layout, which only scales bytes.
* :class:`GrpcTarget` -- a node at ``grpc://host:port`` through :mod:`hicache.client` (imported only then).
* :class:`RouterTarget` -- a router (``hicache route``) at ``grpc://host:port``: each request is routed,
  served on the node the router chose, and reported back (``Complete``), as a cluster's front end does.

:func:`open_target` picks one from a string (``inproc`` or ``grpc://host:port``; a router answers there
with ``hicache.v1.Router`` instead of the node service).
"""

from __future__ import annotations

import abc
import contextlib
import time
from typing import Any, NamedTuple

import numpy as np

from hicache.bench.errors import BenchInputError
from hicache.bench.workloads import TraceRequest
from hicache.cache import CacheFullError, HiCache
from hicache.client.address import AddressError, parse_address
from hicache.config import HiCacheConfig


class Outcome(NamedTuple):
    """What one request found, in tokens of its prompt (full pages only)."""

    l1: int  # hit on L1
    l2: int  # continuing on L2 and served from it: loaded back onto L1 (a run that found no room there is
    # recomputed, not a hit)
    l3: int  # continuing on L3 and served from it: landed through the request's prefetch and loaded back
    # (pages the store reported at match but did not deliver in time, or at all, are not hits)
    reused: int  # KV available on L1 for compute after load-back: tokens not recomputed
    committed: int  # tokens of prompt + output cached after the request
    seconds: float  # time spent in cache calls


def served_l2(l1_pages: int, l2_pages: int, usable: int) -> int:
    """Pages of a request's L2 run (``l2_pages`` after its ``l1_pages`` L1 hit) within its prefix on L1 after
    its load back, ``usable`` pages long: the L2 hit it was served."""
    return min(l2_pages, max(0, usable - l1_pages))


class Target(abc.ABC):
    """Serves requests one at a time (not thread-safe)."""

    name: str = ""
    page_size: int = 0

    @abc.abstractmethod
    def serve(self, req: TraceRequest) -> Outcome: ...

    def stats(self) -> dict[str, Any]:
        return {}

    def settle(self) -> bool:
        """Wait until the work a request left running in the background (L1 -> L2 backups, L3 writes)
        is done. False: this target cannot wait for it (and did not)."""
        return False

    def clear(self) -> None:  # noqa: B027 - optional hook
        """Start cold: drop the L1 and L2 pages of the cache(s) behind this target (a store keeps its);
        a no-op where the target starts empty (the in-process cache)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the cache / connection."""

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessTarget(Target):
    """A HiCache in this process, built from ``config`` (its storage URL opens L3)."""

    name = "inproc"

    def __init__(self, config: HiCacheConfig) -> None:
        self.cache = HiCache(config)
        self.page_size = self.cache.page_size
        self.commit_skipped = 0  # requests whose pages could not be cached (everything locked)

    def serve(self, req: TraceRequest) -> Outcome:
        c, ps = self.cache, self.page_size
        t0 = time.perf_counter()
        r = c.match(req.tokens)
        l1, l2, l3 = r.l1_pages, 0, 0
        committed = 0
        try:
            if r.l3_pages:
                c.prefetch(r)
            with contextlib.suppress(CacheFullError):  # the L2 run does not fit on L1 now: recomputed
                load = c.load_back(r, layer_wise=False)
                load.wait()
                l2 = served_l2(r.l1_pages, r.l2_pages, len(load.device_indices))
                l3 = load.l3_pages  # what the prefetch delivered, not what the store reported at match
            have = len(r.device_indices)
            seq = np.concatenate([req.tokens, req.output]) if len(req.output) else req.tokens
            n = len(seq) // ps - have
            pages = None
            if n > 0:
                try:
                    pages = c.alloc(r, n)
                except CacheFullError:  # longer than what L1 can free now: cache what fits
                    n = min(n, c.device_pool.num_pages - c.tree.locked_device_pages)
                    try:
                        pages = c.alloc(r, n) if n > 0 else None
                    except CacheFullError:
                        pages = None
                    if pages is None:
                        self.commit_skipped += 1
            if pages is not None:
                c.commit(r, seq[: (have + n) * ps], np.concatenate([r.device_indices, pages]))
                committed = (have + n) * ps
        finally:
            c.release(r)
        return Outcome(l1 * ps, l2 * ps, l3 * ps, have * ps, committed, time.perf_counter() - t0)

    def settle(self) -> bool:
        self.cache.flush()
        return True

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats()
        st = s.pop("storage", None)
        if st is not None:
            s["storage"] = {k: v for k, v in vars(st).items() if k != "extra"}
        s["commit_skipped"] = self.commit_skipped
        return s

    def close(self) -> None:
        self.cache.close()


class GrpcTarget(Target):
    """A node over gRPC through :class:`hicache.client.HiCacheClient`: Match, then Prefetch (L3 -> L2 -> L1)
    when L2/L3 continue the prefix, Allocate, Commit, Release -- the calls a serving engine makes."""

    name = "grpc"

    def __init__(self, url: str, timeout_s: float = 30.0, connect_timeout_s: float = 5.0) -> None:
        try:
            import grpc

            from hicache.client import HiCacheClient
        except ImportError as e:
            raise BenchInputError(f"--target {url}: the gRPC client (hicache.client) is not available ({e})") from None
        self._rpc_error = grpc.RpcError
        self._unimplemented = grpc.StatusCode.UNIMPLEMENTED
        self._exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.url = url
        self.client = HiCacheClient(url.removeprefix("grpc://"), timeout_s=timeout_s)
        try:
            self.client.wait_ready(timeout_s=connect_timeout_s)
        except Exception:
            self.client.close()
            raise BenchInputError(f"--target {url}: no node answering there") from None
        info = self.client.pool_info()
        st = self.client.stats()
        self.page_size = info.layout.page_size
        self.l1_tokens = st.l1_pages_total * self.page_size
        self.l2_tokens = st.l2_pages_total * self.page_size
        self.commit_skipped = 0
        self._can_flush = True

    def serve(self, req: TraceRequest) -> Outcome:
        c = self.client
        t0 = time.perf_counter()
        m = c.match(req.tokens)
        ps = m.page_size
        dev = m.device_indices
        l2 = 0  # served from L2: loaded back onto L1 by the Prefetch
        l3 = 0  # served from L3: the node's count of what the prefetch delivered and it loaded back
        committed = 0
        try:
            if m.l2_pages + m.l3_pages:
                try:
                    for p in c.prefetch(m.request_id):
                        if p.done:
                            dev = p.device_indices
                            l2 = served_l2(m.l1_pages, m.l2_pages, len(dev))
                            l3 = p.loaded_l3_pages
                except self._rpc_error as e:  # refused (no room on L1 for the run now): recomputed
                    if e.code() != self._exhausted:
                        raise
            have = len(dev)
            seq = np.concatenate([req.tokens, req.output]) if len(req.output) else req.tokens
            need = len(seq) // ps - have
            if need > 0:
                try:
                    pages = c.allocate(m.request_id, need)
                    c.commit(m.request_id, seq[: (have + need) * ps], np.concatenate([dev, pages]))
                    committed = (have + need) * ps
                except self._rpc_error:
                    self.commit_skipped += 1  # e.g. RESOURCE_EXHAUSTED: everything locked by others
        finally:
            c.release(m.request_id)
        return Outcome(m.l1_pages * ps, l2 * ps, l3 * ps, have * ps, committed, time.perf_counter() - t0)

    def settle(self) -> bool:
        """The node's ``Flush``; a node too old to have it does not settle (UNIMPLEMENTED, asked once)."""
        if self._can_flush:
            try:
                self.client.flush()
            except self._rpc_error as e:
                if e.code() != self._unimplemented:
                    raise
                self._can_flush = False
        return self._can_flush

    def clear(self) -> None:
        self.client.clear()

    def stats(self) -> dict[str, Any]:
        s = vars(self.client.stats()).copy()
        s["commit_skipped"] = self.commit_skipped
        return s

    def close(self) -> None:
        self.client.close()


class RouterTarget(Target):
    """A cluster behind a router: Route, serve on the chosen node (as :class:`GrpcTarget`), Complete.

    Hit rates are those of the nodes the router picked, so they show what cache-aware routing buys
    against, say, ``--target`` on one node or the router's ``round_robin`` policy.
    """

    name = "router"

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        import grpc

        from hicache.client._common import encode_tokens, ns_ref
        from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
        from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc

        self._grpc, self._rpb, self._encode, self._ns_ref = grpc, rpb, encode_tokens, ns_ref
        self.url = url
        self.channel = grpc.insecure_channel(url.removeprefix("grpc://"))
        self.stub = rpb_grpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        nodes = self.stub.ListNodes(rpb.ListNodesRequest(), timeout=timeout_s).nodes
        usable = [n for n in nodes if n.namespace_ok]
        if not usable:
            self.channel.close()
            raise BenchInputError(f"--target {url}: the router has no node serving its namespace")
        self.nodes: dict[str, GrpcTarget] = {}
        first = self._node(usable[0].address)
        self.page_size = first.page_size
        self.l1_tokens = sum(first.l1_tokens for _ in usable)  # nodes are configured alike
        self.l2_tokens = sum(first.l2_tokens for _ in usable)
        self.routed: dict[str, int] = {}

    def _node(self, address: str) -> GrpcTarget:
        t = self.nodes.get(address)
        if t is None:
            try:
                t = GrpcTarget(f"grpc://{address}", self.timeout_s)
            except BenchInputError:
                raise BenchInputError(f"--target {self.url}: the router sent a request to node {address}, where "
                                      "no node answers") from None
            self.nodes[address] = t
        return t

    def serve(self, req: TraceRequest) -> Outcome:
        rpb = self._rpb
        t0 = time.perf_counter()
        d = self.stub.Route(rpb.RouteRequest(namespace=self._ns_ref(""), tokens=self._encode(req.tokens)),
                            timeout=self.timeout_s)
        code = 0
        try:
            out = self._node(d.address).serve(req)
        except self._grpc.RpcError as e:
            code = e.code().value[0]
            raise
        finally:
            self.stub.Complete(rpb.CompleteRequest(route_id=d.route_id, status_code=code), timeout=self.timeout_s)
        self.routed[d.node] = self.routed.get(d.node, 0) + 1
        return out._replace(seconds=time.perf_counter() - t0)

    def settle(self) -> bool:
        """Every node served so far settles."""
        return all([t.settle() for t in self.nodes.values()])

    def clear(self) -> None:
        """Clear every node the router can route to."""
        for n in self.stub.ListNodes(self._rpb.ListNodesRequest(), timeout=self.timeout_s).nodes:
            if n.namespace_ok:
                self._node(n.address).clear()

    def stats(self) -> dict[str, Any]:
        return {"routed": dict(self.routed), "nodes": {a: t.stats() for a, t in self.nodes.items()}}

    def close(self) -> None:
        for t in self.nodes.values():
            t.close()
        self.channel.close()


def grpc_url(url: str) -> str:
    """``grpc://host:port`` checked as ``hicache status`` and ``hicache route`` check addresses
    (:mod:`hicache.client.address`); :class:`BenchInputError` naming ``--target`` otherwise."""
    try:
        host, port = parse_address(url)
    except AddressError as e:
        raise BenchInputError(f"--target {url}: {e} (expected grpc://host:port)") from None
    return f"grpc://{host}:{port}"


def is_router(url: str) -> bool:
    """True when ``url`` answers the router's ListNodes (and so is not a node)."""
    url = grpc_url(url)
    import grpc

    from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
    from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc

    with grpc.insecure_channel(url.removeprefix("grpc://")) as ch:
        try:
            rpb_grpc.RouterStub(ch).ListNodes(rpb.ListNodesRequest(), timeout=5.0, wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BenchInputError(f"--target {url}: nothing answering there") from None
            raise
    return True


def open_target(target: str, config: HiCacheConfig) -> Target:
    """``inproc`` (the default) or ``grpc://host:port`` of a node or a router; :class:`BenchInputError`
    for anything else."""
    if target in ("", "inproc", "in-process"):
        return InProcessTarget(config)
    if target.startswith("grpc://"):
        target = grpc_url(target)
        try:
            import grpc  # noqa: F401
        except ImportError as e:
            raise BenchInputError(f"--target {target}: grpc is not available ({e})") from None
        return RouterTarget(target) if is_router(target) else GrpcTarget(target)
    raise BenchInputError(f"--target: expected 'inproc' or grpc://host:port, got {target!r}")
