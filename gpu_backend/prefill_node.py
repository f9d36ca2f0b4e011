"""The prefill node: admits or rejects a prompt, runs the forward pass, and sends the written pages
with a manifest to the decode node (in process, or over HTTP as safetensors).

The role's flow on its engine is :func:`prefill_export`: admission (:meth:`Engine.admit`) retires a
prompt over ``max_req_input_len`` with :class:`PromptTooLongError` before any page, bootstrap or
transfer (docs/design.md invariant 1), and the router answers the 400. Only the ``admit_rejected`` fault
(test use) lets it through as a one-token placeholder, which is then sent as one page, as in the
incident. The forward pass, the copy of the written pages and their release run on the engine's
worker thread; the node then hashes, serialises and sends them. The manifest's ``prompt_ids_sha256``
is the digest of the ids the engine admitted and ran the forward pass over (the sequence's own copy,
the placeholder included), not of the request body, so decode can refuse pages of another prompt
(invariant 2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol

import httpx
import torch

from gpu_backend.bridge import future_setter, one_reply
from gpu_backend.engine import Engine
from gpu_backend.errors import PromptTooLongError, RequestAbortedError
from gpu_backend.messages import AddRequest
from gpu_backend.node_errors import remote_error
from gpu_backend.replies import Exported, Failed, Reply, unexpected
from gpu_backend.router import post_retrying
from gpu_backend.sampling import SamplingParams, sampling_params
from gpu_backend.transfer import CONTENT_TYPE, Manifest, build_manifest, encode_transfer
from gpu_backend.wire import PrefillOutcome, engine_request_id

log = logging.getLogger("gpu_backend.prefill")

#: Above this many bytes of KV, hashing and serialising run in a worker thread.
_OFFLOAD_BYTES = 256 * 1024

#: Seconds an abort is remembered, so a prefill call that arrives after its abort is refused.
_ABORT_MEMORY_SECONDS = 300.0


async def prefill_export(
    engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None
) -> tuple[torch.Tensor, PrefillOutcome]:
    """:func:`prefill_export_ran` without the ids: ``(kv, outcome)``."""
    kv, outcome, _ = await prefill_export_ran(engine, request_id, prompt_ids, params)
    return kv, outcome


async def prefill_export_ran(
    engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None
) -> tuple[torch.Tensor, PrefillOutcome, list[int]]:
    """Admit, prefill, copy the written pages out and free them; returns ``(kv, outcome, ran_ids)``,
    ``ran_ids`` the token ids the forward pass ran over (the admitted sequence's prompt).

    ``kv``: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], contiguous, CPU, the pool
    dtype; positions past ``outcome.num_tokens`` in the last page are zeros. Admission as
    :meth:`Engine.admit`: :class:`PromptTooLongError` unless the engine's ``admit_rejected`` fault is
    on (then the placeholder ``[0]``). ``params`` (default greedy) picks the first token. Waits for
    pages (:class:`PoolExhaustedError` after the timeout). Cancelling the await aborts the request.
    """
    fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
    params = dataclasses.replace(params or SamplingParams(max_new_tokens=1), max_new_tokens=1)
    seq = engine.admit(request_id, prompt_ids, params, future_setter(fut), export=True)
    engine.submit(AddRequest(seq))
    match await one_reply(fut, lambda: engine.abort(request_id, seq)):
        case Exported(kv=kv, outcome=outcome):
            return kv, outcome, list(seq.prompt_ids)
        case Failed(error=error):
            raise error
        case other:
            engine.abort(request_id, seq)
            raise unexpected(other)


class TransferSink(Protocol):
    """Where prefill sends pages: a decode node in process or over HTTP."""

    async def send(self, manifest: Manifest, kv: torch.Tensor) -> None:
        """Deliver the pages; raises the decode node's error when it refuses them."""


class LocalSink:
    """In-process transfer (``--role all``): hands manifest + tensor to the decode node."""

    def __init__(self, decode_node: Any) -> None:
        self.decode_node = decode_node

    async def send(self, manifest: Manifest, kv: torch.Tensor) -> None:
        await self.decode_node.accept_transfer(manifest, kv)


