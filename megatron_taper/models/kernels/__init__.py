"""Loop-free and kernel forms of the memory families' recurrences.

state_passing.py         the states of a linear recurrence between chunks, S_{n+1} = exp(g_n) S_n + U_n,
                         as one stable segment-sum product (every device), or the Triton kernels (CUDA)
state_passing_triton.py  those kernels: a loop over chunks with the state in registers; imports triton
memory_write_triton.py   the chunk loops of the Titans / deep-memory write loop (titans/neural_memory.WriteLoop),
                         depths 1 and 2, as one Triton kernel each way (CUDA); imports triton
"""
