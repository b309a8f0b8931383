"""Gated DeltaNet ops: the causal depthwise conv1d in front of the layer (with its carried
state), and the gated delta rule — chunked for prefill, one step at a time for decode.
Speculative decoding's verification queries (a request's last token and its drafts) go
one position at a time, and the state after each position but the last is copied to a
checkpoint slot, so a partial acceptance resumes from the state at the last kept token.

The recurrence, per value head, with S a [d_k, d_v] state, q and k L2-normalised and q
scaled by d_k^-1/2:
    S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S
The chunked form computes the same thing for C tokens at once: the intra-chunk part as
a (unit lower-triangular) linear system, the inter-chunk part through S. States are
kept in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.registry import register

CHUNK = 64


@dataclass
class PrefillGroup:
    """Prefills of equal length and equal has-a-prior-state, computed as one batch (by
    the portable implementation)."""

    token_index: torch.Tensor  # [B, length]: where each sequence's tokens sit in the step
    slots: torch.Tensor  # [B] state slots
    has_state: bool  # resumes a state (a later chunk, or a prefix-cache snapshot)


@dataclass
class DraftGroup:
    """Verification queries of equal length L (a request's last token, then its L - 1
    drafts): the state after each of the first L - 1 positions is copied to that
    position's checkpoint slot."""

    token_index: torch.Tensor  # [B, L]: where each query's tokens sit in the step
    slots: torch.Tensor  # [B] state slots
    checkpoint_slots: torch.Tensor  # [B, L - 1]


@dataclass
class RecurrentMetadata:
    """Which state slot each request of the step uses. Sequence i has the step's tokens
    [query_start[i], query_start[i + 1]) and resumes its slot's state if has_state[i]
    (else starts from zeros); a verification query (speculative decoding) also copies the
    state after each of its first tokens to checkpoints[i, j] (-1: none). For the
    portable implementation, the same grouped: decodes (one token each) first, then
    prefills batched by length, then verification queries by length."""

    query_start: torch.Tensor  # [num_seqs + 1] int32
    slots: torch.Tensor  # [num_seqs] int64
    has_state: torch.Tensor  # [num_seqs] bool
    checkpoints: torch.Tensor  # [num_seqs, max drafts] int64
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes]
    prefill_groups: list[PrefillGroup]
    draft_groups: list[DraftGroup]


def build_recurrent_metadata(
    slots: list[int], num_computed: list[int], query_lens: list[int],
    upload: Callable[[str, np.ndarray], torch.Tensor] | None = None,
    checkpoint_slots: list[list[int]] | None = None,
) -> RecurrentMetadata:
    """Requests with one token (decodes) must come first, and verification queries (those
    with checkpoint slots, one per draft) last. `upload` puts the step's host arrays on
    the device (the runner's staging; by default they stay on the CPU)."""
    upload = upload or (lambda name, array: torch.from_numpy(np.ascontiguousarray(array)))
    checkpoint_slots = checkpoint_slots or [[] for _ in slots]
    checkpoints = np.full((len(slots), max(map(len, checkpoint_slots), default=0)), -1, dtype=np.int64)
    for i, c in enumerate(checkpoint_slots):
        checkpoints[i, : len(c)] = c
    num_verify = sum(1 for c in checkpoint_slots if c)
    draft_groups = _draft_groups(slots, query_lens, checkpoint_slots, num_verify, upload) if num_verify else []
    regular = len(slots) - num_verify
    num_decodes = 0
    while num_decodes < regular and query_lens[num_decodes] == 1:
        num_decodes += 1
    groups: dict[tuple[int, bool], tuple[list[int], list[int]]] = {}
    start = num_decodes
    for slot, c, q in zip(slots[num_decodes:regular], num_computed[num_decodes:regular], query_lens[num_decodes:regular]):
        starts, group_slots = groups.setdefault((q, c > 0), ([], []))
        starts.append(start)
        group_slots.append(slot)
        start += q
    prefill_groups = [
        PrefillGroup(
            token_index=upload(f"group{i}.index", np.asarray(starts)[:, None] + np.arange(length)[None, :]),
            slots=upload(f"group{i}.slots", np.asarray(group_slots, dtype=np.int64)),
            has_state=has_state,
        )
        for i, ((length, has_state), (starts, group_slots)) in enumerate(groups.items())
    ]
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start[1:])
    slots_t = upload("state_slots", np.asarray(slots, dtype=np.int64))
    return RecurrentMetadata(
        query_start=upload("recurrent_query_start", query_start),
        slots=slots_t,
        has_state=upload("has_state", np.asarray(num_computed) > 0),
        checkpoints=upload("checkpoints", checkpoints),
        num_decodes=num_decodes,
        decode_slots=slots_t[:num_decodes],
        prefill_groups=prefill_groups,
        draft_groups=draft_groups,
    )


