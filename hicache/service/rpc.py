"""RPC plumbing shared by the handlers: status mapping, the concurrency bound, timing.

``@unary`` / ``@streaming`` wrap a handler method of a servicer that provides ``_admit(name) -> bool``,
``_done(name, code, t0)`` and ``serve.max_concurrency``: a call beyond the bound ends with
RESOURCE_EXHAUSTED before the handler runs. Release is always admitted (it frees what the bound
protects). Streams that last as long as their client (WatchEvents subscriptions; MatchStream, one per client
for its life) are neither bounded nor counted against it as streams (``UNBOUNDED``): a MatchStream counts
each message while the node handles it, as a Match call (one beyond the bound gets a RESOURCE_EXHAUSTED
reply, and the stream goes on), so idle streams take no room from unary calls; :class:`ServiceError` and
:class:`CacheFullError` become their status codes; anything else is a bug, logged with its traceback and
returned as INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc

from hicache.cache import CacheFullError
from hicache.service.validation import ServiceError

T = TypeVar("T")
Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
log = logging.getLogger("hicache.service")


ALWAYS_ADMITTED = frozenset({"Release"})  # counted against serve.max_concurrency, never refused
UNBOUNDED = frozenset({"WatchEvents", "MatchStream"})  # neither refused nor counted (MatchStream: per message)


def busy_message(limit: int) -> str:
    return f"more than {limit} RPCs in flight (serve.max_concurrency)"


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, ServiceError):
        return e.code, e.message
    if isinstance(e, CacheFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


def unary(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Concurrency bound, status mapping and timing for a unary-response handler."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Ctx) -> T:
        if not self._admit(name):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                busy_message(self.serve.max_concurrency))
        t0 = time.perf_counter()
        code = "OK"
        try:
            return await fn(self, request, context)
        except (ServiceError, CacheFullError) as e:
            c, msg = status_of(e)
            code = c.name
            await context.abort(c, msg)
            raise  # pragma: no cover - abort raises
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as e:  # a bug, not a bad request: say so, and log it with its traceback
            if isinstance(e, grpc.aio.AbortError):
                raise
            log.exception("%s failed", name)
            code = "INTERNAL"
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
            raise  # pragma: no cover - abort raises
        finally:
            self._done(name, code, t0)

    return wrapper


def streaming(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """The same for a server-streaming handler (an async generator)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Ctx) -> AsyncIterator[T]:
        if not self._admit(name):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                busy_message(self.serve.max_concurrency))
        t0 = time.perf_counter()
        code = "OK"
        try:
            async for item in fn(self, request, context):
                yield item
        except (ServiceError, CacheFullError) as e:
            c, msg = status_of(e)
            code = c.name
            await context.abort(c, msg)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as e:  # a bug, not a bad request: say so, and log it with its traceback
            if isinstance(e, grpc.aio.AbortError):
                raise
            log.exception("%s failed", name)
            code = "INTERNAL"
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self._done(name, code, t0)

    return wrapper
