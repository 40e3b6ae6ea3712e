"""torchrun for one machine, its stores listening on the loopback interface only.

    python examples_moe/torchrun_local.py --standalone --nproc_per_node=2 examples_moe/pretrain_gpt_moe.py ...

torchrun's rendezvous and agent stores (torch's TCPStore servers) listen on every interface, under --standalone
too, and torch 2.13 has no flag that binds them elsewhere (--rdzv-endpoint=127.0.0.1:0 and --master-addr only
say where clients connect): a client on the machine's external address can read and write their keys. A TCPStore
server also accepts a socket its caller has bound (`master_listen_fd`), so this launcher runs torchrun's own
`main` with every store server it creates bound to 127.0.0.1 first. It takes torchrun's arguments and requires
--standalone (one machine: every worker connects through localhost); for several machines use torchrun itself.
"""

import socket
import sys

import torch.distributed as dist
import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static_backend
from torch.distributed.run import main as torchrun_main

LOOPBACK = "127.0.0.1"


class LoopbackTCPStore(dist.TCPStore):
    """torch's TCPStore; a server (is_master) listens on a socket bound to 127.0.0.1 (port 0: a free one)."""

    def __init__(self, host_name, port=0, *args, **kwargs):
        is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
        if is_master and kwargs.get("master_listen_fd") is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, port))
            sock.listen(socket.SOMAXCONN)
            port = sock.getsockname()[1]
            kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here
        super().__init__(host_name, port, *args, **kwargs)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    script = next((i for i, a in enumerate(argv) if not a.startswith("-") and a.endswith(".py")), len(argv))
    if "--standalone" not in argv[:script]:
        print("torchrun_local.py: give --standalone (one machine; for several, use torchrun)", file=sys.stderr)
        return 2
    for module in (dist, c10d_backend, static_backend):  # where torchrun's stores are created
        module.TCPStore = LoopbackTCPStore
    torchrun_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
