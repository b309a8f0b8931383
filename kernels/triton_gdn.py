"""Triton kernels for Gated DeltaNet: the gated delta rule and the causal conv1d, each
over a whole mixed batch (decodes and prefills, fresh or resuming a state), reading and
updating the recurrent states in their slots in place (layouts: gdn.py).

The delta rule takes two routes in one call:
- prefills (more than one token, no draft checkpoints) go through the chunked (WY) form:
  a first kernel, parallel over every chunk of every sequence and head, turns each chunk
  of C tokens into its WY representation (the unit lower-triangular system of the chunk,
  with the gate's cumulative decay, inverted by forward substitution; then U = T (beta v)
  and W = T (beta exp(G) k)); a second kernel, one program per (sequence, value head,
  block of value channels), walks the chunks in order with the state tile in registers,
  three matrix products a chunk (the new values U - W S, the output, the next state);
- decodes and speculative decoding's verification queries (the state after each token
  copied to a checkpoint slot) go through the recurrence, token by token, one program per
  (sequence, value head, block of value channels).
A step with no prefill (every decode step) launches the recurrence alone. Both tested
under TRITON_INTERPRET=1 in fp32 against the portable chunked form (gdn.py).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from vlmserve import envs
from vlmserve.kernels.gdn import RecurrentMetadata
from vlmserve.kernels.registry import register
from vlmserve.kernels.triton_attention import dot_precision

BLOCK_V = 16  # value channels per program of the recurrence
# tokens per chunk of the chunked form: 64 on a GPU (tensor-core tiles); the interpreter
# runs each program in numpy, where a smaller chunk is faster and still crosses chunks
GPU_CHUNK, INTERPRETED_CHUNK = 64, 16
SCAN_BLOCK_V = 32  # value channels per program of the chunk scan


@triton.jit
def _is_prefill(query_start_ptr, checkpoints_ptr, seq, width):
    """Whether sequence `seq` takes the chunked route: more than one token and no draft
    checkpoints (a verification query goes a token at a time)."""
    t0 = tl.load(query_start_ptr + seq)
    t1 = tl.load(query_start_ptr + seq + 1)
    prefill = t1 - t0 > 1
    if width > 0:
        prefill = prefill & (tl.load(checkpoints_ptr + seq * width) < 0)
    return prefill


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_ptr, slots_ptr, has_state_ptr,
    checkpoints_ptr, width, key_heads, heads,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SKIP_PREFILLS: tl.constexpr,
):
    """The recurrence, token by token. With SKIP_PREFILLS the sequences of the chunked
    route are left to it."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vblock = tl.program_id(2)
    if SKIP_PREFILLS:
        if _is_prefill(query_start_ptr, checkpoints_ptr, seq, width) != 0:
            return
    t0 = tl.load(query_start_ptr + seq)
    t1 = tl.load(query_start_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    key_head = head // (heads // key_heads)
    ks = tl.arange(0, BLOCK_K)
    vs = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    if slot < 0:  # a padding row (a CUDA graph's batch rounded up): no state, zeros out
        zeros = tl.zeros([BLOCK_V], tl.float32).to(out_ptr.dtype.element_ty)
        for t in range(t0, t1):
            tl.store(out_ptr + (t * heads + head) * DV + vs, zeros, mask=v_ok)
        return
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


@triton.jit
def _chunk_prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, gcum_ptr, query_start_ptr, checkpoints_ptr, width, key_heads, heads,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: one chunk of one sequence, one value head. With G the cumulative gate
    inside the chunk and L the strictly lower part of (beta k) k^T * exp(G_i - G_j), the
    chunk's WY factors are U = (I + L)^-1 (beta v) and W = (I + L)^-1 (beta exp(G) k),
    stored with G for the scan (fp32)."""
    seq = tl.program_id(0)
    chunk = tl.program_id(1)
    head = tl.program_id(2)
    if _is_prefill(query_start_ptr, checkpoints_ptr, seq, width) == 0:
        return
    t1 = tl.load(query_start_ptr + seq + 1)
    start = tl.load(query_start_ptr + seq) + chunk * CHUNK
    if start >= t1:
        return
    key_head = head // (heads // key_heads)
    rows = tl.arange(0, CHUNK)
    tok = start + rows
    ok = tok < t1
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < DK
    k = tl.load(k_ptr + (tok[:, None] * key_heads + key_head) * DK + ks[None, :], mask=ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    beta = tl.load(beta_ptr + tok * heads + head, mask=ok, other=0.0)
    g = tl.load(g_ptr + tok * heads + head, mask=ok, other=0.0)
    gcum = tl.cumsum(g, axis=0)
    k_beta = k * beta[:, None]
    i = rows[:, None]
    j = rows[None, :]
    below = j < i
    system = tl.dot(k_beta, tl.trans(k), input_precision=PRECISION)
    lower = tl.where(below, system * tl.exp(tl.where(below, gcum[:, None] - gcum[None, :], 0.0)), 0.0)
    # (I + lower)^-1 by forward substitution: row r is e_r - lower[r, :] T, where the rows
    # of T from r on are still the identity's (lower[r, j] = 0 for j >= r)
    inverse = tl.where(i == j, 1.0, 0.0)
    for r in range(1, CHUNK):
        lower_r = tl.sum(tl.where(i == r, lower, 0.0), axis=0)  # lower[r, :]
        row = tl.sum(lower_r[:, None] * inverse, axis=0)
        inverse = tl.where(i == r, inverse - row[None, :], inverse)
    w = tl.dot(inverse, k_beta * tl.exp(gcum)[:, None], input_precision=PRECISION)
    tl.store(w_ptr + (tok[:, None] * heads + head) * DK + ks[None, :], w, mask=ok[:, None] & k_ok[None, :])
    tl.store(gcum_ptr + tok * heads + head, gcum, mask=ok)
    for v0 in tl.static_range(0, DV, BLOCK_V):  # the value channels in tiles (a chunk's T is computed once)
        vs = v0 + tl.arange(0, BLOCK_V)
        v_ok = vs < DV
        v = tl.load(v_ptr + (tok[:, None] * heads + head) * DV + vs[None, :], mask=ok[:, None] & v_ok[None, :],
                    other=0.0).to(tl.float32)
        u = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + (tok[:, None] * heads + head) * DV + vs[None, :], u, mask=ok[:, None] & v_ok[None, :])


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, gcum_ptr, state_ptr, out_ptr, query_start_ptr, slots_ptr, has_state_ptr,
    checkpoints_ptr, width, key_heads, heads,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: one sequence, one value head, BLOCK_V value channels; the chunks in
    order, the state S [dk, BLOCK_V] in registers (fp32). A chunk: V' = U - W S (the values
    less what S already predicts), o = (q exp(G)) S + (q k^T * exp(G_i - G_j), causal) V',
    S <- exp(G_last) S + (k exp(G_last - G))^T V'."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vblock = tl.program_id(2)
    if _is_prefill(query_start_ptr, checkpoints_ptr, seq, width) == 0:
        return
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
    rows = tl.arange(0, CHUNK)
    causal = rows[None, :] <= rows[:, None]
    for start in range(t0, t1, CHUNK):
        tok = start + rows
        ok = tok < t1
        qk_mask = ok[:, None] & k_ok[None, :]
        qk_off = (tok[:, None] * key_heads + key_head) * DK + ks[None, :]
        q = tl.load(q_ptr + qk_off, mask=qk_mask, other=0.0).to(tl.float32)
        q = q * (q_scale / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None]
        k = tl.load(k_ptr + qk_off, mask=qk_mask, other=0.0).to(tl.float32)
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        gcum = tl.load(gcum_ptr + tok * heads + head, mask=ok, other=0.0)
        last = tl.minimum(start + CHUNK, t1) - 1
        gcum_last = tl.sum(tl.where(tok == last, gcum, 0.0), axis=0)
        w = tl.load(w_ptr + (tok[:, None] * heads + head) * DK + ks[None, :], mask=qk_mask, other=0.0)
        u = tl.load(u_ptr + (tok[:, None] * heads + head) * DV + vs[None, :], mask=ok[:, None] & v_ok[None, :],
                    other=0.0)
        v_new = u - tl.dot(w, state, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(causal, scores * tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(gcum)[:, None], state, input_precision=PRECISION)
        o += tl.dot(scores, v_new, input_precision=PRECISION)
        tl.store(out_ptr + (tok[:, None] * heads + head) * DV + vs[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None] & v_ok[None, :])
        k_to_end = k * tl.where(ok, tl.exp(gcum_last - gcum), 0.0)[:, None]
        state = state * tl.exp(gcum_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision=PRECISION)
    tl.store(state_ptr + s_off, state, mask=s_mask)


def _checkpoints(meta: RecurrentMetadata) -> tuple[torch.Tensor, int]:
    """The checkpoint slots and their row width (a one-element stand-in when there are none)."""
    width = meta.checkpoints.shape[1]
    return (meta.checkpoints if width else meta.slots.new_full((1,), -1)), width


def _longest_prefill(meta: RecurrentMetadata) -> int:
    """The most tokens of a sequence on the chunked route (0: none), from the host-side
    grouping: no device read."""
    return max((group.token_index.shape[1] for group in meta.prefill_groups), default=0)


def _recurrent_needed(meta: RecurrentMetadata) -> bool:
    """Whether any sequence goes a token at a time: decodes, one-token prefill chunks,
    verification queries."""
    return bool(meta.num_decodes or meta.draft_groups or any(group.token_index.shape[1] == 1
                                                            for group in meta.prefill_groups))


@register("gated_delta_rule", "triton")
def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, meta: RecurrentMetadata, chunk: int | None = None) -> torch.Tensor:
    """Prefills by the chunked form (`chunk` tokens a chunk, default_chunk() by default), decodes and
    verification queries by the recurrence; each state updated in its slot."""
    out = torch.empty_like(v)
    num_seqs = meta.slots.shape[0]
    if num_seqs == 0:
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    key_heads, dk = q.shape[1], q.shape[2]
    heads, dv = v.shape[1], v.shape[2]
    has_state = meta.has_state.to(torch.int32)
    checkpoints, width = _checkpoints(meta)
    longest = _longest_prefill(meta)
    chunked = longest > 1
    if not chunked or _recurrent_needed(meta):
        _gated_delta_rule_kernel[(num_seqs, heads, triton.cdiv(dv, BLOCK_V))](
            q, k, v, g, beta, state, out, meta.query_start, meta.slots, has_state, checkpoints, width, key_heads,
            heads, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, SKIP_PREFILLS=chunked,
        )
    if chunked:
        _chunked(q, k, v, g, beta, state, out, meta, has_state, checkpoints, width, longest,
                 chunk or default_chunk())
    return out


def default_chunk() -> int:
    return INTERPRETED_CHUNK if envs.TRITON_INTERPRET else GPU_CHUNK


def chunked_launches(dk: int, dv: int, dtype: torch.dtype, chunk: int) -> dict[str, tuple]:
    """The chunked form's two kernels with their block sizes and launch options at these
    head widths and this storage dtype: {"prepare" | "scan": (kernel, options)}."""
    block_k = triton.next_power_of_2(dk)
    common = dict(DK=dk, DV=dv, BLOCK_K=block_k, CHUNK=chunk, PRECISION=dot_precision(dtype),
                  num_warps=8 if block_k >= 128 else 4)  # wide heads: 64-token q, k and W tiles in registers
    # the scan in one stage (its chunks' loads not pipelined): at head 128 Triton's default
    # of 3 wants 272-297 KB of shared memory, over the 227 KB a block gets on an H100/H200
    return {"prepare": (_chunk_prepare_kernel, {**common, "BLOCK_V": min(triton.next_power_of_2(dv), 64)}),
            "scan": (_chunk_scan_kernel, {**common, "BLOCK_V": min(triton.next_power_of_2(dv), SCAN_BLOCK_V),
                                          "num_stages": 1})}


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, out: torch.Tensor, meta: RecurrentMetadata, has_state: torch.Tensor,
             checkpoints: torch.Tensor, width: int, longest: int, chunk: int) -> None:
    """The prefills of the step by the chunked form: the WY factors of every chunk at once,
    then the scan over each sequence's chunks."""
    tokens, key_heads, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    launches = chunked_launches(dk, dv, v.dtype, chunk)
    # fp32 workspaces (the decode rows in them are never written or read)
    u = torch.empty(tokens, heads, dv, dtype=torch.float32, device=v.device)
    w = torch.empty(tokens, heads, dk, dtype=torch.float32, device=v.device)
    gcum = torch.empty(tokens, heads, dtype=torch.float32, device=v.device)
    num_seqs = meta.slots.shape[0]
    prepare, options = launches["prepare"]
    prepare[(num_seqs, triton.cdiv(longest, chunk), heads)](
        k, v, g, beta, u, w, gcum, meta.query_start, checkpoints, width, key_heads, heads, **options)
    scan, options = launches["scan"]
    scan[(num_seqs, heads, triton.cdiv(dv, options["BLOCK_V"]))](
        q, k, u, w, gcum, state, out, meta.query_start, meta.slots, has_state, checkpoints, width, key_heads, heads,
        **options)


def gated_delta_rule_recurrent_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    """Every sequence, prefills too, by the recurrence (the kernel before the chunked form:
    kept as the reference the GPU check times the chunked form against)."""
    out = torch.empty_like(v)
    num_seqs = meta.slots.shape[0]
    if num_seqs == 0:
        return out
    dk, heads, dv = q.shape[2], v.shape[1], v.shape[2]
    _gated_delta_rule_kernel[(num_seqs, heads, triton.cdiv(dv, BLOCK_V))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.float().contiguous(), state, out,
        meta.query_start, meta.slots, meta.has_state.to(torch.int32), *_checkpoints(meta), q.shape[1], heads,
        DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, SKIP_PREFILLS=False,
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
    if slot < 0:  # a padding row (a CUDA graph's batch rounded up): no state, zeros out
        zeros = tl.zeros([BLOCK_C], tl.float32).to(out_ptr.dtype.element_ty)
        for t in range(t0, t1):
            tl.store(out_ptr + t * channels + cs, zeros, mask=ok)
        return
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
