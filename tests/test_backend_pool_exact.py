"""The engine's page and transfer checks at their exact edges, without a model: what a
reservation's load may write (:func:`~gpu_backend.scheduler.write_reservation`), when a decode over
it may start (:func:`~gpu_backend.scheduler.decode_start_error`), which handle may free a page, what
a transfer's manifest and container must agree on (:mod:`gpu_backend.transfer`), and what the
scheduler answers a decode start without a reservation or an abort of a reservation or an export
(docs/design.md invariants 1-5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save as st_save

from gpu_backend import transfer as T
from gpu_backend.errors import InvalidRequestError, RequestAbortedError, StaleHandleError, TransferMismatchError
from gpu_backend.kv_pool import KVPool, PageHandle
from gpu_backend.messages import Abort, AddRequest, LoadPages, Reserve, StartDecode
from gpu_backend.replies import Failed
from gpu_backend.sampling import SamplingParams
from gpu_backend.scheduler import Scheduler, decode_start_error, write_reservation
from gpu_backend.sequence import ExportSequence, PageReservation, RequestTable

PS = 4  # tokens per page
GEOM = (1, 2, PS, 1, 2)  # [layers, 2, page_size, kv_heads, head_dim] of one page


def _pool(pages: int = 6) -> KVPool:
    return KVPool(pages, PS, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")


def _pages(values: list[float]) -> torch.Tensor:
    """Pages ``[len(values), *GEOM]``, page i filled with ``values[i]``."""
    return torch.stack([torch.full(GEOM, v) for v in values]) if values else torch.zeros(0, *GEOM)


def _reservation(pool: KVPool, pages: int, rid: str = "r") -> PageReservation:
    res = PageReservation(rid, pages, emit=lambda _reply: None)
    res.pages = pool.try_alloc(pages, rid)
    return res


def _load(kv: torch.Tensor, num_tokens: int, rid: str = "r") -> LoadPages:
    return LoadPages(rid, kv, num_tokens, reply=lambda _reply: None)


def _start(ctx: int, max_new: int, rid: str = "r") -> StartDecode:
    return StartDecode(rid, [1] * ctx, 1, SamplingParams(max_new_tokens=max_new), ctx, None, lambda _reply: None)


# ---- a load into a reservation -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "num_tokens", "message"),
    [
        ([], 1, "0 pages received, 3 reserved"),
        ([1.0, 2.0, 3.0, 4.0], 13, "4 pages received, 3 reserved"),
        ([1.0, 2.0], 0, f"num_tokens 0 does not fit 2 pages of {PS}"),
        ([1.0, 2.0], 2 * PS + 1, f"num_tokens {2 * PS + 1} does not fit 2 pages of {PS}"),
    ],
)
def test_a_load_that_does_not_fit_its_reservation_writes_nothing(values, num_tokens, message):
    pool = _pool()
    res = _reservation(pool, 3)
    with pytest.raises(ValueError, match=f"^{message}$"):
        write_reservation(pool, res, _load(_pages(values), num_tokens))
    assert res.loaded_tokens == 0
    assert all(pool.page_is_zero(h.index) for h in res.pages)


def test_a_load_of_every_reserved_page_up_to_its_last_slot_writes_page_i_into_handle_i():
    pool = _pool()
    other = _reservation(pool, 2, "other")
    res = _reservation(pool, 3)
    pool.free(other.pages)  # the reservation's pages are 2, 3, 4: not the first of the pool
    assert [h.index for h in res.pages] == [2, 3, 4]
    write_reservation(pool, res, _load(_pages([7.0, 8.0, 9.0]), 3 * PS))
    assert res.loaded_tokens == 3 * PS
    assert torch.equal(pool.read_pages(res.pages), _pages([7.0, 8.0, 9.0]))
    assert [pool.page_is_zero(i) for i in range(6)] == [True, True, False, False, False, True]


# ---- a decode's start over a reservation ---------------------------------------------------------
MAX_REQ_LEN = 10


@pytest.mark.parametrize(
    ("ctx", "max_new", "loaded", "skip", "expect"),
    [
        (1, 1, 1, False, None),  # the shortest context
        (MAX_REQ_LEN - 1, 1, MAX_REQ_LEN - 1, False, None),  # the longest context
        (0, 1, 0, False, (InvalidRequestError, "context_tokens 0 out of range")),
        (MAX_REQ_LEN, 1, MAX_REQ_LEN, False, (InvalidRequestError, f"context_tokens {MAX_REQ_LEN} out of range")),
        # 3 pages of 4 hold 12 positions: context 5 + 8 new tokens write positions 0 .. 11
        (5, 8, 5, False, None),
        (5, 9, 5, False, (InvalidRequestError, "reservation of 12 tokens cannot hold 5 context + 9 new tokens")),
        (
            5,
            1,
            4,
            False,
            (
                TransferMismatchError,
                "decode over 5 context tokens but 4 were loaded into the reservation; nothing is generated",
            ),
        ),
        (5, 1, 4, True, None),  # the skip_transfer_check fault lifts the check (the incident)
    ],
)
def test_a_decode_starts_only_over_the_tokens_loaded_and_within_its_reservation(ctx, max_new, loaded, skip, expect):
    pool = _pool()
    res = _reservation(pool, 3)
    res.loaded_tokens = loaded
    err = decode_start_error(pool, res, _start(ctx, max_new), MAX_REQ_LEN, skip)
    if expect is None:
        assert err is None
    else:
        assert (type(err), str(err), err.request_id) == (expect[0], expect[1], "r")


def test_a_decode_over_a_released_reservation_is_a_stale_handle():
    pool = _pool()
    res = _reservation(pool, 3)
    res.loaded_tokens = 5
    pool.free(res.pages[1:2])
    err = decode_start_error(pool, res, _start(5, 1), MAX_REQ_LEN, False)
    assert type(err) is StaleHandleError
    assert str(err) == "page 1: handle generation 0, page generation 1 (page was released)"


# ---- the pool ----------------------------------------------------------------------------------
def test_a_stale_handle_frees_nobody_s_page():
    """A handle whose page was released and handed to another tenant (without the generation check
    its free released that tenant's page), or one naming a page on the free list: refused, the
    page keeps its owner, generation and data."""
    pool = _pool(2)
    (old,) = pool.try_alloc(1, "a")
    pool.free([old])
    (spare,) = pool.try_alloc(1, "x")  # page 1; page 0 goes to "b" next
    (new,) = pool.try_alloc(1, "b")
    assert (old, new) == (PageHandle(0, 0), PageHandle(0, 1))
    pool.write_pages([new], _pages([3.0]))
    with pytest.raises(StaleHandleError, match=r"^free through handle \(0, 0\): stale \(page generation 1\)$"):
        pool.free([old])
    assert pool.free([old], ignore_stale=True) == 0
    assert (pool.owner[0], pool.generation[0]) == ("b", 1)
    assert torch.equal(pool.read_pages([new]), _pages([3.0]))
    pool.free([spare])
    with pytest.raises(StaleHandleError, match=r"^free through handle \(1, 1\): stale \(page generation 1\)$"):
        pool.free([PageHandle(1, 1)])  # page 1 is on the free list: no handle frees it
    assert pool.free_pages == 1
    pool.check_integrity()


# ---- the transfer's manifest and container -------------------------------------------------------
KV = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 2, PS, 1, 2)  # 2 pages of 4 tokens


def _manifest(**changes) -> T.Manifest:
    m = T.build_manifest(room=0, request_id="r", kv=KV, num_tokens=PS + 1, first_token_id=7, prompt_ids=[1] * 5)
    return dataclasses.replace(m, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"room": -1}, "manifest needs room >= 0, num_tokens >= 1, page_size >= 1"),
        ({"num_tokens": 0, "num_pages": 0}, "manifest needs room >= 0, num_tokens >= 1, page_size >= 1"),
        ({"page_size": 0}, "manifest needs room >= 0, num_tokens >= 1, page_size >= 1"),
        ({"num_tokens": 2 * PS + 1}, f"manifest says 2 pages for {2 * PS + 1} tokens of page size {PS}"),
        ({"num_tokens": PS}, f"manifest says 2 pages for {PS} tokens of page size {PS}"),
        ({"shape": [2, 1, 2, PS, 1]}, "is not [num_pages, layers, 2, page_size, heads, dim]"),
        ({"shape": [3, 1, 2, PS, 1, 2]}, "is not [num_pages, layers, 2, page_size, heads, dim]"),
        ({"shape": [2, 1, 1, PS, 1, 2]}, "is not [num_pages, layers, 2, page_size, heads, dim]"),
        ({"shape": [2, 1, 2, PS + 1, 1, 2]}, "is not [num_pages, layers, 2, page_size, heads, dim]"),
        ({"checksums": ["0" * 32]}, "manifest has 1 checksums for 2 pages"),
        ({"dtype": "I32"}, "manifest dtype 'I32' is not one of F32, F16, BF16"),
        ({"prompt_ids_sha256": "A" * 64}, "must be a SHA-256 hex digest (64 lowercase hex digits)"),
        ({"prompt_ids_sha256": "a" * 63}, "must be a SHA-256 hex digest (64 lowercase hex digits)"),
    ],
)
def test_a_manifest_whose_geometry_does_not_add_up_is_refused(changes, message):
    with pytest.raises(T.TransferFormatError) as e:
        _manifest(**changes).check_geometry()
    assert message in str(e.value)


def test_the_smallest_well_formed_manifest_passes():
    m = _manifest(room=0, num_tokens=1, num_pages=1, page_size=1, shape=[1, 1, 2, 1, 1, 2], checksums=["0" * 32])
    m.check_geometry()
    assert (_manifest().original_prompt_tokens, _manifest(original_prompt_tokens=3).original_prompt_tokens) == (5, 3)


def _payload(kv: torch.Tensor, metadata: dict[str, str]) -> bytes:
    return st_save({"kv": kv}, metadata=metadata)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (_payload(KV, {"other": "x"}), "payload metadata has no 'kvgate.manifest'"),
        (_payload(KV.to(torch.int32), {T.MANIFEST_KEY: _manifest().to_json()}), "tensor 'kv' has an unsupported dtype"),
        (T.encode_transfer(_manifest(), KV) + b"\0" * 4, "tensor 'kv' does not span the payload's data exactly"),
        (_payload(KV[:1], {T.MANIFEST_KEY: _manifest().to_json()}), "tensor 'kv' shape/dtype differ from the manifest"),
        (
            _payload(KV.to(torch.float16), {T.MANIFEST_KEY: _manifest().to_json()}),
            "tensor 'kv' shape/dtype differ from the manifest",
        ),
    ],
)
def test_a_payload_whose_container_disagrees_with_its_manifest_is_refused(payload, message):
    with pytest.raises(T.TransferFormatError) as e:
        T.decode_transfer(payload)
    assert str(e.value) == message


def test_pages_of_another_dtype_than_the_manifest_s_are_refused():
    with pytest.raises(T.TransferFormatError) as e:
        T.verify_pages(_manifest(), KV.to(torch.float16))
    assert str(e.value) == "pages have dtype torch.float16, manifest says F32"


def _padded(header_bytes: int) -> bytes:
    """A well-formed transfer whose safetensors header is padded with spaces to ``header_bytes``."""
    payload = T.encode_transfer(_manifest(), KV)
    n = int.from_bytes(payload[:8], "little")
    header = payload[8 : 8 + n].rstrip(b" ").ljust(header_bytes, b" ")
    return header_bytes.to_bytes(8, "little") + header + payload[8 + n :]


def test_a_header_of_up_to_64_kib_is_read_and_a_longer_one_refused():
    m, kv = T.decode_transfer(_padded(64 * 1024))
    assert (m, torch.equal(kv, KV)) == (_manifest(), True)
    with pytest.raises(T.TransferFormatError, match=r"^payload is not a safetensors file \(bad header length\)"):
        T.decode_transfer(_padded(64 * 1024 + 1))


# ---- the scheduler's answers to a decode start, a reservation's abort and an export's abort ------
def _scheduler(pool: KVPool) -> Scheduler:
    return Scheduler(
        pool,
        max_batch_tokens=64,
        max_running_requests=4,
        pool_wait_timeout_seconds=60.0,
        token_bytes=lambda _t: b"",
        stop_ids=frozenset(),
        requests=RequestTable(),
        max_req_len=MAX_REQ_LEN,
    )


def test_a_decode_start_for_no_reservation_is_a_key_error_and_touches_no_page():
    pool = _pool()
    sched = _scheduler(pool)
    replies: list = []
    sched.mailbox.submit(StartDecode("nope", [1], 1, SamplingParams(max_new_tokens=1), 1, None, replies.append))
    assert sched.schedule() is None
    assert [(type(r), type(r.error), r.error.args) for r in replies] == [(Failed, KeyError, ("nope",))]
    assert pool.free_pages == 6


def test_an_aborted_reservation_and_an_aborted_export_each_hear_a_499_and_free_their_pages():
    pool = _pool()
    sched = _scheduler(pool)
    replies: dict[str, list] = {"res": [], "exp": []}
    res = PageReservation("res", 2, emit=replies["res"].append)
    exp = ExportSequence("exp", [1, 2, 3], SamplingParams(max_new_tokens=1), replies["exp"].append)
    exp.pages_needed = pool.pages_for(3)  # as Engine.admit sets it for an export: the prompt's pages
    for rec in (res, exp):
        sched.requests.add(rec)
    sched.mailbox.submit(Reserve(res))
    sched.mailbox.submit(AddRequest(exp))
    batch = sched.schedule()  # the export is admitted for prefill (its page allocated), not run
    assert [(s.request_id, n) for s, n in batch.items] == [("exp", 3)]
    assert (len(res.pages), len(exp.pages), pool.free_pages) == (2, 1, 3)
    sched.mailbox.submit(Abort("res"))
    sched.mailbox.submit(Abort("exp"))
    sched.schedule()
    for rid, reply in replies.items():
        assert [type(r) for r in reply[-1:]] == [Failed], rid
        err = reply[-1].error
        assert (type(err), err.status, str(err), err.request_id) == (RequestAbortedError, 499, "request aborted", rid)
    assert pool.free_pages == 6 and sched.requests.live == {}
    assert (sched.requests.state("res"), sched.requests.state("exp")) == (None, "aborted")
    pool.check_integrity()
