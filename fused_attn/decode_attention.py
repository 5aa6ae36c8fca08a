"""``decode_attention``: new queries attending over a KV cache, with the append fused in.

The decode step of a transformer: each sequence's few new queries (1 for plain decoding, up to
~16 for speculative or chunked decoding) attend over its cached keys and values, after this
step's keys and values are written into the cache. Public wrapper, argument validation, the fake
(meta) kernels and the CPU path (``fused_attn.reference.decode_attention``, in float32). The CUDA
kernel is in ``csrc/decode_attention/`` (split-KV "flash-decoding": the key range of a sequence is
split over several blocks whose partial results are merged with the log-sum-exp rule).

Gradients: none. The op writes into the cache and is meant for inference; when an input requires
grad it raises (``fused_attn.reference.decode_attention`` is the differentiable definition).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from fused_attn import _ops, reference
from fused_attn.softmax import _check_dims, _check_is_tensor, _check_out, _scale_value, _shape

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CPU_DTYPES = _DTYPES + (torch.float64,)
MAX_SPLITS = 256
MAX_HEADDIM = 256
# Page sizes of a paged cache (block_table): powers of two, so the kernel's slot -> page split is a shift.
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 256
# New tokens per sequence (seqlen_new, max_seqlen_q): the launcher's bound on the grid's rows.
MAX_SEQLEN_Q = 1 << 20
# FUSED_ATTN_VALIDATE_LENGTHS=1 turns validate=None into validate=True (reads device lengths: a sync).
VALIDATE_ENV = "FUSED_ATTN_VALIDATE_LENGTHS"


def _check_tensor(t, name: str, dims: str) -> None:
    _check_is_tensor(t, name)
    _check_dims(t, name, dims)


def _has_data(t: torch.Tensor) -> bool:
    """A real tensor (not a fake / meta one from torch.compile's tracing, whose base address and
    possibly symbolic strides the alignment rule cannot be checked on; the launcher checks it at run time)."""
    return not torch.compiler.is_compiling() and t.device.type != "meta" and not isinstance(
        t, torch._subclasses.fake_tensor.FakeTensor)


def _strides_aligned(t: torch.Tensor) -> bool:
    """The last dim contiguous and every other stride a multiple of 16 bytes."""
    vec = 16 // t.element_size()
    return (t.stride(-1) == 1 or t.size(-1) == 1) and all(
        s % vec == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte vector loads: the strides (``_strides_aligned``) and the base 16-byte aligned."""
    return t.numel() == 0 or (_strides_aligned(t) and t.data_ptr() % 16 == 0)


