"""The core of gradlink.torch under the one name the other front ends (_gather.py, _horovod.py,
_broadcast.py, _ddp.py, _optimizer.py, gradlink.byteps.torch) and the tests and benchmarks
import: every name here is owned by one of the modules below and only re-exported.

* _context.py: the process-wide context (the joined worker, ranks and sizes, caches) and its
  observers (the timeline registers itself there: the core never imports it);
* _init.py: init(), shutdown(), fail-fast, barrier(), join();
* _tensors.py: which tensors and dtypes are accepted, the checks and their errors, raw views;
* _ops.py: push_pull, grouped_push_pull and the start*() of every operation, key naming;
* _handles.py: the handles, synchronize(), poll() and the completion thread;
* _stats.py: stats() and staging_stats();
* gradlink/_env.py: the GRADLINK_* environment (the one module that reads it).
"""

from ._context import (  # noqa: F401
    Context as _Context,
    _require,
    is_initialized,
    local_rank,
    local_size,
    num_servers,
    rank,
    size,
)
from ._handles import (  # noqa: F401
    Completer,
    GroupedPushPullHandle,
    PushPullHandle,
    TwoStepHandle,
    _Pending,
    completer,
    poll,
    synchronize,
)
from ._init import barrier, init, join, pending_options, shutdown  # noqa: F401
from ._ops import (  # noqa: F401
    _stage,
    claim,
    grouped_push_pull,
    grouped_push_pull_async,
    push_pull,
    push_pull_async,
    start,
    start_collective,
    start_group,
    track,
)
from ._stats import staging_stats, stats  # noqa: F401
from ._tensors import (  # noqa: F401
    DTYPES,
    _check_summable,
    _check_tensor,
    _staged,
    raw_view,
)
