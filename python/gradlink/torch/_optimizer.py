"""DistributedOptimizer: averages gradients over the workers while backward() runs."""

import contextlib
import warnings

import torch

from gradlink import InvalidArgumentError

from . import _core
from . import _horovod

# A gradient that is ready while the rest of its bucket is not.
_PENDING = object()


class _DistributedOptimizer(torch.optim.Optimizer):
    # Mixed into a subclass of the wrapped optimizer's class (see DistributedOptimizer).

    def __init__(self, params, named_parameters, backward_passes_per_step=1, average=True,
                 prefix="grad", bucket_bytes=None, compression=_horovod.Compression.none,
                 predivide=1.0, sparse_as_dense=False,
                 process_set=_horovod.global_process_set, groups=None):
        super(self.__class__, self).__init__(params)
        _core._require()
        # Over a process set: its members average among themselves, one gradient per
        # collective; a rank outside it steps on its own gradients (Horovod's).
        self._gl_set = None if process_set.ranks is None else process_set
        self._gl_included = process_set.included()
        self._gl_compression = compression
        self._gl_predivide = float(predivide)
        self._gl_sparse_as_dense = sparse_as_dense
        self._gl_finish = {}  # id(handle) -> what to do with the bucket's result
        if backward_passes_per_step < 1:
            raise InvalidArgumentError("backward_passes_per_step must be >= 1")
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [("param.%d.%d" % (g, i), p)
                                for g, group in enumerate(self.param_groups)
                                for i, p in enumerate(group["params"])]
        if any(not isinstance(p, tuple) or len(p) != 2 for p in named_parameters):
            raise InvalidArgumentError(
                "named_parameters should be a sequence of (name, parameter) pairs, usually "
                "model.named_parameters()")
        names = [n for n, _ in named_parameters]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise InvalidArgumentError("named_parameters has duplicate names: %s" % ", ".join(dups))
        by_id = {id(p): n for n, p in named_parameters}
        unnamed = [p for p in all_params if id(p) not in by_id]
        if unnamed:
            raise InvalidArgumentError(
                "%d of the optimizer's parameters are not in named_parameters" % len(unnamed))
        # Priorities: the parameters registered first are (usually) used first by the next
        # forward pass, so their gradients, which backward produces last, jump the queue.
        order = [p for _, p in named_parameters if any(p is q for q in all_params)]
        self._gl_names = {p: by_id[id(p)] for p in all_params}
        self._parameter_names = self._gl_names  # Horovod's name for it
        self._gl_priority = {p: len(order) - i for i, p in enumerate(order)}
        self._gl_prefix = prefix
        self._gl_average = average
        self.backward_passes_per_step = backward_passes_per_step
        self._gl_delay = {p: backward_passes_per_step for p in all_params}
        self._gl_handles = {}
        if groups is None:
            self._gl_make_buckets(bucket_bytes)
        else:
            self._gl_group_buckets(groups)
        self._gl_grad_accs = []
        self._gl_requires_update = set()
        self._gl_synchronized = False
        self._gl_should_synchronize = True
        self._gl_register_hooks()

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._gl_delay:
            self._gl_delay[p] = passes

    def _gl_register_hooks(self):
        if not self._gl_included:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                self._gl_requires_update.add(p)
                # The hook of p's gradient accumulator runs once p.grad holds this pass's sum.
                p_tmp = p.expand_as(p)
                grad_acc = p_tmp.grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._gl_make_hook(p))
                self._gl_grad_accs.append(grad_acc)

    def _gl_make_buckets(self, bucket_bytes):
        # Small gradients are pushed in buckets, each one fused group (grouped_push_pull), once
        # every gradient of the bucket is ready. Buckets depend only on the parameters (names,
        # shapes, dtypes, order), so every worker forms the same ones. Filled in reverse
        # registration order, the order in which backward usually produces gradients; a
        # gradient of fusion_threshold_bytes or more has a bucket of its own (no copy).
        worker = _core._require().worker
        if bucket_bytes is None:
            bucket_bytes = worker.fusion_buffer_bytes
        if bucket_bytes < 0:
            raise InvalidArgumentError("bucket_bytes must be >= 0")
        threshold = min(worker.fusion_threshold_bytes, bucket_bytes)
        params = sorted((p for p in self._gl_names if p.requires_grad),
                        key=lambda q: self._gl_priority[q])  # last registered first
        self._gl_buckets = []  # lists of parameters
        self._gl_bucket_of = {}
        current, current_bytes = [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if nbytes >= threshold:
                self._gl_add_bucket([p])
                continue
            if current and current_bytes + nbytes > bucket_bytes:
                self._gl_add_bucket(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            self._gl_add_bucket(current)
        self._gl_ready = [set() for _ in self._gl_buckets]
        self._gl_started = [None] * len(self._gl_buckets)  # this step's handle of each bucket

    def _gl_group_buckets(self, groups):
        # Horovod's explicit groups: a number k (the gradients, in registration order, cut into
        # k groups of nearly equal counts) or lists of parameters (each list one group; every
        # other parameter a group of its own). Each group is one fused collective.
        params = sorted((p for p in self._gl_names if p.requires_grad),
                        key=lambda q: -self._gl_priority[q])  # registration order
        self._gl_buckets, self._gl_bucket_of = [], {}
        if isinstance(groups, int):
            k = max(1, min(groups, len(params)))
            at = 0
            for i in range(k):
                n = len(params) // k + (1 if i < len(params) % k else 0)
                if n:
                    self._gl_add_bucket(params[at:at + n])
                at += n
        else:
            for group in groups:
                members = [p for p in group if p in self._gl_names and p.requires_grad]
                if any(p in self._gl_bucket_of for p in members):
                    raise InvalidArgumentError("DistributedOptimizer: a parameter is in more "
                                               "than one of `groups`")
                if members:
                    self._gl_add_bucket(members)
            for p in params:
                if p not in self._gl_bucket_of:
                    self._gl_add_bucket([p])
        self._gl_ready = [set() for _ in self._gl_buckets]
        self._gl_started = [None] * len(self._gl_buckets)

    def _gl_add_bucket(self, params):
        for p in params:
            self._gl_bucket_of[p] = len(self._gl_buckets)
        self._gl_buckets.append(params)

    def _gl_grad_ready(self, p):
        """p's gradient is final for this step: starts its bucket once the bucket is complete.
        Returns the bucket's handle, or _PENDING."""
        b = self._gl_bucket_of[p]
        if self._gl_started[b] is not None:
            return self._gl_started[b]
        ready = self._gl_ready[b]
        ready.add(p)
        if len(ready) < len(self._gl_buckets[b]):
            return _PENDING
        members = self._gl_buckets[b]
        for q in members:
            if q.grad is None:
                # Unused in this step on this worker: every worker must still push (rounds stay
                # aligned), a zero gradient.
                q.grad = torch.zeros_like(q)
        names = {q: "%s.%s" % (self._gl_prefix, self._gl_names[q]) for q in members}
        priority = max(self._gl_priority[q] for q in members)
        dense = [q for q in members if not q.grad.is_sparse]
        parts, finishes = [], []
        if dense:
            handle, finish = self._gl_start_dense(dense, [names[q] for q in dense], priority)
            parts.append(handle)
            if finish is not None:
                finishes.append(finish)
        for q in members:
            if q.grad.is_sparse:
                handle, finish = self._gl_start_sparse(q, names[q])
                parts.append(handle)
                finishes.append(finish)
        handle = parts[0] if len(parts) == 1 else _horovod._GroupHandle(parts)
        if finishes:
            self._gl_finish[id(handle)] = finishes
        self._gl_started[b] = handle
        for q in members:
            self._gl_handles[q] = handle
        return handle

    def _gl_start_dense(self, members, names, priority):
        """Starts averaging (summing) the dense gradients of `members`; returns (handle, what
        to run after it or None)."""
        # What travels: the gradients themselves, or their compressed copies (Compression.fp16),
        # divided by gradient_predivide_factor first.
        wires, ctxs = [], []
        with torch.no_grad():
            for q in members:
                w, c = self._gl_compression.compress(q.grad)
                if self._gl_predivide != 1.0:
                    w.mul_(1.0 / self._gl_predivide)
                wires.append(w)
                ctxs.append(c)
        op = _horovod.Average if self._gl_average else _horovod.Sum
        if self._gl_set is not None:
            handle = _horovod._GroupHandle([
                _horovod.allreduce_async_(w, name=n, op=op, process_set=self._gl_set)
                for w, n in zip(wires, names)])
        elif len(members) == 1:
            handle = _core.push_pull_async(wires[0], average=self._gl_average,
                                           name=names[0], priority=priority)
        else:
            handle = _core.grouped_push_pull_async(wires, average=self._gl_average, names=names,
                                                   priority=priority)
        if ctxs == [None] * len(ctxs) and self._gl_predivide == 1.0:
            return handle, None

        def finish():
            with torch.no_grad():
                for q, w, c in zip(members, wires, ctxs):
                    r = self._gl_compression.decompress(w, c)
                    if r.data_ptr() != q.grad.data_ptr():
                        q.grad.copy_(r)
                    if self._gl_predivide != 1.0:
                        q.grad.mul_(self._gl_predivide)

        return handle, finish

    def _gl_start_sparse(self, q, name):
        """Starts averaging (summing) q's sparse gradient: densified and back (sparse_as_dense),
        else through sparse_allreduce_async (an allgather of indices and values), as Horovod
        does; returns (handle, what sets q.grad to the result). The gradient stays sparse, so
        optimizers that take only sparse gradients (SparseAdam) step as they would alone."""
        op = _horovod.Average if self._gl_average else _horovod.Sum
        process_set = self._gl_set or _horovod.global_process_set
        if self._gl_sparse_as_dense:
            dense = q.grad.to_dense()
            handle = _horovod.allreduce_async_(dense, name=name, op=op, process_set=process_set)

            def finish():
                q.grad = dense.to_sparse()
        else:
            from ._gather import sparse_allreduce_async  # (_gather imports this module's peers)
            handle = sparse_allreduce_async(q.grad, name=name, op=op, process_set=process_set)

            def finish():
                q.grad = handle.wait()

        return handle, finish

    def _gl_make_hook(self, p):
        def hook(*ignore):
            if p in self._gl_handles and self._gl_handles[p] is not None:
                if self._gl_delay[p] <= 0:
                    raise AssertionError(
                        "gradients were computed more than backward_passes_per_step times "
                        "before optimizer.step() or synchronize(); increase "
                        "backward_passes_per_step to accumulate gradients locally")
            if p.grad is not None and p.grad.requires_grad:
                raise AssertionError("gradlink: p.grad must not require grad")
            handle = None
            self._gl_delay[p] -= 1
            if self._gl_delay[p] == 0:
                handle = self._gl_grad_ready(p)
            self._gl_handles[p] = handle

        return hook

    def synchronize(self):
        """Waits until every gradient has been averaged over the workers (starting those that
        backward did not produce). step() calls it unless inside skip_synchronize(). A rank
        outside the optimizer's process set keeps its own gradients."""
        if not self._gl_included:
            self._gl_synchronized = True
            return
        missing = self._gl_requires_update - set(self._gl_handles)
        # In registration order, so every worker starts them in the same order.
        for p in sorted(missing, key=lambda q: -self._gl_priority[q]):
            self._gl_handles[p] = self._gl_grad_ready(p)
        for p in list(self._gl_handles):
            if self._gl_handles[p] is None:  # fewer than backward_passes_per_step passes so far
                self._gl_handles[p] = self._gl_grad_ready(p)
        try:
            waited = set()
            for p, handle in self._gl_handles.items():
                if handle is _PENDING:  # cannot happen: every bucket is complete by now
                    raise AssertionError("gradlink: bucket of %s never started"
                                         % self._gl_names[p])
                if id(handle) not in waited:
                    waited.add(id(handle))
                    _core.synchronize(handle)
                    for finish in self._gl_finish.pop(id(handle), ()):
                        finish()
        finally:
            self._gl_finish.clear()
            for p in self._gl_handles:
                self._gl_delay[p] = self.backward_passes_per_step
            self._gl_handles.clear()
            for ready in self._gl_ready:
                ready.clear()
            self._gl_started = [None] * len(self._gl_buckets)
        self._gl_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For `optimizer.synchronize(); clip gradients; with optimizer.skip_synchronize():
        optimizer.step()`."""
        self._gl_should_synchronize = False
        try:
            yield
        finally:
            self._gl_should_synchronize = True

    def step(self, closure=None):
        if self._gl_should_synchronize:
            if self._gl_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): gradients are averaged again")
            self.synchronize()
        self._gl_synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._gl_handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); that would zero gradients that "
                "are being averaged")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=_horovod.Compression.none,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=_horovod.global_process_set, *, average=None,
                         prefix="grad", bucket_bytes=None):
    """Wraps `optimizer` so that gradients are averaged over all workers.

    horovod.torch's signature and positional order (Horovod 0.28): compression
    (Compression.fp16: gradients travel as fp16, summed in fp32 on the servers), op (Average,
    default, or Sum; `average=` is gradlink's older spelling of the same), and
    gradient_predivide_factor f (each gradient is divided by f before the sum and multiplied by
    f after the average, as Horovod does; Average only). Sparse gradients
    (nn.Embedding(sparse=True)) are averaged through an allgather of their indices and values,
    or, with sparse_as_dense=True, densified for the sum and made sparse again; either way they
    stay sparse for the step. groups (num_groups, its older spelling): Horovod's explicit fusion
    groups, a number k (the gradients cut into k groups in registration order) or lists of
    parameters (each list one group, every other parameter alone); each group goes as one fused
    collective once all of its gradients are ready. Without them gradlink forms its own buckets
    (bucket_bytes, below). process_set (a registered ProcessSet): its members average over the
    set, one gradient per collective; a rank outside it steps on its own gradients, as under
    Horovod.

    During backward, a hook on each parameter's gradient accumulator starts push_pull of that
    gradient as soon as it is ready (overlapping communication with the rest of backward);
    step() waits for all of them and then steps. Gradients are sent in priority order: the
    parameters registered first (used first by the next forward pass) first.

    named_parameters: model.named_parameters(); names give the keys ("grad.<name>"), the same on
    every worker. backward_passes_per_step: number of backward passes whose gradients are
    summed locally before they are averaged over the workers (gradient accumulation; the local
    passes are summed, not averaged, as in Horovod). average=False sums instead.

    bucket_bytes (default: init()'s fusion_buffer_bytes, 4 MiB): gradients smaller than the
    fusion threshold are pushed in buckets of up to this many bytes, each as one fused group
    (grouped_push_pull) once all of its gradients are ready; the buckets are formed from the
    parameters alone (reverse registration order), so every worker must build the optimizer
    from the same model. 0: every gradient is pushed on its own as soon as it is ready.

    The result is an instance of a subclass of optimizer's class, built from its param_groups
    (its state is kept)."""
    resolved = _horovod._resolve_op(average, op, "DistributedOptimizer")
    if resolved not in (_horovod.Average, _horovod.Sum):
        raise InvalidArgumentError("DistributedOptimizer: op=%s; gradients are summed or "
                                   "averaged (op=Sum or Average)" % resolved.name)
    if gradient_predivide_factor != 1.0 and resolved != _horovod.Average:
        raise ValueError("DistributedOptimizer: gradient_predivide_factor is supported with "
                         "op=Average only")
    if gradient_predivide_factor <= 0:
        raise ValueError("DistributedOptimizer: gradient_predivide_factor must be positive")
    if num_groups:
        groups = num_groups  # Horovod's older spelling of groups=<number>
    if groups is not None:
        if isinstance(groups, bool) or not (
                (isinstance(groups, int) and groups >= 0) or
                (isinstance(groups, (list, tuple)) and
                 all(isinstance(g, (list, tuple)) and
                     all(isinstance(p, torch.Tensor) for p in g) for g in groups))):
            raise ValueError("DistributedOptimizer: groups must be a non-negative number or a "
                             "list of lists of parameters")
        if groups == 0:
            groups = None
    if process_set.ranks is not None and process_set.process_set_id is None:
        raise InvalidArgumentError("DistributedOptimizer: %r is not registered "
                                   "(add_process_set)" % process_set)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    opt = cls(optimizer.param_groups, named_parameters, backward_passes_per_step,
              resolved == _horovod.Average, prefix, bucket_bytes, compression,
              gradient_predivide_factor, sparse_as_dense, process_set, groups)
    if optimizer.state:
        opt.state.update(optimizer.state)
    return opt