def _readable(t: torch.Tensor) -> bool:
    """``_aligned`` for a tensor that may have no address (torch.compile's tracing): there the storage
    offset stands in for the base (a buffer's base is 16-byte aligned)."""
    if _has_data(t):
        return _aligned(t)
    if torch.compiler.is_compiling():
        # Dynamo cannot trace storage_offset() (a graph break: transformers' compiled decode step then
        # splits at every attention and recompiles per layer). The launcher checks the base when it runs.
        return _strides_aligned(t)
    return t.storage_offset() % (16 // t.element_size()) == 0 and _strides_aligned(t)


def _check_aligned(t: torch.Tensor, name: str) -> None:
    """The kernel's rule for the tensors it writes (caches, out): raised, never copied."""
    if _has_data(t) and not _aligned(t):
        raise ValueError(f"{name} must have a contiguous last dim and 16-byte aligned rows "
                         f"(other strides multiples of {16 // t.element_size()}), got strides {t.stride()}")


def _aligned_copy(t):
    """The cheap fix for a small CUDA input (q, k_new, v_new) the kernel cannot read with 16-byte
    loads: one copy into a new, aligned buffer (``contiguous()`` would keep a misaligned base)."""
    if isinstance(t, torch.Tensor) and t.device.type == "cuda" and _has_data(t) and not _aligned(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def max_len_of(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The logical slots per sequence: the cache's dim 2, or max_blocks x page_size for a page pool."""
    return k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2]


def _check_on_q(t, name: str, kind: str, q: torch.Tensor, dtype: torch.dtype = torch.int32,
                dtype_text: str | None = None) -> None:
    """t is a dtype tensor on q's device (block_table, cu_seqlens_q, the lengths, key_mask); kind: what the
    TypeError says t must be; dtype_text: the dtype as the message names it (default: the dtype)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be {kind}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype_text or dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")


def _check_block_table(block_table, q: torch.Tensor, k_cache: torch.Tensor, batch: int) -> None:
    _check_on_q(block_table, "block_table", "a torch.Tensor or None", q)
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, max_blocks) = ({batch}, max_blocks), "
                         f"got {_shape(block_table)}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have a contiguous last dim (stride 1), got strides {block_table.stride()}")
    page_size = k_cache.shape[2]
    if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"k_cache must have a page_size (dim 2) that is a power of two in [{MIN_PAGE_SIZE}, "
                         f"{MAX_PAGE_SIZE}] with block_table, got {_shape(k_cache)}")
    if block_table.shape[1] * page_size >= 2**31:
        raise ValueError(f"block_table must have max_blocks x page_size below 2**31, got "
                         f"{block_table.shape[1]} x {page_size}")


def _check_page_strides(pool: torch.Tensor, name: str) -> None:
    """The CUDA kernels address a page pool's rows from its page and row strides in bytes as 32-bit values (a
    pool of one page never uses its page stride)."""
    size = pool.element_size()
    if (pool.shape[0] > 1 and pool.stride(0) * size >= 2**32) or pool.stride(2) * size >= 2**32:
        raise ValueError(f"{name} must have page (dim 0, when num_pages > 1) and row (dim 2) strides below 2**32 "
                         f"bytes with block_table, got strides {pool.stride()}")


def batch_of(q: torch.Tensor, k_cache, block_table, ragged: bool) -> int:
    """The batch size: q's dim 0, or with cu_seqlens_q (q packed) the cache's: block_table's rows for a
    paged cache, else k_cache's dim 0 (0 where that argument is malformed: check_args names it)."""
    if not ragged:
        return q.shape[0]
    src = block_table if block_table is not None else k_cache
    return src.shape[0] if isinstance(src, torch.Tensor) and src.dim() > 0 else 0


def _check_offsets_tensor(cu_seqlens_q, q: torch.Tensor, batch: int) -> None:
    """cu_seqlens_q as the op takes it: int32 [batch + 1] on q's device, contiguous (values not read)."""
    _check_on_q(cu_seqlens_q, "cu_seqlens_q", "a torch.Tensor", q)
    if tuple(cu_seqlens_q.shape) != (batch + 1,):
        raise ValueError(f"cu_seqlens_q must have shape (batch + 1,) = ({batch + 1},), got {_shape(cu_seqlens_q)}")
    if cu_seqlens_q.stride(0) != 1 and batch > 0:
        raise ValueError(f"cu_seqlens_q must be contiguous, got strides {cu_seqlens_q.stride()}")


def check_offsets(cu: list[int], total_q: int) -> list[int]:
    """Host-known cu_seqlens_q: starts at 0, non-decreasing, ends at total_q. Returns each sequence's
    new tokens n_b = cu[b + 1] - cu[b]. (On the device, offsets breaking this give the sequence no
    append and NaN outputs in the rows it can be given safely, none if its offsets leave [0, total_q].)"""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu[b]} then {cu[b + 1]} at batch index {b}")
    if cu[-1] != total_q:
        raise ValueError(f"cu_seqlens_q must end at q's total_q ({total_q}), got {cu[-1]}")
    return [hi - lo for lo, hi in zip(cu[:-1], cu[1:])]


def check_max_seqlen_q(max_seqlen_q: int, new: list[int]) -> None:
    longest = max(new, default=0)
    if max_seqlen_q < longest:
        raise ValueError(f"max_seqlen_q must be at least the longest sequence's new tokens ({longest}), "
                         f"got {max_seqlen_q}")


def _as_offsets(values, q: torch.Tensor, batch: int) -> tuple[torch.Tensor | None, list[int] | None]:
    """cu_seqlens_q as ``(device tensor, host values or None)``, as ``_as_lengths`` for the lengths: host
    values (a sequence of ints, a CPU tensor) are checked here (check_offsets) and copied to q's device."""
    if values is None:
        return None, None
    if isinstance(values, torch.Tensor):
        if _used_as_it_is(values, "cu_seqlens_q", q):
            return values, None
        if tuple(values.shape) != (batch + 1,):
            raise ValueError(f"cu_seqlens_q must have shape (batch + 1,) = ({batch + 1},), got {_shape(values)}")
        host = values.tolist()
    elif isinstance(values, Sequence) and not isinstance(values, str) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        host = list(values)
        if len(host) != batch + 1:
            raise ValueError(f"cu_seqlens_q must have shape (batch + 1,) = ({batch + 1},), got ({len(host)},)")
    else:
        raise TypeError(f"cu_seqlens_q must be a sequence of ints or a tensor, got {type(values).__name__}")
    check_offsets(host, q.shape[0])
    return torch.tensor(host, dtype=torch.int32).to(q.device), host


