"""Triton kernels for Gated DeltaNet: the gated delta rule and the causal conv1d, each
over a whole mixed batch (decodes and prefills, fresh or resuming a state) in one launch,
reading and updating the recurrent states in their slots in place (layouts: gdn.py).

The delta rule runs as the recurrence, token by token, one program per (sequence, value
head, block of value channels), the state tile in registers: a prefill resumes from the
slot's state (or zeros) and leaves the final state there, a decode is a prefill of one.
Tested under TRITON_INTERPRET=1 in fp32 against the portable chunked form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlmserve.kernels.gdn import RecurrentMetadata
from vlmserve.kernels.registry import register

BLOCK_V = 16  # value channels per program


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_ptr, slots_ptr, has_state_ptr,
    checkpoints_ptr, width, key_heads, heads,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vblock = tl.program_id(2)
    t0 = tl.load(query_start_ptr + seq)
    t1 = tl.load(query_start_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    key_head = head // (heads // key_heads)
    ks = tl.arange(0, BLOCK_K)
    vs = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    s_off = ((slot * heads + head) * DK + ks[:, None]) * DV + vs[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    state = tl.load(state_ptr + s_off, mask=s_mask, other=0.0)
    if tl.load(has_state_ptr + seq) == 0:
        state = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    q_scale = 1.0 / tl.sqrt(DK * 1.0)
    for t in range(t0, t1):
        q = tl.load(q_ptr + (t * key_heads + key_head) * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (t * key_heads + key_head) * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
        q = q * (q_scale / tl.sqrt(tl.sum(q * q) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(v_ptr + (t * heads + head) * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * heads + head))
        beta = tl.load(beta_ptr + t * heads + head)
        state = state * decay
        delta = (v - tl.sum(k[:, None] * state, axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * state, axis=0)
        tl.store(out_ptr + (t * heads + head) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=v_ok)
        if t - t0 < width:  # a verification query: the state after this token, to its checkpoint
            checkpoint = tl.load(checkpoints_ptr + seq * width + t - t0).to(tl.int64)
            if checkpoint >= 0:
                c_off = ((checkpoint * heads + head) * DK + ks[:, None]) * DV + vs[None, :]
                tl.store(state_ptr + c_off, state, mask=s_mask)
    tl.store(state_ptr + s_off, state, mask=s_mask)


def _checkpoints(meta: RecurrentMetadata) -> tuple[torch.Tensor, int]:
    """The checkpoint slots and their row width (a one-element stand-in when there are none)."""
    width = meta.checkpoints.shape[1]
    return (meta.checkpoints if width else meta.slots.new_full((1,), -1)), width


@register("gated_delta_rule", "triton")
def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    out = torch.empty_like(v)
    num_seqs = meta.slots.shape[0]
    if num_seqs == 0:
        return out
    key_heads, dk = q.shape[1], q.shape[2]
    heads, dv = v.shape[1], v.shape[2]
    grid = (num_seqs, heads, triton.cdiv(dv, BLOCK_V))
    _gated_delta_rule_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.float().contiguous(), state, out,
        meta.query_start, meta.slots, meta.has_state.to(torch.int32), *_checkpoints(meta), key_heads, heads,
        DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V,
    )
    return out


@triton.jit
def _causal_conv1d_kernel(x_ptr, weight_ptr, conv_state_ptr, out_ptr, query_start_ptr, slots_ptr, has_state_ptr,
                          checkpoints_ptr, width, channels, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: a block of channels of one sequence; the window of the last
    KERNEL - 1 inputs in registers, read from and written back to the state slot."""
    seq = tl.program_id(0)
    cblock = tl.program_id(1)
    t0 = tl.load(query_start_ptr + seq)
    t1 = tl.load(query_start_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cs = cblock * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cs < channels
    pos = tl.arange(0, KERNEL)  # window position p holds input t - (KERNEL - 1) + p; p = KERNEL - 1 is x_t
    # the state (the KERNEL - 1 inputs before the step) sits at positions 1 .. KERNEL - 1 until the first shift
    from_state = (slot * channels + cs[:, None]) * (KERNEL - 1) + (pos[None, :] - 1)
    window = tl.load(conv_state_ptr + from_state, mask=ok[:, None] & (pos[None, :] >= 1), other=0.0).to(tl.float32)
    if tl.load(has_state_ptr + seq) == 0:
        window = tl.zeros([BLOCK_C, KERNEL], tl.float32)
    weight = tl.load(weight_ptr + cs[:, None] * KERNEL + pos[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    moves_to = pos[None, :, None] == pos[None, None, :] + 1  # [1, from, to]: position p moves to p - 1
    for t in range(t0, t1):
        x = tl.load(x_ptr + t * channels + cs, mask=ok, other=0.0).to(tl.float32)
        shifted = tl.sum(tl.where(moves_to, window[:, :, None], 0.0), axis=1)
        window = tl.where(pos[None, :] == KERNEL - 1, x[:, None], shifted)
        acc = tl.sum(window * weight, axis=1)
        tl.store(out_ptr + t * channels + cs, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ok)
        if t - t0 < width:  # a verification query: the inputs kept after this token, to its checkpoint
            checkpoint = tl.load(checkpoints_ptr + seq * width + t - t0).to(tl.int64)
            if checkpoint >= 0:
                to = (checkpoint * channels + cs[:, None]) * (KERNEL - 1) + (pos[None, :] - 1)
                tl.store(conv_state_ptr + to, window.to(conv_state_ptr.dtype.element_ty),
                         mask=ok[:, None] & (pos[None, :] >= 1))
    # the new state: the last KERNEL - 1 inputs, window positions 1 .. KERNEL - 1
    tl.store(conv_state_ptr + from_state, window.to(conv_state_ptr.dtype.element_ty), mask=ok[:, None] & (pos[None, :] >= 1))


@register("causal_conv1d", "triton")
def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         meta: RecurrentMetadata) -> torch.Tensor:
    out = torch.empty_like(x)
    num_seqs = meta.slots.shape[0]
    if num_seqs == 0:
        return out
    channels, kernel = weight.shape
    if kernel & (kernel - 1):
        raise ValueError(f"the Triton conv1d takes power-of-two kernels, got {kernel}")
    block = 32
    _causal_conv1d_kernel[(num_seqs, triton.cdiv(channels, block))](
        x.contiguous(), weight.contiguous(), conv_state, out, meta.query_start, meta.slots,
        meta.has_state.to(torch.int32), *_checkpoints(meta), channels, KERNEL=kernel, BLOCK_C=block,
    )
    return out
