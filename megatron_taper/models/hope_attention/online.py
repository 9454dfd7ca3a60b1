"""An online CMS level (hope_attention/model.py) as one scan over its chunks with a hand-written
backward: a few dozen operators per chunk instead of a loop of autograd'd weight updates, and
backward keeps low-rank factors, never a fast weight of any update.

Per sequence (batch omitted): inputs n [S, D], chunks of C tokens, width W, step sigma = eta.
The update of chunk c (hope_attention's docstring) is low rank:

    w2  += sigma E_c^T H_c       H_c = h_c [C, W],  E_c = (n_c - y_c) / den_c [C, D]
    w13 += sigma G_c^T n_c       G_c = [dh_c * g_c * silu'(a_c), dh_c * s_c] [C, 2W],  dh_c = E_c w2^(c)
    den_c = sum_{t in c} (||h_t||^2 + 2 ||n_t||^2) + C STEP_EPS

(sigma E_c is hope_attention's descent, sigma dh_c its dh). w13 is read in dual form: the chunks
are taken in groups of K = GROUP_TOKENS / C, a group starts from w13^(g) materialised at its start
(one matmul per group), and

    [a_c, g_c] = n_c w13^(g)T + sigma (n_c n_u^T) G_u       n_c w13^(g)T and n_c n_u^T: all chunks at once

over the group's G_u, whose rows of the chunks not yet run are zero, so every read sees exactly
the chunks before it. w2 ([B, D, W], read twice per chunk) is kept materialised and updated in
place, never saved. The sequence's last chunk only reads (unless a context-parallel slice hands
its end weights on: `send_end`).

Backward keeps n, the factors G, E, H and den (3 W + D per updated token). It recomputes the group
start weights in forward order, everything state-independent of a group at once, and runs the
adjoint recurrence chunk by chunk in reverse: w2 is taken back from its end to w2^(c) by
subtracting each update (exact up to rounding), the adjoint of w2^(c + 1) is accumulated in place
([B, D, W]), and the adjoint of G_c is pulled from the later chunks' [a, g] adjoint rows (zero
where not yet run).

Tensor parallelism (a width shard per rank): each chunk's partial y and ||h||^2 are summed by one
all-reduce forward (sum_partial), and backward sums the shards' partial adjoints of y and of
||h||^2 (what `reenter`'s backward does) by one all-reduce per chunk; every other adjoint stays
partial, summed where its input enters the shard.

Cost on one device: 14 operators per updated chunk forward and 18 backward, about 20 and 150 per
group (cost/op_count.py counts them); forward FLOPs per updated token about 14 W D + 4 W L + 2 D L
with L = K C (cost.py scan_flops), against 14 W D for a loop that materialises every update. Under
torch.compile the writes into strided buffer views become copies (`_into`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megatron_taper.models.hope_attention.cost import scan_groups

STEP_EPS = 1e-6  # keeps a normalised step finite for a chunk whose inputs vanish

SumPartial = Callable[[torch.Tensor], torch.Tensor] | None  # tensor parallelism's all-reduce, None on one device


def online_scan(n: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, step: torch.Tensor, period: int,
                sum_partial: SumPartial = None, send_end: bool = False):
    """The level's outputs [B, S, D] for inputs n [B, S, D] from start weights w13 [2W, D] and w2
    [D, W] (or [B, ...]), step [1]; with `send_end` also the end weights ([B, 2W, D], [B, D, W]).
    At least one chunk must update (S > period, or send_end)."""
    return _OnlineScan.apply(n, w13, w2, step, period, sum_partial, send_end)


def _into(out: torch.Tensor, op: Callable, *args, **kwargs) -> torch.Tensor:
    """op(*args, out=out): written in place eagerly (one operator); under torch.compile, which
    refuses strided `out=` tensors, computed, then copied."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args, **kwargs))
    return op(*args, **kwargs, out=out)