def _max_seqlen_q(max_seqlen_q, cu_given: bool, new: list[int] | None) -> int:
    """The op's max_seqlen_q: 0 without cu_seqlens_q; the given one (at least every host-known n_b), or
    the longest n_b of host-known offsets."""
    if not cu_given:
        if max_seqlen_q is not None:
            raise ValueError(f"max_seqlen_q must be None without cu_seqlens_q, got {max_seqlen_q!r}")
        return 0
    if max_seqlen_q is None:
        if new is None:
            raise ValueError("max_seqlen_q must be given with a device cu_seqlens_q (it sizes the grid), got None")
        return max(new, default=0)
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or not 0 <= max_seqlen_q < MAX_SEQLEN_Q:
        raise ValueError(f"max_seqlen_q must be an int in [0, 2**20) with cu_seqlens_q, got {max_seqlen_q!r}")
    if new is not None:
        check_max_seqlen_q(max_seqlen_q, new)
    return max_seqlen_q


def check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, num_splits,
               out=None, block_table=None, cu_seqlens_q=None, max_seqlen_q=0) -> float:
    """Raise TypeError / ValueError naming the bad argument (the C++ launcher repeats the checks that
    guard memory); return the scale as a float (default ``headdim ** -0.5``). ``cache_seqlens``,
    ``cache_leftpad`` and ``cu_seqlens_q`` are the op's tensors here (int32, on q's device); lengths and
    offsets are not read."""
    ragged = cu_seqlens_q is not None
    _check_tensor(q, "q", "[total_q, nheads_q, headdim]" if ragged else "[batch, nheads_q, seqlen_new, headdim]")
    cache_dims = "[batch, nheads_kv, max_len, headdim]" if block_table is None else \
        "[num_pages, nheads_kv, page_size, headdim]"
    _check_tensor(k_cache, "k_cache", cache_dims)
    _check_tensor(v_cache, "v_cache", cache_dims)
    cpu = q.device.type == "cpu"
    allowed = _CPU_DTYPES if cpu else _DTYPES
    if q.dtype not in allowed:
        names = "float32, float16, bfloat16 or float64 (CPU)" if cpu else "float32, float16 or bfloat16"
        raise ValueError(f"q must have dtype {names}, got {q.dtype}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype ({q.dtype}), got {t.dtype}")
    if ragged:
        # packed: the rows of every sequence's new tokens one after the other; batch is the cache's
        total_q, nheads_q, headdim = q.shape
        batch = batch_of(q, k_cache, block_table, ragged)
    else:
        batch, nheads_q, seqlen_new, headdim = q.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {_shape(k_cache)}, got {_shape(v_cache)}")
    if block_table is not None:
        _check_block_table(block_table, q, k_cache, batch)
        _check_page_strides(k_cache, "k_cache")
        _check_page_strides(v_cache, "v_cache")
    elif k_cache.shape[0] != batch:
        raise ValueError(f"k_cache must have q's batch size ({batch}), got {_shape(k_cache)}")
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache must have q's headdim ({headdim}), got {_shape(k_cache)}")
    nheads_kv = k_cache.shape[1]
    if nheads_kv == 0 or nheads_q % nheads_kv != 0:
        raise ValueError(f"q must have nheads_q a multiple of k_cache's nheads_kv ({nheads_kv}), got {nheads_q}")
    if not cpu and (headdim % 8 != 0 or not 8 <= headdim <= MAX_HEADDIM):
        raise ValueError(f"q must have a headdim that is a multiple of 8 in [8, {MAX_HEADDIM}] on CUDA, got {headdim}")
    if (k_new is None) != (v_new is None):
        raise ValueError(f"k_new and v_new must both be given or both be None, got "
                         f"k_new={'a tensor' if k_new is not None else None}, "
                         f"v_new={'a tensor' if v_new is not None else None}")
    if k_new is not None:
        want = (total_q, nheads_kv, headdim) if ragged else (batch, nheads_kv, seqlen_new, headdim)
        layout = "[total_q, nheads_kv, headdim]" if ragged else "[batch, nheads_kv, seqlen_new, headdim]"
        for t, name in ((k_new, "k_new"), (v_new, "v_new")):
            _check_tensor(t, name, layout)
            if t.device != q.device:
                raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
            if t.dtype != q.dtype:
                raise ValueError(f"{name} must have q's dtype ({q.dtype}), got {t.dtype}")
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape ({layout[1:-1]}) = {want}, got {_shape(t)}")
    if cache_seqlens is None and k_new is not None:
        raise ValueError("cache_seqlens must be given when appending (k_new), got None")
    for t, name in ((cache_seqlens, "cache_seqlens"), (cache_leftpad, "cache_leftpad")):
        if t is None:
            continue
        _check_on_q(t, name, "a torch.Tensor", q)
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {_shape(t)}")
    if key_mask is not None:
        _check_on_q(key_mask, "key_mask", "a torch.Tensor or None", q, torch.bool, "torch.bool (True = attend)")
        max_len = max_len_of(k_cache, block_table)
        if key_mask.dim() != 2 or key_mask.shape[0] not in (1, batch) or key_mask.shape[1] != max_len:
            raise ValueError(f"key_mask must have shape (batch or 1, max_len) = ({batch} or 1, {max_len}), "
                             f"got {_shape(key_mask)}")
        if key_mask.shape[1] > 1 and key_mask.stride(1) != 1:
            raise ValueError(f"key_mask must have a contiguous last dim (stride 1), got strides {key_mask.stride()}")
    if ragged:
        _check_offsets_tensor(cu_seqlens_q, q, batch)
        if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or not 0 <= max_seqlen_q < MAX_SEQLEN_Q:
            raise ValueError(f"max_seqlen_q must be an int in [0, 2**20) with cu_seqlens_q, got {max_seqlen_q!r}")
    elif max_seqlen_q != 0:
        raise ValueError(f"max_seqlen_q must be 0 (unused) without cu_seqlens_q, got {max_seqlen_q!r}")
    scale = headdim ** -0.5 if scale is None else _scale_value(scale)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0: chosen by the heuristic), "
                         f"got {num_splits!r}")
    if not cpu:
        _check_aligned(k_cache, "k_cache")
        _check_aligned(v_cache, "v_cache")
    if out is not None:
        _check_out(out, q, "q")
        if not cpu:
            _check_aligned(out, "out")
    return float(scale)


