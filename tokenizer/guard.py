"""Guards around the tokenizer libraries' encode calls: nothing they raise may take a request or a
worker down. tiktoken's Rust core panics with ``pyo3_runtime.PanicException``, a ``BaseException``
that ``except Exception`` does not catch (docs/tokenizer.md, "Tokenizer faults")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from tokenizer.errors import TokenizerError, TokenizerFaultError

T = TypeVar("T")

#: what is never turned into a :class:`TokenizerFaultError`: the process or task is being stopped
PASS_THROUGH: tuple[type[BaseException], ...] = (KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit)


def guarded(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)`` (an encode call). Raises :class:`TokenizerFaultError` (``param``
    ``None``) for anything it raises but :data:`PASS_THROUGH` and :class:`TokenizerError`, which
    pass as they are."""
    try:
        return fn(*args, **kwargs)
    except TokenizerError:
        raise
    except PASS_THROUGH:
        raise
    except BaseException as e:
        name = type(e).__name__
        raise TokenizerFaultError(
            f"The tokenizer failed on this text ({name}); it cannot be counted.", None, cause=name
        ) from None


@contextlib.contextmanager
def fault_param(param: str) -> Iterator[None]:
    """Name ``param`` in a :class:`TokenizerFaultError` raised inside that names no field yet."""
    try:
        yield
    except TokenizerFaultError as e:
        if e.param is None:
            e.param = param
        raise
