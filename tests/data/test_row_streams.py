"""data.row_streams (megatron_taper.data.order.RowStreams, streaming.RowStreamSource): each global
batch row reads consecutive windows of its share of the epoch's packing, a document's windows reach
one row in order, `continues` marks the windows whose first token is inside a document, the order
is a pure function of (seed, step, row), and at dp=2 the ranks' rows together are the dp=1 batch."""
import numpy as np
import pytest
import torch

from megatron_taper.data.order import LengthTable, RowStreams, SampleOrder
from megatron_taper.data.streaming import RowStreamSource
from tests.helpers.datahelpers import corpus, dataset, tokenizer_model  # noqa: F401

SEQ = 16


@pytest.mark.parametrize("rows", [1, 4])
def test_rows_read_their_share_of_the_packing_window_after_window(rows):
    lengths = np.random.default_rng(0).integers(0, 60, 300)  # empty documents included
    order = SampleOrder(LengthTable(lengths), SEQ, seed=3, block_docs=16)
    streams = RowStreams(order, rows)
    k = streams.windows_per_epoch
    flags = []
    for epoch in (0, 1):
        packing = order.epoch(epoch).document_order()
        ends = np.cumsum(lengths[packing])
        starts = ends - lengths[packing]
        for row in range(rows):
            for step in range(epoch * k, (epoch + 1) * k):
                pieces, continues = streams.window(step, row)
                pos = row * streams.row_tokens + (step - epoch * k) * SEQ
                assert sum(stop - start for _, start, stop in pieces) == SEQ + 1
                for doc, start, stop in pieces:  # contiguous in the epoch's concatenation
                    i = int(np.flatnonzero(packing == doc)[0])
                    assert starts[i] + start == pos and stop <= lengths[doc]
                    pos += stop - start
                first_doc, first_start = pieces[0][0], pieces[0][1]
                assert continues == (step > epoch * k and first_start > 0)
                flags.append(continues)
                if continues:  # the previous window of this row ends inside the same document
                    previous, _ = streams.window(step - 1, row)
                    assert previous[-1][0] == first_doc and previous[-1][2] == first_start + 1
    assert 0 < sum(flags) < len(flags) - 2 * rows  # resets inside an epoch too, at documents' first tokens


def test_source_dp2_rows_are_the_dp1_batch_and_resume_anywhere(dataset):
    """Global batch 8: dp=1 with 2 micro-batches of 4, dp=2 with 2 micro-batches of 2 per rank."""
    one = RowStreamSource(dataset, "train", SEQ, 4, 0, 1, 7, rows=8)
    ranks = [RowStreamSource(dataset, "train", SEQ, 2, r, 2, 7, rows=8) for r in (0, 1)]
    steps = one.streams.windows_per_epoch + 2  # into the second epoch
    for step in range(steps):
        batch = [one.next_batch() for _ in range(2)]  # rows 0-3, 4-7
        parts = [[rank.next_batch() for _ in range(2)] for rank in ranks]  # rank r, call a: rows 4a+2r ..
        for a in range(2):
            for i in range(2):
                tokens = torch.cat([parts[0][a][i], parts[1][a][i]])
                assert torch.equal(tokens, batch[a][i]), (step, a, i)
        if step == 5:
            fresh = RowStreamSource(dataset, "train", SEQ, 2, 1, 2, 7, rows=8)
            fresh.load_state_dict(ranks[1].state_dict())
            assert all(torch.equal(x, y) for x, y in zip(fresh.next_batch(), ranks[1].next_batch()))
            ranks[0].next_batch()
            assert all(torch.equal(x, y) for x, y in zip(fresh.next_batch(), ranks[1].next_batch()))
            ranks[0].next_batch()
            one.next_batch(), one.next_batch()  # the same step consumed by both layouts
    tokens, continues = one.next_batch()
    assert continues.dtype == torch.bool and tokens.shape == (4, SEQ + 1)
    with pytest.raises(ValueError, match="rows"):  # another global batch: other rows
        RowStreamSource(dataset, "train", SEQ, 4, 0, 1, 7, rows=4).load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="train.global_batch=6 must be a multiple of dp_size"):
        RowStreamSource(dataset, "train", SEQ, 4, 0, 1, 7, rows=6)