def _used_as_it_is(values: torch.Tensor, name: str, q: torch.Tensor) -> bool:
    """Whether the lengths or offsets tensor ``values`` goes to the op as it is (on q's device); otherwise
    (False) it is a host tensor of an integer dtype, which the caller reads (ValueError naming ``name`` for
    any other device or dtype)."""
    # Under torch.compile a CPU tensor is not read on the host either (a data-dependent
    # read breaks the graph): the CPU kernel checks the values when it runs.
    if values.device == q.device and (q.device.type != "cpu" or torch.compiler.is_compiling()):
        return True
    if values.device.type != "cpu":
        raise ValueError(f"{name} must be on q's device ({q.device}) or the CPU, got {values.device}")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype (torch.int32 on the device), got {values.dtype}")
    return False


def _as_lengths(values, name: str, q: torch.Tensor, batch: int) -> tuple[torch.Tensor | None, list[int] | None]:
    """``(device tensor, host values or None)``: ints, sequences and CPU tensors are host-known (checked
    here, then copied to q's device); a tensor on q's device is used as it is (int32)."""
    if values is None:
        return None, None
    if isinstance(values, torch.Tensor):
        if _used_as_it_is(values, name, q):
            return values, None
        if tuple(values.shape) not in ((batch,), ()):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {_shape(values)}")
        host = values.expand(batch).tolist()
    elif isinstance(values, bool):
        raise TypeError(f"{name} must be an int, a sequence of ints or a tensor, got {values!r}")
    elif isinstance(values, int):
        host = [values] * batch
    elif isinstance(values, Sequence) and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        host = list(values)
        if len(host) != batch:
            raise ValueError(f"{name} must have one length per sequence ({batch}), got {len(host)}")
    else:
        raise TypeError(f"{name} must be an int, a sequence of ints or a tensor, got {type(values).__name__}")
    return torch.tensor(host, dtype=torch.int32).to(q.device), host


def check_lengths(seqlens: list[int], leftpad: list[int] | None, seqlen_new: int | list[int], max_len: int,
                  appended: bool) -> None:
    """The lengths the kernel accepts: 0 <= cache_seqlens[b] <= max_len - (seqlen_new if appending),
    0 <= cache_leftpad[b] <= cache_seqlens[b]; seqlen_new is one count for every sequence or (ragged)
    each sequence's n_b. (On the device, a sequence outside these bounds gets NaN outputs and no append:
    the kernel never writes or reads past max_len.)"""
    for b, n in enumerate(seqlens):
        sn = seqlen_new if isinstance(seqlen_new, int) else seqlen_new[b]
        if not 0 <= n <= max_len - (sn if appended else 0):
            what = f"max_len = {max_len}" if not appended else f"max_len - seqlen_new = {max_len} - {sn}" \
                if isinstance(seqlen_new, int) else f"max_len - n_b = {max_len} - {sn}"
            raise ValueError(f"cache_seqlens must be in [0, {what}] for every sequence, got {n} at batch index {b}")
    for b, p in enumerate(leftpad or ()):
        if not 0 <= p <= seqlens[b]:
            raise ValueError(f"cache_leftpad must be in [0, cache_seqlens[b]] for every sequence, got {p} at "
                             f"batch index {b} (cache_seqlens {seqlens[b]})")


