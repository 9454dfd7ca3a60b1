"""Context parallelism (parallel.cp): each sequence split over the ranks of a cp group.

    split.py   SequenceSplit (which positions a rank holds), the attention families' K/V exchange
               (all-gather or ring), the split of a batch and its loss
    ulysses.py parallel.cp_attention=ulysses: attention by all-to-all to head-sharded and back
    state.py   what a slice needs from the slices before it (the state-passing families)
Each family's own cp code sits beside its model (models/<family>/cp.py).
"""
