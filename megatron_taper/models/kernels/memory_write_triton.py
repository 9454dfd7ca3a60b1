"""Triton kernels for the chunk loops of the Titans / deep-memory write loop (models/titans/neural_memory.py
WriteLoop), for memories of depth 1 and 2 (CUDA, or CPU under TRITON_INTERPRET=1).

Forward: one program per (batch x head) row loops over the N chunks, as flash-linear-attention's
chunk kernels do, and computes per chunk exactly what neural_memory.write_chunk computes from the
chunk's starting state (W_l, S_l) and its terms (neural_memory.chunk_terms):
    z = k W_1, a = silu(z) (depth 2),  h = f(k),  nu = ||k||^2 + ||a||^2,  error = 2 (k - v) + 2 h
    delta'_n = (theta / nu) error,  delta'_1 = (delta'_2 W_2^T) silu'(z) (depth 2)
    W_l' = W_0l + B_C (W_l - W_0l) + D_C S_l + U_l delta'_l,   S_l' = E_C S_l + V_l delta'_l
with U_1, V_1 the first layer's factors -(last * k)^T, -(E_C / E * k)^T and U_2, V_2 = a^T * -last,
a^T * -E_C / E. It stores every output of WriteLoop.forward (the starting weights and surprise of
every chunk, delta' per layer, the hidden inputs a, the final state when every chunk writes) and
what its backward keeps (z, delta'_2 W_2^T, error, nu).

Backward: the reverse loop of neural_memory.reverse_loop (the chunk loop of write_loop_backward;
the batched work before and after it stays torch), one program per row from the last chunk to the
first, carrying the gradients of the state (gW_l, gS_l): per chunk, from the stored outputs and
the gradients of the forward's outputs, the gradients of delta', of the hidden inputs, of f(k), of
theta / nu, of nu and of z, and the gradients of the state before the chunk,
    gW_l <- gW_l(out) + B_C gW_l + (the chunk's own uses of W_l),   gS_l <- gS_l(out) + E_C gS_l + D_C gW_l
(a chunk that does not write passes them on unchanged). It stores the gradients of the state
after every chunk (write_grads takes the factors' gradients from them) and before the first.

Neither holds the state in registers (a depth-2 memory at E = 128 is 4 x 128 x 256 numbers): chunk
c's state (its gradient) is read from the per-chunk output where the previous chunk of the loop
stored it, and the next one's written there (the last one's into the final state / the starting
state's gradient), a hidden-width tile of BT columns of W_1 and rows of W_2 at a time (depth 1: BT
output columns of W), with a block barrier between chunks. So what is passed on between chunks is
rounded to the input dtype, as in the torch loops. Every product and sum is computed in float32
(float64 for float64 inputs; tl.dot with input_precision="ieee", no TF32), the outputs stored in
the input dtype. Sizes: E and the hidden width need not be powers of two, nor the chunk C (blocks
are padded to powers of two >= 16 and masked).

Depths other than 1 and 2 keep the torch loops (neural_memory.write_kernel_handles). Under autocast
the kernels run as outside it, on the terms' dtype: the torch loops keep the state in its dtype and
run the matmuls in bf16; the kernels keep the state in its dtype too and run them in float32.
This module imports triton at the top: neural_memory.py imports it only when the kernels are chosen.
Block sizes are fixed (no autotuning, so the interpreter runs as is). Tested under the interpreter
only (tests/models/test_memory_write_triton.py), and compiled for sm_90 there; not yet run on a GPU.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_TILE = 64


@triton.jit
def _write_fwd_kernel(
        init1_ptr, init2_ptr, w1_in_ptr, w2_in_ptr, s1_in_ptr, s2_in_ptr,
        k_ptr, kk_ptr, theta_ptr, kv2_ptr, klast_ptr, kscale_ptr, keep_ptr, decay_ptr, eta_ptr, mlast_ptr, mscale_ptr,
        w1_ptr, w2_ptr, s1_ptr, s2_ptr, d1_ptr, d2_ptr, act_ptr, pre_ptr, prod_ptr, err_ptr, nu_ptr,
        w1_end_ptr, w2_end_ptr, s1_end_ptr, s2_end_ptr,
        N, LAST,
        E: tl.constexpr, HID: tl.constexpr, C: tl.constexpr, EP: tl.constexpr, CP: tl.constexpr,
        BT: tl.constexpr, DEPTH: tl.constexpr, ACC: tl.constexpr):
    # per row bh: init*/ *_in/ *_end [i, o]; k, kv2, err [N, C, E]; kk, theta, nu [N, C]; klast, kscale [N, E, C];
    # keep, decay, eta [N]; mlast, mscale [N, C]; w*, s* [N, i, o]; d1 [N, C, HID]; d2 [N, C, E];
    # act, pre, prod [N, C, HID]; all contiguous. Depth 1: HID = E and the *1 pointers hold the one layer.
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, CP)
    rmask = rows < C
    feats = tl.arange(0, EP)
    fmask = feats < E
    tile = tl.arange(0, BT)
    out_ty = w1_ptr.dtype.element_ty
    size1 = E * HID  # numbers in W_1 (and W_2)
    for t in range(0, HID, BT):  # chunk 0 starts from the given state
        cols = t + tile
        m1 = fmask[:, None] & (cols[None, :] < HID)
        o1 = feats[:, None] * HID + cols[None, :]  # [EP, BT] in W_1 [E, HID]
        tl.store(w1_ptr + bh * N * size1 + o1, tl.load(w1_in_ptr + bh * size1 + o1, mask=m1), mask=m1)
        tl.store(s1_ptr + bh * N * size1 + o1, tl.load(s1_in_ptr + bh * size1 + o1, mask=m1), mask=m1)
        if DEPTH == 2:
            m2 = (cols[:, None] < HID) & fmask[None, :]
            o2 = cols[:, None] * E + feats[None, :]  # [BT, EP] in W_2 [HID, E]
            tl.store(w2_ptr + bh * N * size1 + o2, tl.load(w2_in_ptr + bh * size1 + o2, mask=m2), mask=m2)
            tl.store(s2_ptr + bh * N * size1 + o2, tl.load(s2_in_ptr + bh * size1 + o2, mask=m2), mask=m2)
    tl.debug_barrier()
    for c in range(N):
        chunk = bh * N + c  # int64
        here, after = chunk * size1, (chunk + 1) * size1  # the state of this chunk and of the next in w*, s*
        more = chunk + 1 < (bh + 1) * N  # c + 1 < N; else the next state is the final one (*_end)
        w1_next = tl.where(more, w1_ptr + after, w1_end_ptr + bh * size1)
        s1_next = tl.where(more, s1_ptr + after, s1_end_ptr + bh * size1)
        w2_next = tl.where(more, w2_ptr + after, w2_end_ptr + bh * size1)
        s2_next = tl.where(more, s2_ptr + after, s2_end_ptr + bh * size1)
        rc = rows[:, None] * E + feats[None, :]  # [CP, EP] in [C, E]
        mc = rmask[:, None] & fmask[None, :]
        k = tl.load(k_ptr + chunk * C * E + rc, mask=mc, other=0.0).to(ACC)
        kk = tl.load(kk_ptr + chunk * C + rows, mask=rmask, other=1.0).to(ACC)
        theta = tl.load(theta_ptr + chunk * C + rows, mask=rmask, other=0.0).to(ACC)
        write = c < LAST
        keep = tl.load(keep_ptr + chunk).to(ACC)
        decay = tl.load(decay_ptr + chunk).to(ACC)
        eta = tl.load(eta_ptr + chunk).to(ACC)
        rt = feats[:, None] * C + rows[None, :]  # [EP, CP] in [E, C]
        mt = fmask[:, None] & rmask[None, :]
        k_last = tl.load(klast_ptr + chunk * E * C + rt, mask=mt, other=0.0).to(ACC)
        k_scale = tl.load(kscale_ptr + chunk * E * C + rt, mask=mt, other=0.0).to(ACC)
        if DEPTH == 1:
            ratio = theta / kk
            for t in range(0, E, BT):  # output columns of W [E, E]
                cols = t + tile
                m1 = fmask[:, None] & (cols[None, :] < E)
                o1 = feats[:, None] * E + cols[None, :]
                w = tl.load(w1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                mo = rmask[:, None] & (cols[None, :] < E)
                ro = rows[:, None] * E + cols[None, :]
                error = tl.load(kv2_ptr + chunk * C * E + ro, mask=mo, other=0.0).to(ACC)
                error += 2.0 * tl.dot(k, w, input_precision="ieee", out_dtype=ACC)
                delta = error * ratio[:, None]
                tl.store(err_ptr + chunk * C * E + ro, error.to(out_ty), mask=mo)
                tl.store(d1_ptr + chunk * C * E + ro, delta.to(out_ty), mask=mo)
                if write:
                    init = tl.load(init1_ptr + bh * size1 + o1, mask=m1, other=0.0).to(ACC)
                    s = tl.load(s1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                    w_new = init + keep * (w - init) + decay * s + tl.dot(k_last, delta, input_precision="ieee",
                                                                          out_dtype=ACC)
                    s_new = eta * s + tl.dot(k_scale, delta, input_precision="ieee", out_dtype=ACC)
                    tl.store(w1_next + o1, w_new.to(out_ty), mask=m1)
                    tl.store(s1_next + o1, s_new.to(out_ty), mask=m1)
            tl.store(nu_ptr + chunk * C + rows, kk.to(out_ty), mask=rmask)
        else:
            h = tl.zeros((CP, EP), dtype=ACC)
            nu = kk
            for t in range(0, HID, BT):  # the memory MLP on the keys, BT hidden units at a time
                cols = t + tile
                m1 = fmask[:, None] & (cols[None, :] < HID)
                w1 = tl.load(w1_ptr + here + feats[:, None] * HID + cols[None, :], mask=m1, other=0.0).to(ACC)
                z = tl.dot(k, w1, input_precision="ieee", out_dtype=ACC)  # [CP, BT]
                a = z * tl.sigmoid(z)
                mh = rmask[:, None] & (cols[None, :] < HID)
                rh = rows[:, None] * HID + cols[None, :]
                tl.store(pre_ptr + chunk * C * HID + rh, z.to(out_ty), mask=mh)
                tl.store(act_ptr + chunk * C * HID + rh, a.to(out_ty), mask=mh)
                nu += tl.sum(a * a, axis=1)
                m2 = (cols[:, None] < HID) & fmask[None, :]
                w2 = tl.load(w2_ptr + here + cols[:, None] * E + feats[None, :], mask=m2, other=0.0).to(ACC)
                h += tl.dot(a, w2, input_precision="ieee", out_dtype=ACC)
            error = tl.load(kv2_ptr + chunk * C * E + rc, mask=mc, other=0.0).to(ACC) + 2.0 * h
            delta2 = error * (theta / nu)[:, None]  # [CP, EP]
            tl.store(err_ptr + chunk * C * E + rc, error.to(out_ty), mask=mc)
            tl.store(nu_ptr + chunk * C + rows, nu.to(out_ty), mask=rmask)
            tl.store(d2_ptr + chunk * C * E + rc, delta2.to(out_ty), mask=mc)
            m_last = tl.load(mlast_ptr + chunk * C + rows, mask=rmask, other=0.0).to(ACC)
            m_scale = tl.load(mscale_ptr + chunk * C + rows, mask=rmask, other=0.0).to(ACC)
            for t in range(0, HID, BT):  # delta'_1 and the writes, BT hidden units at a time
                cols = t + tile
                m1 = fmask[:, None] & (cols[None, :] < HID)
                o1 = feats[:, None] * HID + cols[None, :]  # [EP, BT] in W_1
                m2 = (cols[:, None] < HID) & fmask[None, :]
                o2 = cols[:, None] * E + feats[None, :]  # [BT, EP] in W_2
                w1 = tl.load(w1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                w2 = tl.load(w2_ptr + here + o2, mask=m2, other=0.0).to(ACC)
                z = tl.dot(k, w1, input_precision="ieee", out_dtype=ACC)  # as in the loop above
                sig = tl.sigmoid(z)
                a = z * sig
                prod = tl.dot(delta2, tl.trans(w2), input_precision="ieee", out_dtype=ACC)  # [CP, BT]
                delta1 = prod * (sig + a * (1.0 - sig))  # silu'(z)
                mh = rmask[:, None] & (cols[None, :] < HID)
                rh = rows[:, None] * HID + cols[None, :]
                tl.store(prod_ptr + chunk * C * HID + rh, prod.to(out_ty), mask=mh)
                tl.store(d1_ptr + chunk * C * HID + rh, delta1.to(out_ty), mask=mh)
                if write:
                    init1 = tl.load(init1_ptr + bh * size1 + o1, mask=m1, other=0.0).to(ACC)
                    s1 = tl.load(s1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                    w1_new = init1 + keep * (w1 - init1) + decay * s1 + tl.dot(
                        k_last, delta1, input_precision="ieee", out_dtype=ACC)
                    s1_new = eta * s1 + tl.dot(k_scale, delta1, input_precision="ieee", out_dtype=ACC)
                    init2 = tl.load(init2_ptr + bh * size1 + o2, mask=m2, other=0.0).to(ACC)
                    s2 = tl.load(s2_ptr + here + o2, mask=m2, other=0.0).to(ACC)
                    a_t = tl.trans(a)  # [BT, CP]
                    w2_new = init2 + keep * (w2 - init2) + decay * s2 + tl.dot(
                        a_t * m_last[None, :], delta2, input_precision="ieee", out_dtype=ACC)
                    s2_new = eta * s2 + tl.dot(a_t * m_scale[None, :], delta2, input_precision="ieee", out_dtype=ACC)
                    tl.store(w1_next + o1, w1_new.to(out_ty), mask=m1)
                    tl.store(s1_next + o1, s1_new.to(out_ty), mask=m1)
                    tl.store(w2_next + o2, w2_new.to(out_ty), mask=m2)
                    tl.store(s2_next + o2, s2_new.to(out_ty), mask=m2)
        tl.debug_barrier()  # the next chunk reads the state this one wrote, from other threads


@triton.jit
def _write_bwd_kernel(
        k_ptr, klast_ptr, kscale_ptr, mlast_ptr, mscale_ptr, keep_ptr, decay_ptr, eta_ptr, theta_ptr, nu_ptr,
        err_ptr, w2_ptr, d2_ptr, act_ptr, pre_ptr, prod_ptr,
        gw1_ptr, gw2_ptr, gs1_ptr, gs2_ptr, gd1_ptr, gd2_ptr, ga_ptr,
        gw1_end_ptr, gw2_end_ptr, gs1_end_ptr, gs2_end_ptr,
        aw1_ptr, aw2_ptr, as1_ptr, as2_ptr, gw1_0_ptr, gw2_0_ptr, gs1_0_ptr, gs2_0_ptr,
        gz_ptr, gtop_ptr, gr_ptr, gnu_ptr,
        N, LAST,
        E: tl.constexpr, HID: tl.constexpr, C: tl.constexpr, EP: tl.constexpr, CP: tl.constexpr,
        BT: tl.constexpr, DEPTH: tl.constexpr, ACC: tl.constexpr):
    # per row bh, as the forward's; w2 (W_2 of every chunk) [N, HID, E], d2 (delta'_2) [N, C, E]; the gradients
    # g* of the forward's outputs as those outputs (gd1 [N, C, HID], ga [N, C, HID], g*_end [i, o]); out: the
    # gradients of the state after every chunk a* [N, i, o] (slot N - 1: g*_end), of the starting state g*_0
    # [i, o], gz [N, C, HID], gtop [N, C, E], gr, gnu [N, C]. Depth 1: HID = E and the *2 pointers are unused.
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, CP)
    rmask = rows < C
    feats = tl.arange(0, EP)
    fmask = feats < E
    tile = tl.arange(0, BT)
    out_ty = aw1_ptr.dtype.element_ty
    size1 = E * HID
    last_slot = (bh * N + N - 1) * size1
    for t in range(0, HID, BT):  # the gradient of the state after the last chunk
        cols = t + tile
        m1 = fmask[:, None] & (cols[None, :] < HID)
        o1 = feats[:, None] * HID + cols[None, :]
        tl.store(aw1_ptr + last_slot + o1, tl.load(gw1_end_ptr + bh * size1 + o1, mask=m1), mask=m1)
        tl.store(as1_ptr + last_slot + o1, tl.load(gs1_end_ptr + bh * size1 + o1, mask=m1), mask=m1)
        if DEPTH == 2:
            m2 = (cols[:, None] < HID) & fmask[None, :]
            o2 = cols[:, None] * E + feats[None, :]
            tl.store(aw2_ptr + last_slot + o2, tl.load(gw2_end_ptr + bh * size1 + o2, mask=m2), mask=m2)
            tl.store(as2_ptr + last_slot + o2, tl.load(gs2_end_ptr + bh * size1 + o2, mask=m2), mask=m2)
    tl.debug_barrier()
    for i in range(N):
        c = N - 1 - i
        chunk = bh * N + c  # int64
        here = chunk * size1
        first = chunk == bh * N  # c == 0: the gradient before it is the starting state's (g*_0)
        w1_next = tl.where(first, gw1_0_ptr + bh * size1, aw1_ptr + (here - size1))
        s1_next = tl.where(first, gs1_0_ptr + bh * size1, as1_ptr + (here - size1))
        w2_next = tl.where(first, gw2_0_ptr + bh * size1, aw2_ptr + (here - size1))
        s2_next = tl.where(first, gs2_0_ptr + bh * size1, as2_ptr + (here - size1))
        write = c < LAST  # else W' = W, S' = S: no factor terms (zeroed), keep = eta = 1, decay = 0
        on = tl.where(write, 1.0, 0.0).to(ACC)
        keep = tl.where(write, tl.load(keep_ptr + chunk).to(ACC), 1.0)
        decay = tl.where(write, tl.load(decay_ptr + chunk).to(ACC), 0.0)
        eta = tl.where(write, tl.load(eta_ptr + chunk).to(ACC), 1.0)
        rc = rows[:, None] * E + feats[None, :]  # [CP, EP] in [C, E]
        mc = rmask[:, None] & fmask[None, :]
        k = tl.load(k_ptr + chunk * C * E + rc, mask=mc, other=0.0).to(ACC)
        rt = feats[None, :] * C + rows[:, None]  # [CP, EP] in [E, C]: the factors transposed
        u1 = tl.load(klast_ptr + chunk * E * C + rt, mask=mc, other=0.0).to(ACC) * on
        v1 = tl.load(kscale_ptr + chunk * E * C + rt, mask=mc, other=0.0).to(ACC) * on
        theta = tl.load(theta_ptr + chunk * C + rows, mask=rmask, other=0.0).to(ACC)
        nu = tl.load(nu_ptr + chunk * C + rows, mask=rmask, other=1.0).to(ACC)
        ratio = theta / nu
        r2 = 2.0 * ratio
        negrn = -ratio / nu
        if DEPTH == 1:
            gr = tl.zeros((CP,), dtype=ACC)
            for t in range(0, E, BT):  # output columns of W [E, E]
                cols = t + tile
                m1 = fmask[:, None] & (cols[None, :] < E)
                o1 = feats[:, None] * E + cols[None, :]
                mo = rmask[:, None] & (cols[None, :] < E)
                ro = rows[:, None] * E + cols[None, :]
                gw = tl.load(aw1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                gs = tl.load(as1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                gd = tl.load(gd1_ptr + chunk * C * E + ro, mask=mo, other=0.0).to(ACC)
                gd += tl.dot(u1, gw, input_precision="ieee", out_dtype=ACC)
                gd += tl.dot(v1, gs, input_precision="ieee", out_dtype=ACC)
                gh = gd * r2[:, None]
                error = tl.load(err_ptr + chunk * C * E + ro, mask=mo, other=0.0).to(ACC)
                gr += tl.sum(gd * error, axis=1)
                tl.store(gtop_ptr + chunk * C * E + ro, gh.to(out_ty), mask=mo)
                tl.store(gz_ptr + chunk * C * E + ro, gh.to(out_ty), mask=mo)
                w_new = tl.load(gw1_ptr + here + o1, mask=m1, other=0.0).to(ACC) + keep * gw + tl.dot(
                    tl.trans(k), gh, input_precision="ieee", out_dtype=ACC)
                s_new = tl.load(gs1_ptr + here + o1, mask=m1, other=0.0).to(ACC) + eta * gs + decay * gw
                tl.store(w1_next + o1, w_new.to(out_ty), mask=m1)
                tl.store(s1_next + o1, s_new.to(out_ty), mask=m1)
        else:
            m_last = tl.load(mlast_ptr + chunk * C + rows, mask=rmask, other=0.0).to(ACC) * on
            m_scale = tl.load(mscale_ptr + chunk * C + rows, mask=rmask, other=0.0).to(ACC) * on
            d2 = tl.load(d2_ptr + chunk * C * E + rc, mask=mc, other=0.0).to(ACC)
            g2 = tl.load(gd2_ptr + chunk * C * E + rc, mask=mc, other=0.0).to(ACC)  # d delta'_2, completed below
            for t in range(0, HID, BT):  # d delta'_2 from delta'_1 = (delta'_2 W_2^T) silu'(z) and the writes
                cols = t + tile
                m1 = fmask[:, None] & (cols[None, :] < HID)
                o1 = feats[:, None] * HID + cols[None, :]  # [EP, BT] in W_1 [E, HID]
                m2 = (cols[:, None] < HID) & fmask[None, :]
                o2 = cols[:, None] * E + feats[None, :]  # [BT, EP] in W_2 [HID, E]
                mh = rmask[:, None] & (cols[None, :] < HID)
                rh = rows[:, None] * HID + cols[None, :]  # [CP, BT] in [C, HID]
                a = tl.load(act_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)
                sig = tl.sigmoid(tl.load(pre_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC))
                g1 = tl.load(gd1_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)
                g1 += tl.dot(u1, tl.load(aw1_ptr + here + o1, mask=m1, other=0.0).to(ACC), input_precision="ieee",
                             out_dtype=ACC)
                g1 += tl.dot(v1, tl.load(as1_ptr + here + o1, mask=m1, other=0.0).to(ACC), input_precision="ieee",
                             out_dtype=ACC)
                gp = g1 * (sig + a * (1.0 - sig))
                w2 = tl.load(w2_ptr + here + o2, mask=m2, other=0.0).to(ACC)
                g2 += tl.dot(gp, w2, input_precision="ieee", out_dtype=ACC)
                g2 += tl.dot(a * m_last[:, None], tl.load(aw2_ptr + here + o2, mask=m2, other=0.0).to(ACC),
                             input_precision="ieee", out_dtype=ACC)
                g2 += tl.dot(a * m_scale[:, None], tl.load(as2_ptr + here + o2, mask=m2, other=0.0).to(ACC),
                             input_precision="ieee", out_dtype=ACC)
            gh = g2 * r2[:, None]  # d f(k)
            error = tl.load(err_ptr + chunk * C * E + rc, mask=mc, other=0.0).to(ACC)
            gr = tl.sum(g2 * error, axis=1)
            gnu = gr * negrn
            tl.store(gtop_ptr + chunk * C * E + rc, gh.to(out_ty), mask=mc)
            dml, dms = d2 * m_last[:, None], d2 * m_scale[:, None]
            for t in range(0, HID, BT):  # the gradients of z, W_1, W_2 and the state before the chunk
                cols = t + tile
                m1 = fmask[:, None] & (cols[None, :] < HID)
                o1 = feats[:, None] * HID + cols[None, :]
                m2 = (cols[:, None] < HID) & fmask[None, :]
                o2 = cols[:, None] * E + feats[None, :]
                mh = rmask[:, None] & (cols[None, :] < HID)
                rh = rows[:, None] * HID + cols[None, :]
                a = tl.load(act_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)
                z = tl.load(pre_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)
                sig = tl.sigmoid(z)
                slope = sig + a * (1.0 - sig)
                gw1 = tl.load(aw1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                gs1 = tl.load(as1_ptr + here + o1, mask=m1, other=0.0).to(ACC)
                gw2 = tl.load(aw2_ptr + here + o2, mask=m2, other=0.0).to(ACC)
                gs2 = tl.load(as2_ptr + here + o2, mask=m2, other=0.0).to(ACC)
                w2 = tl.load(w2_ptr + here + o2, mask=m2, other=0.0).to(ACC)
                g1 = tl.load(gd1_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)  # as in the loop above
                g1 += tl.dot(u1, gw1, input_precision="ieee", out_dtype=ACC)
                g1 += tl.dot(v1, gs1, input_precision="ieee", out_dtype=ACC)
                gp = g1 * slope
                w2_new = tl.load(gw2_ptr + here + o2, mask=m2, other=0.0).to(ACC) + keep * gw2
                w2_new += tl.dot(tl.trans(gp), d2, input_precision="ieee", out_dtype=ACC)
                w2_new += tl.dot(tl.trans(a), gh, input_precision="ieee", out_dtype=ACC)
                s2_new = tl.load(gs2_ptr + here + o2, mask=m2, other=0.0).to(ACC) + eta * gs2 + decay * gw2
                ga = tl.load(ga_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)
                ga += tl.dot(dml, tl.trans(gw2), input_precision="ieee", out_dtype=ACC)
                ga += tl.dot(dms, tl.trans(gs2), input_precision="ieee", out_dtype=ACC)
                ga += tl.dot(gh, tl.trans(w2), input_precision="ieee", out_dtype=ACC)
                ga += 2.0 * a * gnu[:, None]
                prod = tl.load(prod_ptr + chunk * C * HID + rh, mask=mh, other=0.0).to(ACC)
                curv = prod * (sig - sig * sig) * (2.0 + z * (1.0 - 2.0 * sig))  # P silu''(z)
                gz = ga * slope + g1 * curv
                tl.store(gz_ptr + chunk * C * HID + rh, gz.to(out_ty), mask=mh)
                w1_new = tl.load(gw1_ptr + here + o1, mask=m1, other=0.0).to(ACC) + keep * gw1 + tl.dot(
                    tl.trans(k), gz, input_precision="ieee", out_dtype=ACC)
                s1_new = tl.load(gs1_ptr + here + o1, mask=m1, other=0.0).to(ACC) + eta * gs1 + decay * gw1
                tl.store(w1_next + o1, w1_new.to(out_ty), mask=m1)
                tl.store(s1_next + o1, s1_new.to(out_ty), mask=m1)
                tl.store(w2_next + o2, w2_new.to(out_ty), mask=m2)
                tl.store(s2_next + o2, s2_new.to(out_ty), mask=m2)
        tl.store(gr_ptr + chunk * C + rows, gr.to(out_ty), mask=rmask)
        tl.store(gnu_ptr + chunk * C + rows, (gr * negrn).to(out_ty), mask=rmask)
        tl.debug_barrier()  # the next (earlier) chunk reads the state's gradient this one wrote


def _pad(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


def _on_device(t: torch.Tensor):
    """Launch on the tensors' GPU (triton launches on the current CUDA device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def write_loop_triton(n: int, last: int, init: list[torch.Tensor], weights: list[torch.Tensor],
                      surprise: list[torch.Tensor], terms: tuple[torch.Tensor, ...]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """WriteLoop.forward's loop for n = 1 or 2 memory layers, the first `last` chunks writing, with
    the kernel: (outputs: per layer the starting weights, then surprise, of every chunk [B*H, N, i, o],
    delta' [B*H, N, C, o], the hidden inputs [B*H, N, C, i]; what the backward keeps: the hidden
    pre-activations and delta'_2 W_2^T [B*H, N, C, i], error [B*H, N, C, E], nu [B*H, N, C, 1]; the
    final weights and surprise [B*H, i, o] when every chunk writes, else []). init, weights, surprise
    per layer [B*H, i, o]; terms as chunk_terms' loop terms [B*H, N, ...]."""
    assert n in (1, 2), n
    k = terms[0]
    flat, count, size, dim = k.shape
    hidden = weights[0].shape[-1]
    dtype = k.dtype
    args = [t.to(dtype).contiguous() for t in (*init, *weights, *surprise, *terms)]
    init_c, w_in, s_in, (k_c, kk, theta, kv2, k_last, k_scale, keep, decay, eta, *deep) = (
        args[:n], args[n:2 * n], args[2 * n:3 * n], args[3 * n:])

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(flat, *shape, dtype=dtype, device=k.device)

    starts = [empty(count, *w.shape[1:]) for w in weights] + [empty(count, *s.shape[1:]) for s in surprise]
    ends = [empty(*w.shape[1:]) for w in weights] + [empty(*s.shape[1:]) for s in surprise]
    deltas = [empty(count, size, w.shape[-1]) for w in weights]
    hidden_rows = [empty(count, size, hidden) for _ in range(3 * (n - 1))]  # a, z, delta'_2 W_2^T
    error, nu = empty(count, size, dim), empty(count, size, 1)
    act, pre, prod = hidden_rows if n == 2 else (error,) * 3  # depth 1: [-1] is the one layer, all unused
    m_last, m_scale = deep if n == 2 else (keep, keep)
    w_out, s_out, w_end, s_end = starts[:n], starts[n:], ends[:n], ends[n:]
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    with _on_device(k):
        _write_fwd_kernel[(flat,)](
            init_c[0], init_c[-1], w_in[0], w_in[-1], s_in[0], s_in[-1],
            k_c, kk, theta, kv2, k_last, k_scale, keep, decay, eta, m_last, m_scale,
            w_out[0], w_out[-1], s_out[0], s_out[-1], deltas[0], deltas[-1], act, pre, prod, error, nu,
            w_end[0], w_end[-1], s_end[0], s_end[-1],
            count, last, E=dim, HID=hidden, C=size, EP=_pad(dim), CP=_pad(size),
            BT=min(MAX_TILE, _pad(hidden)), DEPTH=n, ACC=acc, num_warps=4)
    outputs = starts + deltas + ([act] if n == 2 else [])
    kept = ([pre, prod] if n == 2 else []) + [error, nu]
    return outputs, kept, ends if last == count else []


