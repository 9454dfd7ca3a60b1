"""Persistent GRU memory bridge: our reading of a seed abstract (no public paper or code matches
it; docs/memory_bridge.md lists what we chose where the abstract is silent).

A tapered Transformer (models/transformer/'s blocks) with a state of m slots (d_model each)
between its lower and upper halves. The block at index L//2 (the first of the upper half) holds
the bridge and runs it on its input x, the hidden states after the lower L//2 blocks:

    segments s = 0 .. n-1 of `segment` tokens (the last one may be shorter)
    S_0 = init_state                                                    (learned, [m, D])
    write, after segment s:  u = wo(CrossAttn(q = wq(norm(S_s)), k, v = wk, wv(norm(x_s))))
                             S_{s+1} = GRUCell(u, S_s)          (one cell shared by the m slots)
    read, in segment s:      r_t = wo'(CrossAttn(q = wq'(norm(x_t)), k, v = wk', wv'(norm(S_s))))
                             x_t <- x_t + sigmoid(gate(norm(x_t))) * r_t

so the tokens of segment s read only the state left by segments < s (the initial state for
s = 0): no information flows from the current or a later segment through the bridge, and within
a segment causality is the self-attention's. The write attends to every token of its segment
(no mask: its result is read only by later segments). Cross-attention has no positions (the
slots are unordered; a segment is read as a set). Without `carry_state` the last segment's write
is not computed (nothing reads it); `MemoryBridge.states(x, last=True)` computes every state, for
probes (tools/probe_bridge.py).

Carried state (`carry_state`): S_0 of row b is the state S_n its previous window ended with, where
the caller says the row continues a document (`carry_in` = (states [B, m, D], continues [B] bool),
set through the family's CarriedState: `put_state`), else `init_state`. The forward then also
computes S_n and leaves it, detached, in `carry_out` (`take_state`): gradients stop at the window
boundary (truncated backpropagation through time), the values are those of one recurrence over
the joined windows (tested). Without a state handed in (evaluation, generation) every window
starts from `init_state`.

Identity at initialisation: the read's output projection wo' is initialised to zero, so r = 0
and the model computes exactly the Transformer with the same weights (tested); its gradient,
sigmoid(.) * attention output, is not zero, so the bridge learns from the first step. The
gate's bias starts at 0 (gate 1/2).

Auxiliary self-prediction loss (`aux_weight` > 0, training mode only): from each state S_s,
s = 1 .. n-1 (which has read segments < s), a linear head predicts the next segment's content
    next_hidden: t_s = rms_norm(mean of x over segment s), detached (the model's own layer-L/2
                 hidden states: self-prediction)
    random:      t_s = a fixed N(0, I) vector per segment index s (seeded, the same for every
                 sequence): the same loss and weight, with a target that carries no information
                 about the text (the "random auxiliary target" control)
    aux = mean over sequences, s and features of (aux_head(mean over slots of S_s) - t_s)^2.
It reaches the gradients like Megatron's MoE auxiliary losses: `AuxLossCarrier` passes the block
output through unchanged and gives `aux` the gradient `aux_weight` in backward, so the logged
and evaluated losses stay the plain next-token loss. It is added per micro-batch: with gradient
accumulation over k micro-batches a step minimises mean LM loss + aux_weight x (sum of the k
auxiliary losses), i.e. the auxiliary weight relative to the LM loss is k x aux_weight.

`slots: 0` builds no bridge: exactly the Transformer (same parameter names and values), the
"no bridge" ablation. Parallelism: tensor parallelism shards the blocks as the Transformer's and
replicates the bridge (every tp rank holds the whole residual stream and computes the same state;
its gradients are whole on every rank, as the norms'); sequence parallelism is refused
(check_bridge_layout). Pipeline parallelism needs nothing more: the bridge lives inside block
L//2, so it never crosses a stage boundary (the state is written from, and read into, that
block's input), and the partition weighs that block with the bridge's FLOPs. Activation
checkpointing applies as to the Transformer; ZeRO and torch.compile take its code paths but are
not tested with the bridge; data and tensor parallelism are tested with `carry_state` (dp=2, tp=2
against one process), which is refused with pp > 1 and DeepSpeed (check_bridge_layout).

Documents (`doc_start` [B, S], True where a new document begins; context parallelism: bridge/cp.py):
the blocks' attention sees the query's own document (layers.py document_mask), and the bridge
runs on the documents packed (titans/documents.py), each moved to a segment boundary so that its
segments are those it has alone: a segment that starts a document starts from init_state (or,
for a row's first document when it continues the previous window, the carried state), the write
attends to the real tokens of its segment only, a segment of padding alone leaves the state as
it is (so `carry_out` is the state after the row's last real segment). The auxiliary loss is
the mean over every segment but a document's first (whose state read nothing) of real tokens.

Context parallelism: a chain of the state from slice to slice, and a broadcast of the carried
state (bridge/cp.py, which says how). Cost terms: bridge/cost.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.bridge import cp as bridge_cp
from megatron_taper.models.bridge.cost import bridge_layer, segment_bounds
from megatron_taper.models.init import init_tensor
from megatron_taper.models.layers import RMSNorm, document_mask, rope_tables
from megatron_taper.models.titans.documents import Packing, pack_documents, starts_inside
from megatron_taper.models.transformer.model import Transformer, TransformerBlock

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

RANDOM_TARGET_SEED = 20_240_917  # the fixed random targets of aux_target=random


class CrossAttention(nn.Module):
    """Queries from one sequence, keys and values from another, no mask, no positions."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N, H*E] -> [..., H, N, E]"""
        return x.unflatten(-1, (-1, self.head_dim)).transpose(-3, -2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [..., H, N, E], k, v [..., H, M, E] -> wo(attention) [..., N, D]; mask: the keys that
        may be attended [..., 1, 1, M] (bool), or None for all."""
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(-3, -2).flatten(-2))


class AuxLossCarrier(torch.autograd.Function):
    """Forward: x unchanged. Backward: x's gradient unchanged, and `weight` for the scalar `aux`,
    which so joins the gradients without changing the loss the trainer computes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, device=grad.device, dtype=torch.float32), None


