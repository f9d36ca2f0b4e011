"""KV pool size at start-up, as SGLang derives it (``ModelRunner.profile_max_num_token``).

    cell_size             = num_layers x 2 (K, V) x num_kv_heads x head_dim x bytes per element
    rest_bytes            = mem_fraction_static x free_memory - weight_bytes
    max_total_num_tokens  = rest_bytes // cell_size, capped by --max-total-tokens,
                            rounded down to a multiple of page_size (SGLang does the same)
    max_req_input_len     = min(context_length - 1, max_total_num_tokens - 1) - 5

``free_memory`` is the device's free memory before the weights were loaded (CUDA:
``torch.cuda.mem_get_info``); on CPU ``mem_budget_bytes`` stands in for it (default
:data:`CPU_DEFAULT_BUDGET_BYTES`); on CUDA, ``mem_budget_bytes`` overrides the measurement.
"""

from __future__ import annotations

import torch

#: Free memory assumed on CPU when ``mem_budget_bytes`` is not given (512 MiB).
CPU_DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024

#: Tokens SGLang keeps back from ``max_req_len`` for the input limit.
SGLANG_INPUT_RESERVE_TOKENS = 5


def free_device_memory(device: torch.device, mem_budget_bytes: int | None) -> int:
    """Bytes the pool sizing starts from (see module doc)."""
    if mem_budget_bytes is not None:
        return int(mem_budget_bytes)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return CPU_DEFAULT_BUDGET_BYTES


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
