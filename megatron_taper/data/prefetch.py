"""Batches prepared ahead of need: a background thread draws the next steps' micro-batches.

    prefetch = Prefetcher(source, per_step=accumulation, depth=2, pin=device.type == "cuda")
    batches, state, metrics = prefetch.next()   # one step's micro-batches, and the source's
                                                # state_dict / metrics right after drawing them

The thread runs `depth` steps ahead of the training loop, so reading, decoding and (on CUDA)
pinning the host memory of a step's tokens overlaps the steps before it; the copies to the device
are then non_blocking (ParallelModel.forward_backward). The source is only touched by the thread
once started, so its state for a checkpoint is the one recorded with the last consumed step (the
source itself is already ahead). An error in the thread is raised by the next `next()`.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch


class Prefetcher:
    def __init__(self, source: Any, per_step: int, depth: int = 2, pin: bool = False):
        self.source, self.per_step, self.pin = source, per_step, pin
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._metrics = getattr(source, "metrics", dict)
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batches = [self.source.next_batch() for _ in range(self.per_step)]
                if self.pin:  # a batch is a tensor, or a tuple of tensors (data.row_streams)
                    batches = [tuple(t.pin_memory() for t in b) if isinstance(b, tuple) else b.pin_memory()
                               for b in batches]
                item = (batches, self.source.state_dict(), self._metrics())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._queue.put(e)

    def next(self) -> tuple[list[torch.Tensor], dict, dict]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