def _silu_grad(grad: torch.Tensor, a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """grad * silu'(a)."""
    if out is None:
        return torch.ops.aten.silu_backward(grad, a)
    return torch.ops.aten.silu_backward.grad_input(grad, a, grad_input=out)


def _chunk_views(t: torch.Tensor, chunks: int, period: int) -> tuple[list, list]:
    """Views [B, 1, C X] and [B, C X, 1] of each chunk of t [B, chunks C, X] (rows contiguous)."""
    bsz, _, x = t.shape
    return t.view(bsz, chunks, 1, period * x).unbind(1), t.view(bsz, chunks, period * x, 1).unbind(1)


def _group_mask(rows: int, cols: int, period: int, like: torch.Tensor) -> torch.Tensor:
    """[rows, cols]: 1 where the row's chunk comes after the column's chunk."""
    chunk = torch.arange(max(rows, cols), device=like.device) // period
    return (chunk[:rows, None] > chunk[None, :cols]).to(like.dtype)


def _forward(n, w13, w2, sigma, period, sum_partial, send_end):
    bsz, seq, d = n.shape
    width = w2.shape[-1]
    chunks = -(-seq // period)
    updates = chunks if send_end else chunks - 1
    su = updates * period
    out = n.new_empty(bsz, seq, d)
    factors_g = n.new_zeros(bsz, su, 2 * width)  # G, zero until its chunk runs
    factors_e, factors_h = n.new_empty(bsz, su, d), n.new_empty(bsz, su, width)
    descent = n.new_empty(bsz, su, d)  # sigma E
    # den_c [U, B, 1, 1]: starts as 2 sum ||n_t||^2 + C eps, ||h_t||^2 added in the loop
    dens = (n[:, :su].square().sum(-1).view(bsz, updates, period).sum(-1) * 2 + period * STEP_EPS)
    dens = dens.t().reshape(updates, bsz, 1, 1)
    den_views = dens.unbind(0)
    h_views, e_views, es_views = (t.split(period, 1) for t in (factors_h, factors_e, descent))
    es_t = descent.transpose(1, 2).split(period, 2)
    h_flat, h_flat_t = _chunk_views(factors_h, updates, period)
    ga_views, gb_views = (half.split(period, 1) for half in factors_g.view(bsz, su, 2, width).unbind(2))
    n_views, y_views = n.split(period, 1), out.split(period, 1)
    fast_w2 = w2.expand(bsz, d, width).clone()  # w2^(c) [B, D, W], updated in place
    fast_w2_t = fast_w2.transpose(1, 2)
    a13 = w13
    groups = scan_groups(seq, period, updates)
    for index, (first, end) in enumerate(groups):
        t0, t1 = first * period, min(end * period, seq)
        lu = (min(end, updates) - first) * period
        ng = n[:, t0:t1]
        ngu = ng[:, :lu]
        p = torch.matmul(ng, a13.transpose(-1, -2)).split(period, 1)  # [B, C, 2W] per chunk
        nns = (torch.bmm(ng, ngu.transpose(1, 2)) * sigma).split(period, 1) if end - first > 1 else None
        gu = factors_g[:, t0:t0 + lu]
        for j, c in enumerate(range(first, end)):
            pre = p[j] if j == 0 else torch.baddbmm(p[j], nns[j], gu)
            a, g = pre.split(width, -1)
            s = F.silu(a)
            if c >= updates:  # the sequence's last chunk: read only
                if sum_partial is None:
                    _into(y_views[c], torch.bmm, s * g, fast_w2_t)
                else:  # all-reduce of the partial sums [B, C, D]
                    y_views[c].copy_(sum_partial(torch.bmm(s * g, fast_w2_t)))
                continue
            h = _into(h_views[c], torch.mul, s, g)
            y = _into(y_views[c], torch.bmm, h, fast_w2_t)
            if sum_partial is None:
                den = _into(den_views[c], torch.baddbmm, den_views[c], h_flat[c], h_flat_t[c])  # [B, 1, 1]
            else:  # one all-reduce of the partial [y, ||h||^2]: [B, C D + 1]
                whole = sum_partial(torch.cat((y.flatten(1), torch.bmm(h_flat[c], h_flat_t[c]).flatten(1)), 1))
                y = y.copy_(whole[:, :-1].view_as(y))
                den = den_views[c].add_(whole[:, -1:, None])
            e = _into(e_views[c], torch.div, n_views[c] - y, den)
            dh = torch.bmm(e, fast_w2)  # E_c w2^(c) [B, C, W]
            _into(es_views[c], torch.mul, e, sigma)
            _into(fast_w2, torch.baddbmm, fast_w2, es_t[c], h)  # w2^(c + 1)
            _into(ga_views[c], _silu_grad, dh * g, a)
            _into(gb_views[c], torch.mul, dh, s)
        if lu and (index < len(groups) - 1 or send_end):  # the next group's start weights
            a13 = torch.baddbmm(a13, gu.transpose(1, 2), ngu * sigma)
    return out, (a13, fast_w2), (factors_g, factors_e, factors_h, dens)


def _backward(saved, period, sum_partial, send_end, gout, g13, g2):
    n, w13, w2, sigma, factors_g, factors_e, factors_h, dens = saved
    bsz, seq, d = n.shape
    width = w2.shape[-1]
    chunks = -(-seq // period)
    updates = chunks if send_end else chunks - 1
    groups = scan_groups(seq, period, updates)
    descent, sh = factors_e * sigma, factors_h * sigma  # sigma E, sigma H [B, Su, X]
    es_views, sh_views, h_views = (t.split(period, 1) for t in (descent, sh, factors_h))
    es_t = descent.transpose(1, 2).split(period, 2)
    starts = [(w13, w2)]  # every group's start weights, as the forward made them
    for index, (first, end) in enumerate(groups):
        t0, t1 = first * period, min(end, updates) * period
        a13, a2 = starts[-1]
        a13 = torch.baddbmm(a13, factors_g[:, t0:t1].transpose(1, 2), n[:, t0:t1] * sigma) \
            if index < len(groups) - 1 else None
        starts.append((a13, torch.baddbmm(a2, descent[:, t0:t1].transpose(1, 2), factors_h[:, t0:t1])))
    fast_w2 = starts.pop()[1]  # w2 at the end [B, D, W], taken back to w2^(c) chunk by chunk
    fast_w2_t = fast_w2.transpose(1, 2)
    gw2 = torch.zeros_like(fast_w2) if g2 is None else g2.clone()  # adjoint of w2^(c + 1) [B, D, W]
    gw2_t = gw2.transpose(1, 2)
    gn, gsig, masks = [], [], {}
    for (first, end), (a13, a2) in zip(reversed(groups), reversed(starts)):
        t0, t1 = first * period, min(end * period, seq)
        ku = min(end, updates) - first
        lu, length = ku * period, t1 - t0
        ng, gy = n[:, t0:t1], gout[:, t0:t1]
        ngu = ng[:, :lu]
        gu, eu, hu = factors_g[:, t0:t0 + lu], factors_e[:, t0:t0 + lu], factors_h[:, t0:t0 + lu]
        den = dens[first:first + ku].permute(1, 0, 2, 3)  # [B, Ku, 1, 1]
        # the group's state-independent terms, all chunks at once
        if (length, lu) not in masks:
            masks[length, lu] = _group_mask(length, lu, period, n)
        mask = masks[length, lu]
        nn = torch.bmm(ng, ngu.transpose(1, 2))  # [B, L, Lu]
        nns = nn * sigma
        pre = torch.baddbmm(torch.matmul(ng, a13.transpose(-1, -2)), nns * mask, gu)
        a, g = pre.split(width, -1)
        sig = torch.sigmoid(a)
        s = a * sig
        h_all = s * g
        qa = _silu_grad(g, a)
        dh = torch.matmul(eu, a2) + torch.bmm(torch.bmm(eu, descent[:, t0:t0 + lu].transpose(1, 2)) * mask[:lu], hu)
        au, sigu = a[:, :lu], sig[:, :lu]
        r1 = _silu_grad(dh, au)
        # dh g silu''(a), silu''(a) = sig (1 - sig) (2 + a (1 - 2 sig))
        r2 = torch.ops.aten.sigmoid_backward(dh * g[:, :lu] * (au * torch.rsub(sigu, 1, alpha=2) + 2), sigu)
        hd = (hu.view(bsz, ku, period, width) / den).view(bsz, lu, width)
        if g13 is None:  # adjoint of G from the group's end weights
            gf = torch.zeros_like(gu)
        else:
            x = torch.bmm(ngu, g13.transpose(1, 2))  # [B, Lu, 2W]
            gf = x * sigma
            gsig.append((gu * x).sum())
        # the reverse loop's buffers; rows of [a, g]'s adjoint of chunks not yet run are zero
        pbar = n.new_zeros(bsz, length, 2 * width)
        pa_views, pg_views = (half.split(period, 1) for half in pbar.view(bsz, length, 2, width).unbind(2))
        hdh = n.new_empty(bsz, ku, 2 * period, width)  # per chunk [H_c; adjoint of dh_c]
        hdh[:, :, :period] = hu.view(bsz, ku, period, width)
        yte = n.new_empty(bsz, ku, 2 * period, d)  # per chunk [adjoint of y_c; E_c]
        yte[:, :, period:] = eu.view(bsz, ku, period, d)
        hdh_v, yte_t = hdh.unbind(1), yte.transpose(2, 3).unbind(1)
        dh_v, yt_v = hdh[:, :, period:].unbind(1), yte[:, :, :period].unbind(1)
        ebar_all = n.new_empty(bsz, lu, d)
        ebar_flat, _ = _chunk_views(ebar_all, ku, period)
        _, e_flat_t = _chunk_views(eu, ku, period)
        esp_all = n.new_empty(bsz, lu, d)
        ip_all = n.new_empty(ku, bsz, 1, 1)
        views = [t.split(period, 1) for t in (nns.transpose(1, 2), gf, qa, s, r1, r2, hd, gy, ebar_all, esp_all)]
        (nns_t, gf_v, qa_v, s_v, r1_v, r2_v, hd_v, gy_v, ebar_v, esp_v) = views
        ip_v, den_v = ip_all.unbind(0), dens[first:first + ku].unbind(0)
        for j, c in reversed(list(enumerate(range(first, end)))):
            if c >= updates:  # the read-only last chunk: y = h w2^T
                hbar = torch.bmm(gy_v[j], fast_w2)
                _into(gw2, torch.baddbmm, gw2, gy_v[j].transpose(1, 2), h_all[:, lu:])
                _into(pa_views[j], torch.mul, hbar, qa_v[j])
                _into(pg_views[j], torch.mul, hbar, s_v[j])
                continue
            _into(fast_w2, torch.baddbmm, fast_w2, es_t[c], h_views[c], alpha=-1)  # w2^(c)
            gbar = torch.baddbmm(gf_v[j], nns_t[j], pbar)  # adjoint of G_c, from the later chunks' reads
            gba, gbb = gbar.split(width, -1)
            esp = _into(esp_v[j], torch.bmm, sh_views[c], gw2_t)  # sigma x adjoint of sigma E_c
            hp = torch.bmm(es_views[c], gw2)  # adjoint of H_c from w2^(c + 1)
            dbar = _into(dh_v[j], torch.addcmul, gba * qa_v[j], gbb, s_v[j])
            ebar = _into(ebar_v[j], torch.baddbmm, esp, dbar, fast_w2_t)  # adjoint of E_c
            ip = _into(ip_v[j], torch.bmm, ebar_flat[j], e_flat_t[j])  # <adjoint of E_c, E_c> [B, 1, 1]
            if sum_partial is not None:  # one all-reduce of the partial adjoints of y and ||h||^2: [B, C D + 1]
                whole = sum_partial(torch.cat((ebar.flatten(1), ip.flatten(1)), 1))
                ebar, ip = whole[:, :-1].view_as(ebar), whole[:, -1:, None]
            yt = _into(yt_v[j], torch.addcdiv, gy_v[j], ebar, den_v[j], value=-1)  # whole adjoint of y_c
            hbar = torch.baddbmm(hp, yt, fast_w2).addcmul_(ip, hd_v[j], value=-2)
            _into(pa_views[j], torch.addcmul, torch.addcmul(hbar * qa_v[j], gbb, r1_v[j]), gba, r2_v[j])
            _into(pg_views[j], torch.addcmul, hbar * s_v[j], gba, r1_v[j])
            _into(gw2, torch.baddbmm, gw2, yte_t[j], hdh_v[j])  # + the reads of w2^(c)
        # the group's reads of its start weights and of n, all chunks at once
        m = torch.bmm(pbar, gu.transpose(1, 2)) * mask  # adjoint of sigma n n_u^T [B, L, Lu]
        gsig.append((m * nn).sum())
        gsig.append((esp_all * eu).sum() / sigma)
        m = m * sigma
        # r_c = n_c - y_c and den_c's 2 ||n_t||^2: (E_c's adjoint - 4 n <E_c's adjoint, E_c>) / den_c
        direct = torch.addcmul(ebar_all.view(bsz, ku, period, d), ngu.view(bsz, ku, period, d),
                               ip_all.permute(1, 0, 2, 3), value=-4) / den
        direct = torch.baddbmm(direct.view(bsz, lu, d), m.transpose(1, 2), ng)
        if g13 is not None:
            direct = direct.baddbmm_(gu, g13 * sigma)
        gn_group = torch.baddbmm(torch.matmul(pbar, a13), m, ngu)
        gn_group[:, :lu].add_(direct)
        gn.append(gn_group)
        g13_start = torch.bmm(pbar.transpose(1, 2), ng)
        g13 = g13_start if g13 is None else g13_start + g13
    gw13 = g13.sum(0) if w13.dim() == 2 else g13
    return torch.cat(gn[::-1], 1), gw13, gw2.sum(0) if w2.dim() == 2 else gw2, sum(gsig).reshape(1)


class _OnlineScan(torch.autograd.Function):
    """online_scan with its hand-written backward; runs in the promoted dtype of n and the weights
    with autocast off (fp32 under bf16 autocast: the fast weights accumulate many small updates)."""

    @staticmethod
    def forward(ctx, n, w13, w2, step, period, sum_partial, send_end):
        with torch.autocast(n.device.type, enabled=False):
            dtype = torch.promote_types(n.dtype, w13.dtype)
            inputs = [t.to(dtype) for t in (n, w13, w2, step)]
            out, ends, factors = _forward(*inputs, period, sum_partial, send_end)
        ctx.save_for_backward(*inputs, *factors)
        ctx.meta = (period, sum_partial, send_end, [t.dtype for t in (n, w13, w2, step)])
        return (out, *ends) if send_end else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gout, g13=None, g2=None):
        period, sum_partial, send_end, dtypes = ctx.meta
        saved = ctx.saved_tensors
        with torch.autocast(gout.device.type, enabled=False):
            grads = _backward(saved, period, sum_partial, send_end, gout.to(saved[0].dtype),
                              None if g13 is None else g13.to(saved[0].dtype),
                              None if g2 is None else g2.to(saved[0].dtype))
        return (*(g.to(dt) for g, dt in zip(grads, dtypes)), None, None, None)