def _draft_groups(slots: list[int], query_lens: list[int], checkpoint_slots: list[list[int]], num_verify: int,
                  upload: Callable[[str, np.ndarray], torch.Tensor]) -> list[DraftGroup]:
    first = len(slots) - num_verify
    if any(checkpoint_slots[:first]) or any(len(c) != q - 1 for c, q in zip(checkpoint_slots[first:], query_lens[first:])):
        raise ValueError("verification queries come last, with a checkpoint slot per draft")
    groups: dict[int, tuple[list[int], list[int], list[list[int]]]] = {}
    start = sum(query_lens[:first])
    for slot, q, checkpoints in zip(slots[first:], query_lens[first:], checkpoint_slots[first:]):
        starts, group_slots, group_checkpoints = groups.setdefault(q, ([], [], []))
        starts.append(start)
        group_slots.append(slot)
        group_checkpoints.append(checkpoints)
        start += q
    return [
        DraftGroup(
            token_index=upload(f"draft{i}.index", np.asarray(starts)[:, None] + np.arange(length)[None, :]),
            slots=upload(f"draft{i}.slots", np.asarray(group_slots, dtype=np.int64)),
            checkpoint_slots=upload(f"draft{i}.checkpoints", np.asarray(group_checkpoints, dtype=np.int64)),
        )
        for i, (length, (starts, group_slots, group_checkpoints)) in enumerate(groups.items())
    ]


def _conv1d_drafts(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, groups: list[DraftGroup],
                  out: torch.Tensor) -> None:
    """Verification queries through the conv (portable), each position's window (the
    last K-1 inputs up to it) kept in its checkpoint slot."""
    k = weight.shape[1]
    for group in groups:
        idx = group.token_index  # [B, L]
        padded = torch.cat([conv_state[group.slots].to(weight.dtype), x[idx].transpose(1, 2).to(weight.dtype)], dim=2)
        windows = padded.unfold(2, k, 1)  # [B, C, L, K]: position j's inputs
        out[idx] = F.silu((windows * weight[None, :, None, :]).sum(-1)).transpose(1, 2).to(x.dtype)
        carried = windows[:, :, :, 1:].transpose(1, 2)  # [B, L, C, K-1]: the inputs kept after each position
        conv_state[group.checkpoint_slots.flatten()] = carried[:, :-1].flatten(0, 1).to(conv_state.dtype)
        conv_state[group.slots] = carried[:, -1].to(conv_state.dtype)


def _delta_rule_drafts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, groups: list[DraftGroup], out: torch.Tensor) -> None:
    """Verification queries through the delta rule (portable), a position at a time,
    each position's state kept in its checkpoint slot."""
    for group in groups:
        idx = group.token_index  # [B, L]
        qn, kn = _prepare(q[idx], k[idx], v.shape[1] // q.shape[1])  # [B, L, H, dk]
        decay, vf, bf = g[idx].float().exp(), v[idx].float(), beta[idx].float()
        s = state[group.slots].float()
        states, outs = [], []
        for j in range(idx.shape[1]):
            s, o = _delta_rule_step(qn[:, j], kn[:, j], vf[:, j], decay[:, j], bf[:, j], s)
            states.append(s)
            outs.append(o)
        state[group.checkpoint_slots.flatten()] = torch.stack(states[:-1], dim=1).flatten(0, 1)
        state[group.slots] = s
        out[idx] = torch.stack(outs, dim=1).to(out.dtype)


@register("causal_conv1d")
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  meta: RecurrentMetadata) -> torch.Tensor:
    """The step's tokens x [T, C] through each sequence's causal conv (weight [C, K]) and
    silu; conv_state [slots, C, K-1] is read and updated in its slots."""
    out = torch.empty_like(x)
    nd = meta.num_decodes
    if nd:
        out[:nd], conv_state[meta.decode_slots] = causal_conv1d_decode(x[:nd], weight, conv_state[meta.decode_slots])
    for group in meta.prefill_groups:
        init = conv_state[group.slots] if group.has_state else None
        out[group.token_index], conv_state[group.slots] = causal_conv1d_prefill(x[group.token_index], weight, init)
    _conv1d_drafts(x, weight, conv_state, meta.draft_groups, out)
    return out


@register("causal_conv1d", "cpu", available=cpu_extension.available)
def causal_conv1d_cpu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      meta: RecurrentMetadata) -> torch.Tensor:
    return cpu_kernels().causal_conv1d(x, weight, conv_state, meta.query_start, meta.slots, meta.has_state,
                                       meta.checkpoints)