class MemoryBridge(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, b = cfg.d_model, cfg.bridge
        self.segment = b.segment
        self.aux_weight = b.aux_weight
        self.aux_target = b.aux_target
        self.init_state = nn.Parameter(torch.empty(b.slots, d))
        self.write_state_norm = RMSNorm(d, cfg.norm_eps)
        self.write_input_norm = RMSNorm(d, cfg.norm_eps)
        self.write = CrossAttention(d, cfg.n_heads, cfg.head_dim)
        self.gru = nn.GRUCell(d, d)
        self.read_norm = RMSNorm(d, cfg.norm_eps)
        self.read_state_norm = RMSNorm(d, cfg.norm_eps)
        self.read = CrossAttention(d, cfg.n_heads, cfg.head_dim)
        self.gate = nn.Linear(d, d)
        self.aux_head = nn.Linear(d, d, bias=False) if b.aux_weight > 0 else None
        self.carry_state = b.carry_state
        self.carry_in: tuple[torch.Tensor | None, torch.Tensor] | None = None  # (previous S_n, continues)
        self.carry_out: torch.Tensor | None = None  # S_n of the last forward [B, m, D], detached
        self.context = None  # a contiguous context-parallel split (bridge/cp.py), or None

    def initial_state(self, x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """S_0 [B, m, D] in x's dtype: the carried state where a row continues (and, with `starts`
        [B], does not start a document), else init_state (a copy: a view of a parameter keeps
        requires_grad under no_grad, which torch's module tracker rejects)."""
        state = self.init_state.to(x.dtype).repeat(x.shape[0], 1, 1)
        carried, continues = self.carry_in if self.carry_in is not None else (None, None)
        if carried is not None:
            continues = continues.to(x.device) if starts is None else continues.to(x.device) & ~starts
            state = torch.where(continues[:, None, None], carried.to(x.device, x.dtype), state)
        return state

    def states(self, x: torch.Tensor, last: bool = False, packing: Packing | None = None,
               starts: torch.Tensor | None = None, initial: torch.Tensor | None = None) -> torch.Tensor:
        """S_0 .. S_{n-1} ([B, n, m, D]) for x [B, S, D]; with `last` also S_n (after the final
        segment): [B, n+1, m, D]. `packing`: x is packed documents (module docstring) and `starts`
        [B] whether each row's first token starts a document. `initial`: S_0 [B, m, D] where the
        caller has it (context parallelism with documents, bridge/cp.py)."""
        seq = x.shape[1]
        bounds = segment_bounds(seq, self.segment)
        normed = self.write_input_norm(x)
        k, v = self.write.heads(self.write.wk(normed)), self.write.heads(self.write.wv(normed))  # [B, H, S, E]
        state = self.initial_state(x, starts) if initial is None else initial  # [B, m, D]
        split = self.split()
        if initial is None and split is not None and split.rank > 0:  # rank r - 1's end state [B, m, D]
            state = bridge_cp.receive(self, state)
        out = [state]
        for start, end in bounds[: len(bounds) if last else len(bounds) - 1]:
            q = self.write.heads(self.write.wq(self.write_state_norm(state)))  # [B, H, m, E]
            mask = real = None
            if packing is not None:  # the segment's real tokens; a segment of padding alone attends to all
                real = packing.valid[:, start:end]
                mask = (real | ~real.any(1, keepdim=True))[:, None, None]  # [B, 1, 1, T]
            u = self.write.attend(q, k[:, :, start:end], v[:, :, start:end], mask)  # [B, m, D]
            # the state stays in x's dtype (fp32 under autocast, where the GRU computes in bf16)
            written = self.gru(u.flatten(0, 1), state.flatten(0, 1)).view_as(state).to(x.dtype)
            if packing is None:
                state = written
            else:  # a segment of padding alone keeps the state; the next starts a document: init_state
                state = torch.where(real.any(1)[:, None, None], written, state)
                if end < seq:
                    state = torch.where(packing.resets[:, end, None, None], self.init_state.to(x.dtype), state)
            out.append(state)
        return torch.stack(out, dim=1)

    def split(self):
        """The context-parallel split this bridge's input is a slice of (contiguous, whole
        segments: check_bridge_layout), or None."""
        return self.context if self.context is not None and self.context.cp > 1 else None

    def forward(self, x: torch.Tensor, doc_start: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, D] -> x plus the gated read of each segment's state. Under context
        parallelism x is this rank's slice: it starts from the state rank r - 1's slice ended
        with, and hands its own end state to rank r + 1 (parallel/cp/state.py's chain). `doc_start` [B, S]:
        documents (module docstring); under context parallelism also `offsets` [B, S_whole], each
        token's offset in its document over the whole sequence (bridge/cp.py)."""
        if doc_start is not None and self.split() is not None:
            return bridge_cp.forward_documents(self, x, doc_start, offsets)
        doc_start = starts_inside(doc_start)
        if doc_start is not None:
            return self.forward_documents(x, doc_start)
        bsz, seq, dim = x.shape
        split = self.split()
        sends = split is not None and split.rank < split.cp - 1
        states = self.states(x, last=self.carry_state or sends)  # [B, n (+1: the end state), m, D]
        end = states[:, -1] if self.carry_state or sends else None
        if end is not None:
            states = states[:, :-1]
        if self.carry_state:  # under cp: the last rank's is S_n (take_state hands it to every cp rank)
            self.carry_out = end.detach()
        n = states.shape[1]
        normed = self.read_norm(x)
        out = x + torch.sigmoid(self.gate(normed)) * self.read_states(normed, states)
        cp = 1 if split is None else split.cp
        if self.aux_head is not None and self.training and torch.is_grad_enabled() and n * cp > 1:
            out = self.with_aux_loss(out, self.aux_loss(x, states))
        if split is not None:
            out = bridge_cp.send(self, out, (end,) if sends else None, end is not None or n > 1)
        return out

    def read_states(self, normed: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The reads r [B, S, D] of the tokens normed [B, S, D] (read_norm(x)) of each segment from
        its state (states [B, n, m, D])."""
        bsz, seq, dim = normed.shape
        n, t = states.shape[1], self.segment
        q = F.pad(self.read.wq(normed), (0, 0, 0, n * t - seq))  # [B, n*T, H*E], zero rows pad the last segment
        q = self.read.heads(q.view(bsz, n, t, -1))  # [B, n, H, T, E]
        s = self.read_state_norm(states)
        k, v = self.read.heads(self.read.wk(s)), self.read.heads(self.read.wv(s))  # [B, n, H, m, E]
        return self.read.attend(q, k, v).view(bsz, n * t, dim)[:, :seq]  # [B, S, D]

    def forward_documents(self, x: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
        """forward over the documents of doc_start (module docstring; no context parallelism)."""
        packing = pack_documents(doc_start, self.segment)
        xp = packing.pack(x)  # [B, n T, D]
        states = self.states(xp, last=self.carry_state, packing=packing, starts=doc_start[:, 0])
        if self.carry_state:
            self.carry_out, states = states[:, -1].detach(), states[:, :-1]
        normed = self.read_norm(x)
        out = x + torch.sigmoid(self.gate(normed)) * packing.unpack(self.read_states(self.read_norm(xp), states))
        if self.aux_head is not None and self.training and torch.is_grad_enabled():
            out = self.with_aux_loss(out, self.aux_loss_documents(xp, states, packing))
        return out

    def aux_loss_documents(self, xp: torch.Tensor, states: torch.Tensor, packing: Packing,
                           drop: torch.Tensor | None = None, count: torch.Tensor | None = None) -> torch.Tensor:
        """aux_loss over packed documents xp [B, n T, D]: the mean over every segment that holds real
        tokens and does not start a document, of the error of its state's prediction of the mean
        of its real tokens (or of the random target of its index in its document). Under context
        parallelism (bridge/cp.py) `drop` [B, n] leaves out segments another rank counts, and
        `count` replaces the number of segments counted (this rank's share of the whole sequence's)."""
        bsz, n, t = xp.shape[0], states.shape[1], self.segment
        valid = packing.valid.view(bsz, n, t)
        counts = valid.sum(-1)  # [B, n]
        keep = (counts > 0) & (packing.positions[:, ::t] > 0)  # [B, n]: not a document's first segment
        if drop is not None:
            keep = keep & ~drop
        pred = self.aux_head(states.mean(2))  # [B, n, D]
        if self.aux_target == "random":
            generator = torch.Generator().manual_seed(RANDOM_TARGET_SEED)
            rows = max(n, int(packing.positions.max()) // t + 1)  # segment indices in their documents
            table = torch.randn(rows, xp.shape[-1], generator=generator).to(xp.device, xp.dtype)
            target = table[packing.positions[:, ::t] // t]  # [B, n, D]
        else:
            sums = (xp.view(bsz, n, t, -1) * valid[..., None]).sum(2)
            target = F.rms_norm((sums / counts.clamp(min=1)[..., None]).detach(), (xp.shape[-1],))
        errors = (pred.float() - target.float()).square() * keep[..., None]
        return errors.sum() / ((keep.sum().clamp(min=1) if count is None else count) * errors.shape[-1])

    def with_aux_loss(self, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """out unchanged; backward also adds aux_weight x aux's gradient (AuxLossCarrier)."""
        return AuxLossCarrier.apply(out, aux, self.aux_weight)

    def aux_loss(self, x: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """x: the bridge's input [B, S, D]; states: S_0 .. S_{n-1}. The mean squared error of the
        next-segment predictions from S_1 .. S_{n-1} (module docstring). Under context parallelism
        x and states are this rank's slice's (global segments k0 .. k0 + n - 1): its share of that
        mean is the sum of its own errors x cp / the count of the whole sequence, so that the mean
        of the shares over the cp group (DDP's gradient average) is the mean."""
        split = self.split()
        n = states.shape[1]
        first = 0 if split is None else split.rank * n  # the global index of states[:, 0]
        skip = 1 if first == 0 else 0  # S_0 predicts nothing
        pred = self.aux_head(states[:, skip:].mean(2))  # [B, n - skip, D]
        if self.aux_target == "random":
            generator = torch.Generator().manual_seed(RANDOM_TARGET_SEED)
            target = torch.randn(first + n, x.shape[-1], generator=generator)[first + skip:].to(x.device, x.dtype)
            target = target.expand_as(pred)
        else:
            means = torch.stack([x[:, a:b].mean(1) for a, b in segment_bounds(x.shape[1], self.segment)], 1)
            target = F.rms_norm(means[:, skip:].detach(), (x.shape[-1],))
        errors = (pred.float() - target.float()).square()
        if split is None:
            return errors.mean()
        return errors.sum() * split.cp / (errors.shape[0] * (n * split.cp - 1) * errors.shape[-1])


class BridgeBlock(TransformerBlock):
    """A Transformer block that runs its `bridge` (when it has one) on its input first."""

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.bridge: MemoryBridge | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        """With `doc_start` [B, S] the bridge resets at document starts and attention stays inside the
        query's document (module docstring)."""
        if doc_start is not None and self.attn.context is not None and self.attn.context.cp > 1:
            return bridge_cp.block_documents(self, x, cos, sin, doc_start)
        doc_start = starts_inside(doc_start)
        if self.bridge is not None:
            x = self.bridge(x) if doc_start is None else self.bridge(x, doc_start)
        if doc_start is None:
            return super().forward(x, cos, sin)
        xn = self.attn_norm(x)
        x = x + self.attn.project_out(self.attn.attend(xn, cos, sin, document_mask(doc_start)), xn)
        return x + self.mlp(self.mlp_norm(x))


class MemoryBridgeLM(Transformer):
    block_class = BridgeBlock

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.bridge.slots:
            self.layers[str(bridge_layer(cfg))].bridge = MemoryBridge(cfg)

    @property
    def bridge(self) -> MemoryBridge | None:
        return self.layers[str(bridge_layer(self.cfg))].bridge

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """models/init.py's rule, except the read's output projection: zero (identity at init)."""
        if name.endswith("bridge.read.wo.weight"):
            return torch.zeros(shape)
        return init_tensor(name, shape, seed, self.cfg.init_std, self.cfg.n_layers)

    def lower_half(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states entering the bridge (after blocks 0 .. L//2 - 1) for tokens [B, S]."""
        h = self.tok_embeddings(tokens)
        cos, sin = rope_tables(h.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device)
        for index in range(bridge_layer(self.cfg)):
            h = self.layers[str(index)](h, cos, sin)
        return h


def put_state(model: MemoryBridgeLM, state: torch.Tensor | None, continues: torch.Tensor) -> None:
    model.bridge.carry_in = (state, continues)


def take_state(model: MemoryBridgeLM) -> torch.Tensor:
    bridge = model.bridge
    state, bridge.carry_in, bridge.carry_out = bridge.carry_out, None, None
    split = bridge.split()
    if split is not None:  # S_n is the last cp rank's: every cp rank holds it (cp rank 0 starts the next window)
        state = bridge_cp.from_last_rank(state, split)
    return state