def check_pages(table: list[list[int]], seqlens: list[int], leftpad: list[int] | None, seqlen_new: int | list[int],
                page_size: int, num_pages: int, appended: bool) -> None:
    """The pages the kernel accepts: every entry of block_table that holds a slot a sequence reads or
    writes (slots cache_leftpad[b] .. end - 1, end = cache_seqlens[b] + seqlen_new if appending) is in
    [0, num_pages); the other entries are never read. (On the device, a sequence with an entry out of
    range gets NaN outputs and no append, as for out-of-bounds lengths.)"""
    for b, n in enumerate(seqlens):
        sn = seqlen_new if isinstance(seqlen_new, int) else seqlen_new[b]
        start, end = (leftpad[b] if leftpad else 0), n + (sn if appended else 0)
        for page in table[b][start // page_size:(end + page_size - 1) // page_size] if end > start else ():
            if not 0 <= page < num_pages:
                raise ValueError(f"block_table must have entries in [0, num_pages) = [0, {num_pages}) for the "
                                 f"slots a sequence reads or writes, got {page} at batch index {b}")


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The contiguous cache [batch, nheads_kv, max_blocks x page_size, headdim] a page pool [num_pages,
    nheads_kv, page_size, headdim] holds: logical slot s of sequence b is row s % page_size of page
    block_table[b, s // page_size]. Entries out of range (never read: check_pages) give zero rows."""
    num_pages, nheads_kv, page_size, headdim = pool.shape
    batch, max_blocks = block_table.shape
    table = block_table.to(torch.int64)
    inside = (table >= 0) & (table < num_pages)
    rows = pool[table.clamp(0, max(num_pages - 1, 0))] if num_pages > 0 else \
        pool.new_zeros(batch, max_blocks, nheads_kv, page_size, headdim)
    rows = torch.where(inside.view(batch, max_blocks, 1, 1, 1), rows, 0)
    return rows.transpose(1, 2).reshape(batch, nheads_kv, max_blocks * page_size, headdim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | Sequence[int] | int | None,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | Sequence[int] | int | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    block_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Attention of ``seqlen_new`` new queries per sequence (or, with ``cu_seqlens_q``, ``n_b`` for
    sequence b) over its KV cache; with ``k_new``/``v_new`` the new keys and values are first written
    into the cache in place (same launch).

    Args:
        q: ``[batch, nheads_q, seqlen_new, headdim]`` float16, bfloat16 or float32 (float64 on the
            CPU). Any strides; a layout without a contiguous last dim is copied once.
        k_cache, v_cache: ``[batch, nheads_kv, max_len, headdim]``, q's dtype and device; nheads_q a
            multiple of nheads_kv (MHA, GQA, MQA: query head h reads kv head
            ``h // (nheads_q // nheads_kv)``). Last dim contiguous and rows 16-byte aligned (any
            other strides). Written in place when ``k_new`` is given.
        cache_seqlens: valid slots per sequence before this call: an int32 ``[batch]`` tensor on
            q's device (read by the kernel only: CUDA-graph safe), or host values (an int, a list,
            a CPU tensor) which are checked here and copied to the device.
        k_new, v_new: ``[batch, nheads_kv, seqlen_new, headdim]`` or None. Written at slots
            ``cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1``.
        cache_leftpad: optional first valid slot per sequence (left padding, as Hugging Face lays
            out a batch of prompts), int32 ``[batch]`` on the device or host values; slots before it
            are never attended.
        key_mask: optional bool ``[batch or 1, max_len]`` on q's device, True = attend: a key
            padding mask on top of the lengths (e.g. transformers' mask row of a decode step).
            Masked slots are read but contribute nothing, even if they hold NaN.
        scale: score multiplier, default ``headdim ** -0.5``.
        num_splits: split-KV blocks per (sequence, kv head): None or 0 lets a heuristic choose from
            batch x heads x max_len and the SM count; 1 disables the split. Up to 256; a split with
            no keys costs an early exit. Fixed per launch, so a CUDA graph captured at one length
            replays correctly at every later length.
        out: optional preallocated ``[batch, nheads_q, seqlen_new, headdim]`` output (q's dtype,
            last dim contiguous), returned.
        validate: read device-side lengths (and block_table) on the host (a synchronization) and
            raise ValueError if any is out of bounds; None follows the
            ``FUSED_ATTN_VALIDATE_LENGTHS=1`` environment variable. Not allowed during CUDA-graph capture.
        block_table: optional int32 ``[batch, max_blocks]`` on q's device (last dim contiguous): a
            paged cache, as vLLM and FlashInfer keep one. k_cache and v_cache are then page pools
            ``[num_pages, nheads_kv, page_size, headdim]`` (page_size a power of two in [16, 256]:
            a page is page_size consecutive slots of one sequence, contiguous per kv head), and
            logical slot s of sequence b is row ``s % page_size`` of page ``block_table[b, s //
            page_size]``; max_len is ``max_blocks * page_size``. Everything else (the append,
            cache_leftpad, key_mask over the logical slots, num_splits, out) is as for the contiguous
            cache. Entries for slots a sequence reads or writes (``cache_leftpad[b] <= s < end``) must be
            in ``[0, num_pages)``; the others are never read (padding such as -1 is fine).
        cu_seqlens_q: optional offsets of a ragged batch (vLLM's ``query_start_loc``, FlashInfer's
            ``qo_indptr``): int32 ``[batch + 1]``, ``cu[0] = 0``, non-decreasing, ``cu[batch] =
            total_q``; a tensor on q's device (read by the kernel only: CUDA-graph safe) or host values
            (a list, a CPU tensor) checked here and copied. q is then packed ``[total_q, nheads_q,
            headdim]``, k_new / v_new ``[total_q, nheads_kv, headdim]``, out ``[total_q, nheads_q,
            headdim]``, and batch is the cache's (k_cache's dim 0, block_table's rows when paged).
            Sequence b's new tokens are rows ``cu[b] ... cu[b+1] - 1``; ``n_b = cu[b+1] - cu[b]`` may
            be 0 (nothing appended, no output rows). Everything else is as above with seqlen_new
            replaced by n_b: the append at slots ``cache_seqlens[b] ... cache_seqlens[b] + n_b - 1``,
            the visibility, the lengths.
        max_seqlen_q: the largest n_b, a host int: required with a device ``cu_seqlens_q`` (it sizes
            the grid, as ``flash_attn_varlen_func``'s); derived from host values when None. A CUDA
            graph captured at one max_seqlen_q replays at any offsets with every n_b within it.

    Visibility: with ``end = cache_seqlens[b] + (seqlen_new if k_new is given else 0)``, query i
    sees slots ``cache_leftpad[b] <= j < end - seqlen_new + 1 + i`` (causal among the new tokens,
    bottom-right aligned, as ``flash_attn_with_kvcache``), and key_mask's. A query with no visible key
    gives zeros. Ragged: n_b for seqlen_new, query i of sequence b being row ``cu[b] + i``.

    Lengths: ``0 <= cache_seqlens[b] <= max_len - (seqlen_new if appending else 0)`` and
    ``0 <= cache_leftpad[b] <= cache_seqlens[b]``. Host-known lengths outside this raise ValueError
    naming the argument. On the device the kernel never reads or writes past ``max_len``: a
    sequence with out-of-bounds lengths, or (paged) a block_table entry out of range among the pages it
    reads or writes, gets NaN outputs and its cache is left untouched. Device offsets out of range
    (``cu[b] > cu[b+1]``, outside ``[0, total_q]``, or ``n_b > max_seqlen_q``) leave that sequence's
    cache untouched and give NaN in the rows ``cu[b] ... cu[b] + min(n_b, max_seqlen_q) - 1`` when
    ``0 <= cu[b] <= cu[b+1] <= total_q`` (no row otherwise: nothing outside q's rows is touched);
    ``validate=True`` checks them on the host.

    Returns ``[batch, nheads_q, seqlen_new, headdim]`` (ragged: ``[total_q, nheads_q, headdim]``) in
    q's dtype (float32 accumulation). Launches
    on the current stream, never synchronizes the host (unless ``validate``), works under
    ``torch.compile(fullgraph=True)`` and CUDA-graph capture. No gradient: raises when an input
    requires grad (``fused_attn.reference.decode_attention`` is differentiable).
    """
    if (out is None and not torch.compiler.is_compiling() and _ops.direct is not None and cu_seqlens_q is None
            and (cache_seqlens is None or type(cache_seqlens) is torch.Tensor)
            and (cache_leftpad is None or type(cache_leftpad) is torch.Tensor)
            and (num_splits is None or type(num_splits) is int) and (scale is None or type(scale) is float)
            and (validate is False or (validate is None and os.environ.get(VALIDATE_ENV, "") != "1"))):
        try:  # the direct path (fused_attn._ops.direct): None where the dispatcher must run the op
            y = _ops.direct.decode_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad,
                                             key_mask, scale, 0 if num_splits is None else num_splits, block_table)
        except (TypeError, ValueError):
            y = None  # bad input (or a layout the path below copies): the path below
        if y is not None:
            return y
    # q first: the lengths are checked against the batch size, q's dim 0 (a 4-dim q) or, packed
    # (cu_seqlens_q), the cache's.
    ragged = cu_seqlens_q is not None
    _check_tensor(q, "q", "[total_q, nheads_q, headdim]" if ragged else "[batch, nheads_q, seqlen_new, headdim]")
    if ragged:
        _check_is_tensor(k_cache, "k_cache")
    batch = batch_of(q, k_cache, block_table, ragged)
    seqlens_t, seqlens_host = _as_lengths(cache_seqlens, "cache_seqlens", q, batch)
    leftpad_t, leftpad_host = _as_lengths(cache_leftpad, "cache_leftpad", q, batch)
    cu_t, cu_host = _as_offsets(cu_seqlens_q, q, batch)
    new = None if cu_host is None else [hi - lo for lo, hi in zip(cu_host[:-1], cu_host[1:])]
    max_q = _max_seqlen_q(max_seqlen_q, ragged, new)
    splits = 0 if num_splits is None else num_splits
    q, k_new, v_new = (_aligned_copy(t) for t in (q, k_new, v_new))
    scale = check_args(q, k_cache, v_cache, seqlens_t, k_new, v_new, leftpad_t, key_mask, scale, splits, out,
                       block_table, cu_t, max_q)
    check_no_grad(q, k_cache, v_cache, k_new, v_new)
    if validate is None:
        validate = os.environ.get(VALIDATE_ENV, "") == "1"
    elif not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool or None, got {validate!r}")
    max_len = max_len_of(k_cache, block_table)
    if seqlens_t is None:
        seqlens_host = [max_len] * batch
    if validate and (seqlens_host is None or (leftpad_t is not None and leftpad_host is None)
                     or (ragged and cu_host is None)):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError("validate must be False during CUDA graph capture (it reads lengths on the host), got True")
        if seqlens_host is None:
            seqlens_host = seqlens_t.tolist()
        if leftpad_t is not None and leftpad_host is None:
            leftpad_host = leftpad_t.tolist()
        if ragged and cu_host is None:
            new = check_offsets(cu_t.tolist(), q.shape[0])
            check_max_seqlen_q(max_q, new)
    appended = k_new is not None
    if seqlens_host is not None:
        # device offsets not read: the bounds that hold for any n_b (the kernel guards the rest)
        check_lengths(seqlens_host, leftpad_host, q.shape[2] if not ragged else new if new is not None else 0,
                      max_len, appended and (not ragged or new is not None))
    if validate and block_table is not None and q.device.type != "cpu":
        check_pages(block_table.tolist(), seqlens_host, leftpad_host, new if ragged else q.shape[2], k_cache.shape[2],
                    k_cache.shape[0], appended)
    if q.device.type == "cuda":
        _ops.ensure_loaded()
    op = torch.ops.fused_attn
    if out is None:
        return op.decode_attention(q, k_cache, v_cache, seqlens_t, k_new, v_new, leftpad_t, key_mask, scale, splits,
                                   block_table, cu_t, max_q)
    op.decode_attention_out(q, k_cache, v_cache, seqlens_t, k_new, v_new, leftpad_t, key_mask, scale, splits,
                            block_table, cu_t, max_q, out=out)
    return out


def check_no_grad(*tensors) -> None:
    if not torch.is_grad_enabled():
        return
    names = ("q", "k_cache", "v_cache", "k_new", "v_new")
    for name, t in zip(names, tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{name} must not require grad (decode_attention writes the cache and records no gradient; "
                f"fused_attn.reference.decode_attention is differentiable), got requires_grad=True")


# --------------------------------------------------------------------------- CPU, fake, autograd


def _cpu(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
         block_table=None, cu_seqlens_q=None, max_seqlen_q=0) -> torch.Tensor:
    """The CPU kernel: checks the lengths (they are host values here), appends in place, then the
    reference in float32 (float64 for float64 input). A paged cache goes through _cpu_paged, a ragged
    batch (cu_seqlens_q) through _cpu_ragged."""
    if cu_seqlens_q is not None:
        return _cpu_ragged(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                           block_table, cu_seqlens_q, max_seqlen_q)
    max_len = max_len_of(k_cache, block_table)
    seqlens = [max_len] * q.shape[0] if cache_seqlens is None else cache_seqlens.tolist()
    leftpad = None if cache_leftpad is None else cache_leftpad.tolist()
    check_lengths(seqlens, leftpad, q.shape[2], max_len, k_new is not None)
    if block_table is not None:
        return _cpu_paged(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                          block_table, seqlens, leftpad)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, k_all, v_all = reference.decode_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad,
                                                   scale, key_mask=key_mask, compute_dtype=compute)
    if k_new is not None:
        for b, n in enumerate(seqlens):
            k_cache[b, :, n:n + q.shape[2]] = k_new[b]
            v_cache[b, :, n:n + q.shape[2]] = v_new[b]
    return out


def _cpu_ragged(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, block_table,
                cu_seqlens_q, max_seqlen_q) -> torch.Tensor:
    """The ragged CPU kernel: checks the offsets and every sequence's lengths and pages, then runs the
    padded path on each sequence with new tokens, its rows cu[b] .. cu[b+1] - 1 as a batch of one
    (appending into its own cache, or its pages)."""
    cu = cu_seqlens_q.tolist()
    new = check_offsets(cu, q.shape[0])
    check_max_seqlen_q(max_seqlen_q, new)
    batch = len(new)
    max_len = max_len_of(k_cache, block_table)
    seqlens = [max_len] * batch if cache_seqlens is None else cache_seqlens.tolist()
    leftpad = None if cache_leftpad is None else cache_leftpad.tolist()
    check_lengths(seqlens, leftpad, new, max_len, k_new is not None)
    if block_table is not None:
        check_pages(block_table.tolist(), seqlens, leftpad, new, k_cache.shape[2], k_cache.shape[0], k_new is not None)
    out = q.new_empty(q.shape)
    for b in range(batch):
        if new[b] == 0:
            continue
        rows = slice(cu[b], cu[b + 1])

        def one(t):  # rows of sequence b as [1, heads, n_b, headdim]
            return None if t is None else t[rows].transpose(0, 1).unsqueeze(0)

        one_b = slice(b, b + 1)
        out[rows] = _cpu(one(q), k_cache if block_table is not None else k_cache[one_b],
                         v_cache if block_table is not None else v_cache[one_b],
                         None if cache_seqlens is None else cache_seqlens[one_b], one(k_new), one(v_new),
                         None if cache_leftpad is None else cache_leftpad[one_b],
                         None if key_mask is None else key_mask[min(b, key_mask.shape[0] - 1):][:1], scale,
                         None if block_table is None else block_table[one_b])[0].transpose(0, 1)
    return out


def _cpu_paged(q, k_pool, v_pool, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, block_table,
               seqlens, leftpad) -> torch.Tensor:
    """The paged CPU kernel: checks the pages, gathers each sequence's pages into the contiguous layout,
    runs the contiguous path on that copy (which appends into it), then writes the appended rows back
    into their pages."""
    num_pages, page_size = k_pool.shape[0], k_pool.shape[2]
    table = block_table.tolist()
    check_pages(table, seqlens, leftpad, q.shape[2], page_size, num_pages, k_new is not None)
    k_cache, v_cache = gather_pages(k_pool, block_table), gather_pages(v_pool, block_table)
    out = _cpu(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale)
    if k_new is not None:
        for b, n in enumerate(seqlens):
            for s in range(n, n + q.shape[2]):
                page, row = table[b][s // page_size], s % page_size
                k_pool[page, :, row] = k_cache[b, :, s]
                v_pool[page, :, row] = v_cache[b, :, s]
    return out


def _autograd(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, cache_leftpad=None, key_mask=None,
              scale=None, num_splits=0, block_table=None, cu_seqlens_q=None, max_seqlen_q=0):
    check_no_grad(q, k_cache, v_cache, k_new, v_new)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fused_attn.decode_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                     cache_leftpad, key_mask, scale, num_splits, block_table,
                                                     cu_seqlens_q, max_seqlen_q)


def _autograd_out(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, num_splits,
                  block_table=None, cu_seqlens_q=None, max_seqlen_q=0, *, out):
    check_no_grad(q, k_cache, v_cache, k_new, v_new)
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.fused_attn.decode_attention_out(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad,
                                                  key_mask, scale, num_splits, block_table, cu_seqlens_q,
                                                  max_seqlen_q, out=out)


def _register() -> None:
    lib = "fused_attn::decode_attention"

    @torch.library.register_fake(lib)
    def _fake(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, cache_leftpad=None, key_mask=None,
              scale=None, num_splits=0, block_table=None, cu_seqlens_q=None, max_seqlen_q=0):
        check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, num_splits,
                   None, block_table, cu_seqlens_q, max_seqlen_q)
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # packed q: the packed output

    @torch.library.register_fake(lib + "_out")
    def _fake_out(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, num_splits,
                  block_table=None, cu_seqlens_q=None, max_seqlen_q=0, *, out):
        check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, num_splits, out,
                   block_table, cu_seqlens_q, max_seqlen_q)

    @torch.library.register_kernel(lib, "cpu")
    def _cpu_kernel(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, cache_leftpad=None, key_mask=None,
                    scale=None, num_splits=0, block_table=None, cu_seqlens_q=None, max_seqlen_q=0):
        scale = check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                           num_splits, None, block_table, cu_seqlens_q, max_seqlen_q)
        return _cpu(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, block_table,
                    cu_seqlens_q, max_seqlen_q)

    @torch.library.register_kernel(lib + "_out", "cpu")
    def _cpu_kernel_out(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale, num_splits,
                        block_table=None, cu_seqlens_q=None, max_seqlen_q=0, *, out):
        scale = check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                           num_splits, out, block_table, cu_seqlens_q, max_seqlen_q)
        out.copy_(_cpu(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                       block_table, cu_seqlens_q, max_seqlen_q))

    _ops.LIB.impl("decode_attention", _autograd, "Autograd")
    _ops.LIB.impl("decode_attention_out", _autograd_out, "Autograd")


_register()