@register("gated_delta_rule")
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    """The step's tokens (q, k [T, Hk, dk]; v [T, H, dv]; g, beta [T, H]) through each
    sequence's gated delta rule; state [slots, H, dk, dv] (fp32) is read and updated in
    its slots. Returns o [T, H, dv] in v's dtype."""
    out = torch.empty_like(v)
    nd = meta.num_decodes
    if nd:
        out[:nd], state[meta.decode_slots] = recurrent_gated_delta_rule(
            q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], state[meta.decode_slots])
    for group in meta.prefill_groups:
        idx = group.token_index
        init = state[group.slots] if group.has_state else None
        out[idx], state[group.slots] = chunk_gated_delta_rule(q[idx], k[idx], v[idx], g[idx], beta[idx], init)
    _delta_rule_drafts(q, k, v, g, beta, state, meta.draft_groups, out)
    return out


@register("gated_delta_rule", "cpu", available=cpu_extension.available)
def gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, meta: RecurrentMetadata) -> torch.Tensor:
    """The C++ recurrence (kernels/csrc/gdn.cpp), token by token with each head's state in L1."""
    return cpu_kernels().gated_delta_rule(q, k, v, g.float(), beta.float(), state, meta.query_start,
                                          meta.slots, meta.has_state, meta.checkpoints)


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, C]; weight: [C, K]; state: [B, C, K-1] (the K-1 inputs before x) or None
    for zeros. Returns silu(conv(x)) as [B, T, C] and the new state."""
    b, t, c = x.shape
    k = weight.shape[1]
    xt = x.transpose(1, 2).to(weight.dtype)
    if state is None:
        state = xt.new_zeros(b, c, k - 1)
    padded = torch.cat([state.to(weight.dtype), xt], dim=2)  # [B, C, K-1+T]
    out = F.conv1d(padded, weight.unsqueeze(1), groups=c)  # [B, C, T]
    return F.silu(out).transpose(1, 2).to(x.dtype), padded[:, :, -(k - 1):].contiguous()


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, C] (one token each); state: [B, C, K-1]. Returns silu(conv) [B, C] and the new state."""
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window * weight.unsqueeze(0)).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def _prepare(q, k, rep):
    """Repeats each key head for the value heads it serves, L2-normalises q and k, scales q."""
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    q = q.float()
    k = k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B sequences of T tokens. q, k: [B, T, Hk, dk]; v: [B, T, H, dv]; g, beta: [B, T, H];
    state: [B, H, dk, dv] or None (zeros). Returns o [B, T, H, dv] (in v's dtype) and the
    final states (fp32).

    The sequences are independent, so they are folded into the head axis."""
    b, t, h, dv = v.shape
    hk = q.shape[2]
    fold = lambda x: x.transpose(0, 1).reshape(t, b * x.shape[2], *x.shape[3:])  # noqa: E731
    o, s = _chunk_one(fold(q), fold(k), fold(v), fold(g.unsqueeze(-1)).squeeze(-1), fold(beta.unsqueeze(-1)).squeeze(-1),
                      None if state is None else state.reshape(b * h, *state.shape[2:]), h // hk)
    return o.reshape(t, b, h, dv).transpose(0, 1), s.reshape(b, h, *s.shape[1:])


def _chunk_one(q, k, v, g, beta, state, rep):
    """q, k: [T, Hk', dk]; v: [T, H', dv]; each key head serves `rep` consecutive value heads."""
    t, h, dv = v.shape
    q, k = _prepare(q, k, rep)
    dk = q.shape[-1]
    pad = -t % CHUNK
    n = (t + pad) // CHUNK

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, CHUNK, ...]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x.reshape(n, CHUNK, *x.shape[1:]).movedim(2, 0)

    qc, kc, vc = chunks(q), chunks(k), chunks(v.float())  # [H, n, C, d]
    gc, bc = chunks(g.float()), chunks(beta.float())  # [H, n, C]
    cum = gc.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [H, n, C, C]
    k_beta = kc * bc.unsqueeze(-1)
    system = (k_beta @ kc.transpose(-1, -2)) * decay
    # (I + strictly-lower(system)) X = RHS; the diagonal is taken as 1
    values = torch.linalg.solve_triangular(system, vc * bc.unsqueeze(-1), upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp().unsqueeze(-1)
    k_to_end = kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [H, n]

    s = torch.zeros(h, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty(h, n, CHUNK, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        v_new = values[:, i] - k_cum[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    o = out.reshape(h, n * CHUNK, dv)[:, :t].transpose(0, 1)
    return o.to(v.dtype), s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. q, k: [B, Hk, dk]; v: [B, H, dv]; g, beta: [B, H];
    state: [B, H, dk, dv]. Returns o [B, H, dv] and the new state (fp32)."""
    h = v.shape[1]
    q, k = _prepare(q, k, h // q.shape[1])
    s, o = _delta_rule_step(q, k, v.float(), g.float().exp(), beta.float(), state.float())
    return o.to(v.dtype), s


def _delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                     s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences, inputs prepared (q, k [B, H, dk] normalised; v [B, H, dv],
    decay = exp(g), beta [B, H], all fp32): the new state and the output."""
    s = s * decay[..., None, None]
    remembered = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = (v - remembered) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return s, torch.einsum("bhk,bhkv->bhv", q, s)
