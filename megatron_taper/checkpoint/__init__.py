"""Checkpoints: the sharded on-disk format and the save / resume / reshard logic.

files.py         the format: tensor files of logical pieces (our own and safetensors), readers, hashes
checkpointer.py  the Checkpointer (atomic, sharded, async save; pruning), resume candidates, loading
"""
