"""Data-parallel training under `torchrun`, shared by every method that trains one large model.

Launched by torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK), a method's training loop does:

    model = distributed.wrap(model)          # DistributedDataParallel: gradients averaged over ranks
    batch = distributed.shard(batch)         # this rank's equal slice of the global batch
    rows, real = distributed.share(len(batch))  # or, for a token-summed loss: rows, then ÷ sum_divisor(count)
    value = distributed.mean(loss.item())    # the global-batch value, the same on every rank
    jobs = distributed.from_main(jobs)       # rank 0's decision (e.g. what --resume still has to do)
    distributed.average_gradients(params)    # after backward, instead of wrap, for routed loops (see it)
    z = distributed.gather(z)                # a loss coupling the batch's rows: every rank's, differentiable
    if distributed.is_main(): save(...)      # checkpoints: rank 0 alone

With equal slices the mean of the ranks' mean losses is the loss of the global batch, so the averaged
gradient, and every update after it, is that of one process on the global batch up to the order of
floating-point sums. The run directory is rank 0's alone: the train command opens it through
`rank_store`, which on rank 0 is the real store (it sends the run's identity to the other ranks) and
on the others a scratch copy deleted at exit, so their lifecycle bookkeeping writes nothing real.
A failure on one rank prints its one error line and exits; torchrun stops the other ranks (SIGTERM):
they stay silent (`ranks_stop_together` holds back the errors of collectives whose peer died) and
rank 0 marks its run failed, with the --resume command. Ctrl-C is reported by rank 0 alone. Without torchrun every call is the identity and
torch.distributed is never imported: single-process results are unchanged.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .errors import IcmlError
from .runstore import Run, RunStore

_started = False
_run: Run | None = None  # rank 0's run, marked failed if torchrun stops this rank


def launched() -> bool:
    """Whether this process is one of several ranks started by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    return int(os.environ.get("RANK", "0")) if launched() else 0


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


def start(device: str = "auto") -> None:
    """Join the process group once: gloo for CPU tensors, NCCL for CUDA ones (each rank on the GPU
    of its LOCAL_RANK). Ranks other than 0 stay quiet (progress and info lines would repeat)."""
    global _started
    if _started or not launched():
        return
    import torch
    import torch.distributed as dist

    from . import console

    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
    atexit.register(_stop)
    _started = True
    if is_main():
        signal.signal(signal.SIGTERM, _stopped_by_torchrun)
    else:  # torchrun stops these when rank 0 ends; rank 0 alone reports (Ctrl-C included)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        console.set_quiet(True)


def _stop() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _stopped_by_torchrun(signum, frame) -> None:
    """SIGTERM on rank 0: torchrun stops every rank when one fails, and that rank printed the error
    line. Record the stop in run.json and exit silently. (After Ctrl-C the lifecycle is already
    recording the interruption, and torchrun waits for it.)"""
    if sys.exc_info()[0] is KeyboardInterrupt:
        return
    if _run is not None:
        try:
            info = _run.info()
            for phase, entry in info.get("phases", {}).items():
                if entry.get("status") == "running":
                    _run.set_phase(phase, "failed", error="stopped: another torchrun rank failed (its error line "
                                   f"is in the launch's output) — resume with: icml {info['method']} train "
                                   f"--resume {_run.path}")
        except Exception:  # never mask the stop itself
            pass
    os._exit(128 + signum)


STOP_GRACE_SECONDS = 30.0  # torchrun polls its ranks every 0.1 s; this is ample time to be stopped


@contextmanager
def ranks_stop_together() -> Iterator[None]:
    """Around a training step or job under torchrun: a collective that fails because another rank
    died waits, silently, for torchrun to stop this rank, so the failing rank's line is the only one.
    An error of this rank's own (or a stop that never comes) is raised as usual."""
    try:
        yield
    except Exception as exc:
        if launched() and _peer_gone(exc):
            time.sleep(STOP_GRACE_SECONDS)  # SIGTERM ends the process during the sleep
        raise


def _peer_gone(exc: Exception) -> bool:
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "remote worker"))


# ---------------------------------------------------------------------------------------------
# The training loop's calls
# ---------------------------------------------------------------------------------------------
def wrap(model):
    """`model` in DistributedDataParallel under torchrun (on its GPU if it has one); else `model`."""
    if not launched():
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def is_replica(model) -> bool:
    """Whether `model` came out of `wrap` as a DistributedDataParallel replica (under torchrun): a loss
    computed through it is this rank's share of the global batch's."""
    if not launched():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def shard(batch):
    """This rank's contiguous slice of a global batch (rows along dim 0); the batch itself alone.
    Slices must be equal, so that the mean of the ranks' mean losses is the global batch's."""
    if not launched():
        return batch
    rows, ranks = batch.shape[0], world_size()
    if rows % ranks:
        raise IcmlError(f"a global batch of {rows} rows does not split evenly over {ranks} ranks",
                        f"use a batch size divisible by {ranks} (--set batch_size=...)")
    size = rows // ranks
    return batch[rank() * size:(rank() + 1) * size]


