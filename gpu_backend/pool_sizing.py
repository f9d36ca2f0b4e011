"""KV pool size at start-up, as SGLang derives it (``ModelRunner.profile_max_num_token``).

    cell_size             = num_layers x 2 (K, V) x num_kv_heads x head_dim x bytes per element
    rest_bytes            = mem_fraction_static x free_memory - weight_bytes
    max_total_num_tokens  = rest_bytes // cell_size, capped by --max-total-tokens,
                            rounded down to a multiple of page_size (SGLang does the same)
    max_req_input_len     = min(context_length - 1, max_total_num_tokens - 1) - 5

``free_memory`` is the device's free memory before the weights were loaded (CUDA:
``torch.cuda.mem_get_info``). On CPU it is the memory the OS reports available (``MemAvailable``
of ``/proc/meminfo``, else ``os.sysconf``), capped at :data:`CPU_BUDGET_CAP_BYTES` (4 GiB) so one
engine on a shared host never claims the whole machine; the cap also bounds a pool sized with no
token cap at all. ``mem_budget_bytes`` replaces the measurement on either device.
:func:`describe` gives the start-up log line that says how the pool got its size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

#: On CPU, the most memory the pool sizing starts from when ``mem_budget_bytes`` is not given (4 GiB).
CPU_BUDGET_CAP_BYTES = 4 * 1024**3
#: Kept for callers of the first release: the old fixed CPU budget (512 MiB); no longer the default.
CPU_DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024


def cpu_available_bytes() -> int:
    """Memory the OS says can be allocated without swapping (``MemAvailable``), else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return CPU_DEFAULT_BUDGET_BYTES


def memory_source(device: torch.device, mem_budget_bytes: int | None) -> tuple[int, str]:
    """``(bytes the sizing starts from, where that number comes from)`` (see module doc)."""
    if mem_budget_bytes is not None:
        return int(mem_budget_bytes), "--mem-budget-bytes"
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "free device memory (torch.cuda.mem_get_info)"
    avail = cpu_available_bytes()
    if avail > CPU_BUDGET_CAP_BYTES:
        return CPU_BUDGET_CAP_BYTES, f"CPU cap {_gib(CPU_BUDGET_CAP_BYTES)} (available {_gib(avail)})"
    return avail, f"available CPU memory {_gib(avail)} (cap {_gib(CPU_BUDGET_CAP_BYTES)})"


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def describe(
    tokens: int,
    free_bytes: int,
    source: str,
    weight_bytes: int,
    cell_bytes: int,
    mem_fraction_static: float,
    max_total_tokens: int | None,
) -> str:
    """One start-up log line: the pool size and why it is that size (memory or the token cap)."""
    from_memory = max(0, int(mem_fraction_static * free_bytes) - weight_bytes) // cell_bytes
    why = (
        f"capped by max_total_tokens {max_total_tokens}"
        if max_total_tokens is not None and max_total_tokens < from_memory
        else "all the memory allows"
    )
    return (
        f"KV pool {tokens} tokens ({tokens * cell_bytes / 1024**2:.0f} MiB, {cell_bytes} B per token): {why}; "
        f"memory would allow {from_memory} = ({mem_fraction_static} x {free_bytes / 1024**2:.0f} MiB [{source}] "
        f"- {weight_bytes / 1024**2:.0f} MiB weights) / {cell_bytes} B"
    )


#: Tokens SGLang keeps back from ``max_req_len`` for the input limit.
SGLANG_INPUT_RESERVE_TOKENS = 5


def free_device_memory(device: torch.device, mem_budget_bytes: int | None) -> int:
    """Bytes the pool sizing starts from (see module doc and :func:`memory_source`)."""
    return memory_source(device, mem_budget_bytes)[0]


def kv_cell_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take over all layers (SGLang's ``cell_size``)."""
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def max_total_num_tokens(
    free_bytes: int,
    weight_bytes: int,
    cell_bytes: int,
    mem_fraction_static: float,
    page_size: int,
    max_total_tokens: int | None,
) -> int:
    """Pool size in tokens (a multiple of ``page_size``). Raises ``ValueError`` when less than one
    page fits (SGLang: "Not enough memory")."""
    rest = int(mem_fraction_static * free_bytes) - weight_bytes
    tokens = max(0, rest) // cell_bytes
    if max_total_tokens is not None:
        tokens = min(tokens, int(max_total_tokens))
    tokens = tokens // page_size * page_size
    if tokens < page_size:
        raise ValueError(
            f"not enough memory for the KV pool: {mem_fraction_static} x {free_bytes} B free - {weight_bytes} B "
            f"of weights leaves {rest} B, less than one page ({page_size} x {cell_bytes} B); "
            f"raise mem_budget_bytes / mem_fraction_static"
        )
    return tokens


def max_req_input_len(context_length: int, max_total_num_tokens: int) -> int:
    """SGLang: ``max_req_len = min(context_len - 1, max_total_num_tokens - 1)``;
    ``max_req_input_len = max_req_len - 5``."""
    return min(context_length - 1, max_total_num_tokens - 1) - SGLANG_INPUT_RESERVE_TOKENS


def pool_limits(
    free_bytes: int,
    weight_bytes: int,
    cell_bytes: int,
    mem_fraction_static: float,
    page_size: int,
    max_total_tokens: int | None,
    context_length: int,
) -> tuple[int, int, int]:
    """``(max_total_num_tokens, max_req_len, max_req_input_len)`` of one engine (SGLang's rules
    above). ``ValueError`` when less than one page fits or no prompt fits the pool."""
    total = max_total_num_tokens(free_bytes, weight_bytes, cell_bytes, mem_fraction_static, page_size, max_total_tokens)
    max_input = max_req_input_len(context_length, total)
    if max_input < 1:
        raise ValueError(f"pool of {total} tokens leaves no room for a prompt")
    return total, min(context_length - 1, total - 1), max_input


@dataclass(frozen=True)
class PoolSize:
    """One engine's pool as sized at start-up: ``max_total_num_tokens`` (pool tokens, a multiple of
    the page size), SGLang's ``max_req_len`` / ``max_req_input_len`` (tokens), and ``explanation``
    (the start-up line of :func:`describe`)."""

    max_total_num_tokens: int
    max_req_len: int
    max_req_input_len: int
    explanation: str


def size_pool(
    device: torch.device,
    mem_budget_bytes: int | None,
    weight_bytes: int,
    cell_bytes: int,
    mem_fraction_static: float,
    page_size: int,
    max_total_tokens: int | None,
    context_length: int,
) -> PoolSize:
    """Measure free memory (:func:`memory_source`), apply :func:`pool_limits` and say why
    (:func:`describe`). ``ValueError`` as :func:`pool_limits`."""
    free_bytes, free_source = memory_source(device, mem_budget_bytes)
    total, max_req_len, max_input = pool_limits(
        free_bytes, weight_bytes, cell_bytes, mem_fraction_static, page_size, max_total_tokens, context_length
    )
    why = describe(total, free_bytes, free_source, weight_bytes, cell_bytes, mem_fraction_static, max_total_tokens)
    return PoolSize(total, max_req_len, max_input, why)