def write_loop_backward_triton(n: int, last: int, terms: tuple[torch.Tensor, ...], ws: tuple[torch.Tensor, ...],
                               ds: tuple[torch.Tensor, ...], acts: tuple[torch.Tensor, ...],
                               pre: tuple[torch.Tensor, ...], prods: tuple[torch.Tensor, ...], error: torch.Tensor,
                               nu: torch.Tensor, grads: tuple[torch.Tensor, ...]
                               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                          list[torch.Tensor]]:
    """The reverse chunk loop of neural_memory.write_loop_backward for n = 1 or 2 layers with the
    kernel: from the write terms (k, theta, -(last * k)^T, -(E_C / E * k)^T, B_C, D_C, E_C and when
    deeper -last, -E_C / E), WriteLoop's outputs and saved tensors [B*H, N, ...] and the gradients of
    its outputs -> (the gradients of z_1 = k W_1 (of f(k) at depth 1), nu, theta / nu and f(k) per
    chunk [B*H, N, C, .]; of the starting weights and surprise per layer [B*H, i, o]; of the state
    after each writing chunk per layer, weights then surprise [B*H, last, i, o])."""
    assert n in (1, 2), n
    k, theta, k_last, k_scale, keep, decay, eta, *deep = terms
    flat, count, size, dim = k.shape
    hidden = ws[0].shape[-1]
    dtype = k.dtype

    def ready(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous()

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(flat, *shape, dtype=dtype, device=k.device)

    g_ws, g_ss, g_ds, g_as = ([ready(g) for g in grads[a:b]] for a, b in
                              ((0, n), (n, 2 * n), (2 * n, 3 * n), (3 * n, 4 * n - 1)))
    ends = ([ready(g) for g in grads[4 * n - 1:]] if last == count else
            [torch.zeros(flat, *w.shape[2:], dtype=dtype, device=k.device) for w in ws * 2])
    after = [empty(count, *w.shape[2:]) for w in ws * 2]  # weights then surprise
    start = [empty(*w.shape[2:]) for w in ws * 2]
    g_z, g_top, g_r, g_nu = empty(count, size, hidden), empty(count, size, dim), empty(count, size, 1), empty(
        count, size, 1)
    k, theta, k_last, k_scale, keep, decay, eta, nu, error = (
        ready(t) for t in (k, theta, k_last, k_scale, keep, decay, eta, nu, error))
    m_last, m_scale = (ready(t) for t in deep) if n == 2 else (keep, keep)
    w2, d2 = ready(ws[-1]), ready(ds[-1])
    act, z, prod = (ready(acts[0]), ready(pre[0]), ready(prods[0])) if n == 2 else (error,) * 3  # depth 1: unused
    with _on_device(k):
        _write_bwd_kernel[(flat,)](
            k, k_last, k_scale, m_last, m_scale, keep, decay, eta, theta, nu, error, w2, d2, act, z, prod,
            g_ws[0], g_ws[-1], g_ss[0], g_ss[-1], g_ds[0], g_ds[-1], g_as[0] if n == 2 else error,
            ends[0], ends[n - 1], ends[n], ends[-1], after[0], after[n - 1], after[n], after[-1],
            start[0], start[n - 1], start[n], start[-1], g_z, g_top, g_r, g_nu,
            count, last, E=dim, HID=hidden, C=size, EP=_pad(dim), CP=_pad(size),
            BT=min(MAX_TILE, _pad(hidden)), DEPTH=n, ACC=tl.float64 if dtype == torch.float64 else tl.float32,
            num_warps=4)
    return [g_z, g_nu, g_r, g_top], start[:n], start[n:], [t[:, :last] for t in after]