class HttpSink:
    """Transfer over HTTP: ``POST {decode_url}/disagg/transfer`` with the safetensors payload of
    :func:`gpu_backend.transfer.encode_transfer` (content type :data:`CONTENT_TYPE`); sent once more
    after a lost connection (the decode node accepts the same manifest twice idempotently)."""

    def __init__(self, decode_url: str, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        self.url = decode_url.rstrip("/") + "/disagg/transfer"
        self.client = client
        self.timeout = timeout_seconds

    async def send(self, manifest: Manifest, kv: torch.Tensor) -> None:
        big = kv.numel() * kv.element_size() > _OFFLOAD_BYTES
        payload = await asyncio.to_thread(encode_transfer, manifest, kv) if big else encode_transfer(manifest, kv)
        r = await post_retrying(
            self.client, self.url, content=payload, headers={"content-type": CONTENT_TYPE}, timeout=self.timeout
        )
        if r.status_code != 200:
            try:
                body = r.json()
            except ValueError:
                body = None
            raise remote_error(r.status_code, body)


class PrefillNode:
    """Wraps a prefill-side :class:`Engine` and a :class:`TransferSink`.

    ``transfer_timeout_seconds`` plus the engine's ``pool_wait_timeout_seconds`` bounds the send
    (the decode node may first wait for pages to reserve).
    ``abort(engine_id)`` stops a request at any point: during the forward pass the engine frees
    its pages; afterwards the pages are already freed and the transfer is not sent. Requests are
    known by their engine-side id (:func:`engine_request_id` of client id and room), never by the
    client's id alone, so requests sharing a client id never affect each other.
    """

    def __init__(self, engine: Engine, sink: TransferSink, *, transfer_timeout_seconds: float = 30.0) -> None:
        self.engine = engine
        self.sink = sink
        self.transfer_timeout = transfer_timeout_seconds
        self._aborted: dict[str, float] = {}  # engine id -> monotonic time of its abort
        self._by_room: dict[int, tuple[float, asyncio.Future]] = {}
        self.counters = {"prefilled": 0, "rejected": 0, "placeholders": 0, "aborted": 0}

    def server_info(self) -> dict[str, Any]:
        """The engine's SGLang fields with ``disaggregation_mode`` ``"prefill"``."""
        info = dict(self.engine.server_info())
        info["disaggregation_mode"] = "prefill"
        return info

    def _was_aborted(self, engine_id: str) -> bool:
        """Whether ``engine_id`` was aborted in the last :data:`_ABORT_MEMORY_SECONDS` (older marks are dropped)."""
        now = time.monotonic()
        for k in [k for k, t in self._aborted.items() if now - t > _ABORT_MEMORY_SECONDS]:
            del self._aborted[k]
        return engine_id in self._aborted

    async def prefill(
        self,
        room: int,
        request_id: str,
        prompt_ids: list[int],
        *,
        param: str = "prompt",
        params: dict[str, Any] | None = None,
    ) -> PrefillOutcome:
        """Admit + prefill + send; returns the :class:`PrefillOutcome`. Raises :class:`PromptTooLongError` (400,
        ``param`` as given: ``prompt`` or ``messages``), :class:`InvalidRequestError` (400, bad
        ``params``), :class:`PoolExhaustedError` (503), :class:`RequestAbortedError` (499: this
        room's request was aborted), or the decode node's refusal. ``request_id`` is the client's id
        (messages, manifest); the engine-side id is :func:`engine_request_id` ``(request_id, room)``.
        ``params``: the request's sampling dict (the router's), which picks the first token as the
        engine core would (default greedy).

        Idempotent per room: a repeated call for a room (the router retrying after a lost
        connection) gets the first call's outcome; the work runs once. Cancelling the caller does
        not cancel the work (the router aborts explicitly; pages are freed either way)."""
        now = time.monotonic()
        for k in [k for k, (t, f) in self._by_room.items() if f.done() and now - t > 30]:
            del self._by_room[k]
        entry = self._by_room.get(room)
        if entry is None:
            fut = asyncio.ensure_future(self._prefill(room, request_id, prompt_ids, param, params))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            entry = self._by_room[room] = (now, fut)
        return await asyncio.shield(entry[1])

    async def _prefill(
        self, room: int, request_id: str, prompt_ids: list[int], param: str, params: dict[str, Any] | None
    ) -> PrefillOutcome:
        rid = engine_request_id(request_id, room)
        if self._was_aborted(rid):
            raise RequestAbortedError(f"request {request_id} was aborted")
        sp = None if params is None else sampling_params(params)
        try:
            kv, res, ran_ids = await prefill_export_ran(self.engine, rid, prompt_ids, sp)
        except PromptTooLongError as e:
            self.counters["rejected"] += 1
            raise PromptTooLongError(e.prompt_tokens, e.max_req_input_len, request_id=request_id, param=param) from None
        if self._was_aborted(rid):
            self.counters["aborted"] += 1
            raise RequestAbortedError(f"request {request_id} was aborted")
        self.counters["prefilled"] += 1
        self.counters["placeholders"] += int(res.placeholder)
        kw = dict(room=room, request_id=request_id, kv=kv, prompt_ids=ran_ids, **res.to_json())
        big = kv.numel() * kv.element_size() > _OFFLOAD_BYTES
        manifest = await asyncio.to_thread(lambda: build_manifest(**kw)) if big else build_manifest(**kw)
        await asyncio.wait_for(
            self.sink.send(manifest, kv), self.transfer_timeout + float(self.engine.cfg.pool_wait_timeout_seconds)
        )
        return res

    def abort(self, engine_id: str) -> None:
        """Abort the request with engine-side id ``engine_id`` (:func:`engine_request_id`; what
        ``/disagg/abort`` carries as ``request_id``). Idempotent; also before it arrives: that room's
        prefill is then refused (499) for :data:`_ABORT_MEMORY_SECONDS`. A bare client id matches
        no request."""
        self._aborted[engine_id] = time.monotonic()
        self.engine.abort(engine_id)  # unknown (not yet admitted, or retired) ids are ignored
