"""torchrun whose single-node rendezvous listens on 127.0.0.1 only.

    python -m megatron_taper.torchrun [torchrun's options] (SCRIPT | -m MODULE | --no-python CMD) [args ...]

torch's TCPStore server listens on every interface whatever host name it is given (torch 2.13: `*:PORT`),
and `torchrun --standalone` starts two of them (the c10d rendezvous store and the store the workers
share), neither authenticated: anyone who reaches the machine can join or set keys. Here `--standalone`
starts one store instead, on a socket bound to 127.0.0.1 before the store takes it over (TCPStore's
master_listen_fd); the agent and its workers share it (MASTER_ADDR=127.0.0.1), as with torchrun's static
backend. Every other option, multi-node rendezvous included (--rdzv-backend=c10d ...), goes to torchrun
unchanged. A SIGINT or SIGTERM to torchrun ends it with one line (and exit 128 + the signal) instead of
its traceback, after it has stopped the workers.
"""
from __future__ import annotations

import socket
import sys
import uuid
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.run import get_args_parser, run

LOOPBACK = "127.0.0.1"
BACKEND = "loopback"


class LoopbackRendezvous(RendezvousHandler):
    """One node, one TCPStore listening on 127.0.0.1 only, kept across the agent's restarts."""

    def __init__(self, run_id: str, timeout: timedelta):
        self.run_id = run_id
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(socket.SOMAXCONN)
        self.port = self._listener.getsockname()[1]
        self._store = TCPStore(LOOPBACK, self.port, world_size=None, is_master=True, timeout=timeout,
                               wait_for_workers=False, multi_tenant=True, master_listen_fd=self._listener.fileno())

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1, RendezvousStoreInfo(LOOPBACK, self.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous is for one node (got --nnodes {params.max_nodes})")
    return LoopbackRendezvous(params.run_id, timedelta(seconds=params.get_as_int("timeout", 300)))


@record
def main(argv: list[str] | None = None) -> None:
    args = get_args_parser().parse_args(argv)
    if args.standalone:
        args.standalone = False
        args.nnodes, args.rdzv_backend, args.rdzv_endpoint = "1", BACKEND, f"{LOOPBACK}:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.rdzv_backend == BACKEND:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
    try:
        run(args)
    except SignalException as e:  # Ctrl-C or a TERM: torchrun has stopped the workers (they saved, see above)
        print(f"torchrun: stopped by {e.sigval.name}; the workers were stopped", file=sys.stderr, flush=True)
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    main(sys.argv[1:])
