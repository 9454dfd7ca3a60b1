"""State passing between context-parallel slices (parallel/cp/state.py) against one process.

A toy three-layer recurrent model over a [B=2, S=12, D=4] sequence, split contiguously over cp=3
ranks (4 tokens each, so the middle rank both receives and sends): a tanh RNN passed by the chain,
a causal window sum over 3 tokens taking its 2 previous rows from the halo, and a decayed sum
(s_t = a s_(t-1) + x_t) whose starting state each rank folds from the gathered summaries of the
ranks before it. The loss is a fixed weighting of the outputs; its sum over ranks is the one-process
loss, so the parameter gradients summed over ranks are the one-process gradients.

Tolerance: fp32, 1e-5 relative to the largest entry. The chain and the halo compute the forward in
the same order as one process; the prefix multiplies the incoming state by a^4 where one process
multiplies by a four times, and the gradients are sums over ranks in another order (measured:
outputs equal to the bit on ranks 0 and 1 and 1.2e-7 off on rank 2, gradients at most 2.4e-6 off
in entries of order 1).
"""
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megatron_taper.parallel.cp.split import SequenceSplit
from megatron_taper.parallel.cp.state import prefix_state, previous_rows, receive_state, send_state
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

B, S, D, WINDOW = 2, 12, 4, 3


def _inputs():
    g = torch.Generator().manual_seed(7)
    params = {"W": torch.randn(D, D, generator=g) * 0.5, "U": torch.randn(D, D, generator=g) * 0.5,
              "h0": torch.randn(D, generator=g), "alpha": torch.randn(D, generator=g)}
    return params, torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)


def _rnn(split, p, x):
    """Chain: h_t = tanh(h_(t-1) W + x_t U) from h0, passed from slice to slice."""
    initial = [p["h0"].expand(x.shape[0], D)]
    (h,) = initial if split is None else receive_state(split, 0, initial)
    outs = []
    for t in range(x.shape[1]):
        h = torch.tanh(h @ p["W"] + x[:, t] @ p["U"])
        outs.append(h)
    y = torch.stack(outs, 1)
    return y if split is None else send_state(split, 0, y, [h])


def _window(split, y):
    """Halo: z_t = y_(t-2) + y_(t-1) + y_t (zeros before the sequence)."""
    before = y.new_zeros(y.shape[0], WINDOW - 1, D) if split is None else previous_rows(split, 0, y, WINDOW - 1)
    padded = torch.cat([before, y], 1)
    return sum(padded[:, i:i + y.shape[1]] for i in range(WINDOW))


def _decayed(split, p, z):
    """Prefix: s_t = a s_(t-1) + z_t from 0, a = sigmoid(alpha) per channel."""
    a = torch.sigmoid(p["alpha"])

    def scan(s):
        outs = []
        for t in range(z.shape[1]):
            s = a * s + z[:, t]
            outs.append(s)
        return torch.stack(outs, 1), s
    start = z.new_zeros(z.shape[0], D)
    if split is not None:
        _, local_end = scan(start)
        (start,) = prefix_state(split, [start], [local_end], lambda s, end: (a ** z.shape[1] * s[0] + end[0],))
    return scan(start)[0]


def _model(split, p, x, weights, recompute):
    layers = [lambda h: _rnn(split, p, h), lambda h: _window(split, h), lambda h: _decayed(split, p, h)]
    h = x
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=False) if recompute else layer(h)
    return h, (h * weights).sum()


def _run(split, recompute):
    params, x, weights = _inputs()
    params = {k: v.requires_grad_() for k, v in params.items()}
    if split is not None:
        x, weights = split.split(x), split.split(weights)
    x.requires_grad_()
    out, loss = _model(split, params, x, weights, recompute)
    loss.backward()
    grads = {k: v.grad for k, v in params.items()}
    if split is not None:
        for g in grads.values():
            dist.all_reduce(g)
        with torch.no_grad():  # the forward alone (evaluation) passes the same state
            again, _ = _model(split, params, x, weights, False)
        assert torch.equal(again, out)
        assert not any(split.received.values())  # every kept tensor was released by its backward
    return out.detach(), x.grad, grads


def _worker():
    split = SequenceSplit(3, dist.get_rank(), dist.group.WORLD, balanced=False)
    return [_run(split, recompute) for recompute in (False, True)]


def test_chain_halo_and_prefix_match_one_process():
    """cp=3 equals one process in outputs, input gradients and summed parameter gradients, with and
    without activation checkpointing (whose recompute takes what the forward received)."""
    got = run_distributed(_worker, 3, timeout=60)
    ref_out, ref_dx, ref_grads = _run(None, False)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    for rank, per_rank in enumerate(got):
        for out, dx, grads in per_rank:
            rows = slice(rank * S // 3, (rank + 1) * S // 3)
            assert rel(out, ref_out[:, rows]) < 1e-5
            assert rel(dx, ref_dx[:, rows]) < 1e-5
            for name, g in grads.items():
                assert rel(g, ref_grads[name]) < 1e-5, name
