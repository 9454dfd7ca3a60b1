"""Checkpoints: the sharded on-disk format and the save / resume / reshard logic.

files.py         the format: tensor files of logical pieces (our own and safetensors), readers, hashes
folders.py       the run's checkpoints folder: listing, resume candidates, what a save sets aside and prunes
checkpointer.py  the Checkpointer (atomic, sharded, async save), loading, verification
"""
