"""torchrun (python -m torch.distributed.run) for test_c10d.py: torchrun itself, unchanged,
except on a torch built without libuv (Debian 13's torch 2.6), where torchrun cannot start at
all, whatever the backend:

* torch 2.4+ makes libuv TCPStore's default (use_libuv=True), and a build without libuv
  refuses it: "use_libuv was requested but PyTorch was build without libuv support".
* torchrun's rendezvous handlers (static, and c10d, which --standalone uses) make their
  TCPStore without a use_libuv argument, and USE_LIBUV=0 does not reach them; it reaches only
  init_process_group's env:// (torch.distributed.rendezvous). Nor does it reach a worker's
  client of the agent's store, which the workers use by default
  (TORCHELASTIC_USE_AGENT_STORE).

There, in this (the agent's) process, TCPStore defaults to use_libuv=False, and the workers get
USE_LIBUV=0 and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0 hosts their store, made by
env://, which honours USE_LIBUV). argv: torchrun's."""

import os
import runpy
import sys

import torch.distributed as dist


def _libuv_refused():
    """Whether this torch refuses a libuv TCPStore (a build without libuv)."""
    try:
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True,
                              wait_for_workers=False, use_libuv=True)
    except TypeError:  # no use_libuv argument (torch < 2.2): nothing to work around
        return False
    except RuntimeError as e:
        if "libuv" in str(e):
            return True
        raise
    del store
    return False


if _libuv_refused():
    from torch.distributed.elastic.rendezvous import (c10d_rendezvous_backend,
                                                      static_tcp_rendezvous)

    class _TCPStore(dist.TCPStore):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("use_libuv", False)
            super().__init__(*args, **kwargs)

    dist.TCPStore = _TCPStore  # dynamic_rendezvous's dist.TCPStore
    c10d_rendezvous_backend.TCPStore = _TCPStore
    static_tcp_rendezvous.TCPStore = _TCPStore
    os.environ["USE_LIBUV"] = "0"
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    print("c10d_torchrun_launch: this torch has no libuv: torchrun's TCPStores made with "
          "use_libuv=False", flush=True)

sys.argv = ["torchrun"] + sys.argv[1:]
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