def share(rows: int) -> tuple[slice, bool]:
    """This rank's contiguous rows of a global batch whose loss is a sum over target tokens divided by
    the global batch's count (rows of unequal weight, where `shard`'s mean of means would be wrong):
    shares differ by at most one row, and each rank divides its sum by `sum_divisor(count)`. With fewer
    rows than ranks, a rank without rows gets row 0 as a stand-in that the caller weights zero (every
    rank must run forward and backward each step for DDP's gradient average); the flag says whether
    the rows are real. Without torchrun: every row, real."""
    if not launched():
        return slice(0, rows), True
    base, extra = divmod(rows, world_size())
    start = rank() * base + min(rank(), extra)
    stop = start + base + (rank() < extra)
    return (slice(start, stop), True) if stop > start else (slice(0, 1), False)


def sum_divisor(count):
    """What a rank divides the summed loss of its `share` by: the global batch's `count` of targets over
    the ranks, so that DDP's mean of the ranks' gradients is that of (global sum) / count."""
    return count / world_size() if launched() else count


def mean(value: float) -> float:
    """The mean of `value` over the ranks (a per-rank mean over equal slices becomes the global one)."""
    if not launched():
        return value
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / world_size()


def average_gradients(params) -> None:
    """Under torchrun: every parameter's .grad becomes the mean over the ranks, as DDP's would, for a
    loop that routes each micro-batch through different parameters and steps once after accumulating
    (where DDP's reducer, built for one fixed set of used parameters per backward, does not fit). A
    parameter that received no gradient on any rank keeps .grad None (an optimizer skips it, as in one
    process); one that received some on any rank gets the mean with zeros for the others (its
    gradient on the global batch). Call it after the last backward of a step, before clipping.
    Without torchrun: nothing."""
    if not launched():
        return
    import torch
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    if not params:
        return
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    dist.all_reduce(present)
    buckets: dict = {}
    for p, anywhere in zip(params, present.tolist()):
        if anywhere:
            buckets.setdefault((p.device, p.dtype), []).append(p)
    for bucket in buckets.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in bucket])
        dist.all_reduce(flat)
        flat /= world_size()
        for p, grad in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad = grad.view_as(p)
    for p, anywhere in zip(params, present.tolist()):
        if not anywhere:
            p.grad = None


def gather(tensor, dim: int = 0):
    """Every rank's `tensor` concatenated along `dim` in rank order (the global batch's rows, from
    each rank's `shard`), differentiable: for a loss that couples a batch's rows (contrastive, batch
    statistics). Every rank then computes the same global loss; the gradient that flows back to a
    rank's rows is the sum of all ranks' (world_size × its own), and the ranks' mean of the parameter
    gradients (`average_gradients` or DDP) is the global loss's gradient. Without torchrun: `tensor`."""
    if not launched():
        return tensor
    return _gathering().apply(tensor, dim)


_Gather = None


def _gathering():
    """The autograd function of `gather` (defined on first use: importing this module never imports torch)."""
    global _Gather
    if _Gather is None:
        import torch
        import torch.distributed as dist

        class _Gather(torch.autograd.Function):  # noqa: N801 - an autograd Function
            @staticmethod
            def forward(ctx, tensor, dim):
                parts = [torch.empty_like(tensor) for _ in range(world_size())]
                dist.all_gather(parts, tensor.contiguous())
                ctx.dim, ctx.rows = dim, tensor.shape[dim]
                return torch.cat(parts, dim=dim)

            @staticmethod
            def backward(ctx, grad):  # this rank's rows of the sum of every rank's gradient
                total = grad.contiguous().clone()
                dist.all_reduce(total)
                return total.narrow(ctx.dim, rank() * ctx.rows, ctx.rows), None
    return _Gather


def barrier() -> None:
    """Under torchrun: wait until every rank is here (e.g. until rank 0 has written a checkpoint that
    the others read next). Without torchrun: nothing."""
    if launched():
        import torch.distributed as dist

        dist.barrier()


def from_main(obj: Any) -> Any:
    """Rank 0's `obj`, on every rank (picklable objects)."""
    if not launched():
        return obj
    import torch.distributed as dist

    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------
# The run directory: rank 0's alone
# ---------------------------------------------------------------------------------------------
def rank_store(store: RunStore, device: str = "auto") -> RunStore:
    """The store a train command uses: `store` itself without torchrun; under torchrun `store` on
    rank 0, which sends every run it creates or opens to the other ranks, and on those a scratch store
    that mirrors it (run.json and config.json only: they need the config, never the results)."""
    if not launched():
        return store
    start(device)
    return _MainStore(store.root) if is_main() else _MirrorStore()


class _MainStore(RunStore):
    def create(self, *args, **kwargs) -> Run:
        return _send(super().create(*args, **kwargs))

    def open(self, path, method=None) -> Run:
        return _send(super().open(path, method))


def _send(run: Run) -> Run:
    global _run
    _run = run
    from_main({"method": run.info()["method"], "name": run.path.name,
               "files": {name: (run.path / name).read_text() for name in ("run.json", "config.json")}})
    return run


class _MirrorStore(RunStore):
    def __init__(self):
        root = Path(tempfile.mkdtemp(prefix=f"icml-rank{rank()}-"))
        atexit.register(shutil.rmtree, root, True)
        super().__init__(root)

    def create(self, *args, **kwargs) -> Run:
        return self._mirror()

    def open(self, path, method=None) -> Run:
        return self._mirror()

    def _mirror(self) -> Run:
        record = from_main(None)
        run = Run(self.root / record["method"] / record["name"])
        run.path.mkdir(parents=True, exist_ok=True)
        for name, text in record["files"].items():
            (run.path / name).write_text(text)
        return run
