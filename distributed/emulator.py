"""Threads as ranks: a torch.distributed group of N ranks in one process, one Python thread each, to
test communication code (the CP layer's CUDA path above all) without several GPUs.

NCCL refuses two ranks on one GPU and gloo moves no CUDA tensor point to point, so the CP layer's
streams, events and asynchronous waits cannot run on one GPU. `emulate(fn, world_size)` runs
`fn(rank, world_size)` on a thread per rank, each initialized with
`dist.init_process_group("emulated", ...)`: a backend registered from Python whose process group is
a `dist.ProcessGroup` subclass (as torch's threaded test group is), so the code under test calls
`dist.batch_isend_irecv`, `dist.all_gather`, `dist.reduce_scatter_single`, `dist.all_gather_object`,
`dist.get_rank(group)` ... unchanged. While it runs, c10d's world is thread-local (torch's
`ThreadLocalWorld`): each thread has its own default group.

NCCL's semantics, as emulated:

- Point-to-point: sends and receives pair in posting order per (sender, receiver); both ends
  contiguous, of one dtype and element count; tags must agree (NCCL ignores them, so code pairing
  messages by tag, as gloo allows, would pair the wrong ones there). A receive buffer is undefined
  until its wait returns: it is poisoned (NaN, or the dtype's largest value) when posted.
- CUDA tensors: each rank thread runs on its own current stream and has a communication stream. A
  transfer is a copy on the receiver's communication stream after events recorded on both posters'
  current streams at the post (the data and the buffer are ready), after `delay`; `Work.wait()`
  makes the caller's current stream wait for the copy's event. The host waits only until the peer
  has posted, where NCCL's stream would stall.
- CPU tensors: a transfer happens as late as allowed: the sender's wait copies the send buffer as
  it is then, the receiver's wait fills the receive buffer (each after the peer has posted, the
  receiver's after `delay`). Code that overwrites a send buffer or reads a receive buffer before
  its wait sees wrong data.
- `protect_buffers` (default): a message keeps its buffers alive until its waits (NCCL's stashing
  and record_stream). Off: nothing keeps them; a send buffer the program dropped before the
  transfer is an error, and on CUDA the memory of buffers dropped before the copy ran may be reused
  under it.
- `skip_waits`, the negative control: point-to-point waits return at once; transfers still happen,
  late (CPU: once every rank's function has returned; CUDA: on the communication stream, after
  `delay`). A check that passes with it cannot detect a missing wait.
- Collectives (sum all-reduce and reduce-scatter, all-gather, so all_gather_object, and barrier):
  every rank's n-th collective on a group must be the same call; it runs once all ranks joined (on
  CUDA, on the last joiner's communication stream after every rank's current stream), and its wait
  is a stream wait as above. It holds the ranks' tensors until it ran, no longer (on CUDA, with
  `protect_buffers`, their memory is not reused before its copies ran).
- NCCL's first-call rule: every rank of a group must join its first collective or batched
  point-to-point call. c10d posts a Python group's batch op by op, so the emulator sees operations,
  not batches: a group whose first call is point-to-point on some ranks but not on all is an error
  at the end of the run. `Emulation.calls` has every rank's calls for finer checks.
- A rank that raises stops the others where they wait; ranks all waiting on each other (a hang
  under NCCL) are an error naming what each waits for.

CuTe DSL kernels fail to compile off the main thread ("Please start a session before accessing
session data"): `warm_up` runs once on the main thread before the rank threads start, the place to
compile them (`flashmask3.verify.cp.compile_cp_kernels`).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BarrierOptions, ReduceScatterOptions

from ..reference.constructors import check_int

BACKEND = "emulated"
"""The name of the emulated backend in `dist.init_process_group`, valid inside `emulate` only."""

T = TypeVar("T")


class EmulatorError(Exception):
    """A call NCCL would reject or hang on, or a rank's failure, raised by `emulate`. Not a
    RuntimeError: code under test that falls back on a backend's RuntimeError must not hide it."""


class _Aborted(BaseException):
    """Another rank failed: this one stops where it waits (past the code's `except Exception`)."""


@dataclass(frozen=True)
class Call:
    """One communication call of a rank on a group, in the order the rank made them."""

    group: str
    """The group's name (c10d's)."""
    op: str
    """"send", "recv", or the collective: "allreduce", "allgather", "reduce_scatter", "barrier"."""
    peer: int | None
    """Point-to-point: the other end's group rank; None for a collective."""
    collective_index: int
    """How many collectives the rank had joined on the group before this call."""


@dataclass
class Emulation(Generic[T]):
    """What `emulate` returns: each rank's result and calls."""

    results: list[T]
    """fn's return value, by rank."""
    calls: list[list[Call]]
    """Every rank's communication calls, on all groups, in order."""
    world_group: str
    """The name of the default group."""

    def first_p2p_index(self, group: str | None = None) -> list[int | None]:
        """Per rank, how many collectives it had joined on `group` (default: the world) before its
        first point-to-point call there; None for a rank that made none."""
        name = self.world_group if group is None else group
        firsts: list[int | None] = []
        for calls in self.calls:
            p2p = [c.collective_index for c in calls if c.group == name and c.peer is not None]
            firsts.append(p2p[0] if p2p else None)
        return firsts


def _record_event(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """An event on this thread's current stream where `tensor` is on CUDA (it is ready there)."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _poison(tensor: torch.Tensor) -> None:
    """Fill a buffer whose contents are undefined, so that reading it shows."""
    if tensor.dtype == torch.bool:
        value: float | bool = True
    elif tensor.is_floating_point() or tensor.is_complex():
        value = math.nan
    else:
        value = torch.iinfo(tensor.dtype).max
    tensor.detach().fill_(value)


class _End:
    """One end of a point-to-point message as posted: the rank, the buffer, the tag."""

    def __init__(self, rank: int, tensor: torch.Tensor, tag: int, keep: bool):
        self.rank, self.tag = rank, tag
        self.numel, self.dtype, self.device = tensor.numel(), tensor.dtype, tensor.device
        self._kept: torch.Tensor | None = tensor if keep else None
        self._ref = weakref.ref(tensor)
        self.ready = _record_event(tensor)
        self.transfer: _Transfer | None = None

    def tensor(self) -> torch.Tensor | None:
        return self._kept if self._kept is not None else self._ref()

    def release(self) -> None:
        self._kept = None

    def describe(self) -> str:
        return f"{self.numel} x {self.dtype} with tag {self.tag}"


class _Transfer:
    """A matched send and receive: the n-th message from one rank to another on a group."""

    def __init__(self, group: str, index: int, send: _End, recv: _End):
        self.group, self.index, self.send, self.recv = group, index, send, recv
        self.lock = threading.Lock()
        self.snapshot: torch.Tensor | None = None
        self.delivered = False
        self.done: torch.cuda.Event | None = None

    def name(self) -> str:
        return f"message {self.index} from rank {self.send.rank} to rank {self.recv.rank} on group {self.group}"

    def source(self) -> torch.Tensor:
        tensor = self.snapshot if self.snapshot is not None else self.send.tensor()
        if tensor is None:
            raise EmulatorError(
                f"{self.name()}: rank {self.send.rank} dropped its send buffer before the transfer, and with "
                "protect_buffers=False nothing kept it alive; keep the tensor until the send's wait()"
            )
        return tensor

    def issue(self, stream: torch.cuda.Stream, sleep_cycles: int, protect: bool) -> None:
        """CUDA: the copy on the receiver's communication stream, after both posts."""
        source, target = self.source(), self.recv.tensor()
        assert self.send.ready is not None and self.recv.ready is not None
        with torch.cuda.stream(stream):
            stream.wait_event(self.send.ready)
            stream.wait_event(self.recv.ready)
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            if target is not None:
                target.detach().view(-1).copy_(source.detach().view(-1))
            self.done = torch.cuda.Event()
            self.done.record(stream)
        if protect:  # the caching allocator must not hand these out again before the copy ran
            source.record_stream(stream)
            if target is not None:
                target.record_stream(stream)

    def sender_done(self) -> None:
        """CPU: the sender's wait: the data as the send buffer holds it now."""
        with self.lock:
            if not self.delivered and self.snapshot is None:
                self.snapshot = self.source().detach().clone()
            self.send.release()

    def deliver(self, delay: float) -> None:
        """CPU: the receiver's wait (or the end of a run whose waits were skipped): fill its buffer."""
        with self.lock:
            if self.delivered:
                return
            target = self.recv.tensor()
            if target is not None:
                source = self.source()
                if delay:
                    time.sleep(delay)
                target.detach().view(-1).copy_(source.detach().view(-1))
            self.delivered = True
            self.snapshot = None
            self.send.release()
            self.recv.release()


class _Collective:
    """Every rank's n-th collective on a group: one call, run when the last rank joins."""

    def __init__(self, op: str, size: int):
        self.op = op
        self.args: list = [None] * size
        self.ready: list[torch.cuda.Event | None] = [None] * size
        self.joined = 0
        self.done = False
        self.event: torch.cuda.Event | None = None


class _GroupState:
    """What the ranks of one group share: the unmatched posts and the collectives."""

    def __init__(self, name: str, ranks: list[int]):
        self.name, self.ranks = name, ranks  # global ranks, by group rank
        self.sends: dict[tuple[int, int], deque[_End]] = {}  # (src, dst) group ranks -> unmatched, in order
        self.recvs: dict[tuple[int, int], deque[_End]] = {}
        self.matched: dict[tuple[int, int], int] = {}
        self.collectives: list[_Collective] = []
        self.joined = [0] * len(ranks)


class _Work(dist.Work):
    """A posted call; `wait()` completes it as the emulated backend does."""

    def __init__(self, complete: Callable[[], None]):
        super().__init__()
        self._complete = complete

    def wait(self, timeout=None) -> bool:
        self._complete()
        return True


class _EmulatedGroup(dist.ProcessGroup):
    """A rank's process group of the emulated backend: its calls go to the shared `_Emulator`."""

    def __init__(self, emulator: _Emulator, state: _GroupState, rank: int):
        super().__init__(rank, len(state.ranks))  # type: ignore[call-arg]  # the (rank, size) overload
        self._emulator, self._state, self._rank = emulator, state, rank

    def getBackendName(self) -> str:
        return BACKEND

    def send(self, tensors, dstRank, tag):
        return self._emulator.post(self._state, self._rank, "send", dstRank, tensors, tag)

    def recv(self, tensors, srcRank, tag):
        return self._emulator.post(self._state, self._rank, "recv", srcRank, tensors, tag)

    def allreduce(self, tensors, opts=AllreduceOptions()):  # type: ignore[override]
        _check_sum("all_reduce", opts)
        return self._emulator.collective(self._state, self._rank, "allreduce", list(tensors), _all_reduce)

    def allgather(self, output_tensors, input_tensors, opts=AllgatherOptions()):
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise EmulatorError("the emulated all_gather takes one input tensor and one output list")
        args = (list(output_tensors[0]), input_tensors[0])
        return self._emulator.collective(self._state, self._rank, "allgather", args, _all_gather)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        _check_sum("reduce_scatter", opts)
        return self._emulator.collective(self._state, self._rank, "reduce_scatter", (output, input), _reduce_scatter)

    # torch < 2.13 reaches the same call as `_reduce_scatter_base` (dist.reduce_scatter_tensor).
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=BarrierOptions()):
        return self._emulator.collective(self._state, self._rank, "barrier", None, lambda args: None)


def _check_sum(what: str, opts) -> None:
    if opts.reduceOp != dist.ReduceOp.SUM:
        raise EmulatorError(f"the emulated {what} reduces with ReduceOp.SUM only, got {opts.reduceOp.op}")


def _all_reduce(args: list[list[torch.Tensor]]) -> None:
    for i in range(len(args[0])):
        if len({a[i].shape for a in args}) != 1:
            raise EmulatorError(f"all_reduce of tensors of shapes {[tuple(a[i].shape) for a in args]} across ranks")
        total = sum((a[i] for a in args[1:]), args[0][i].clone())
        for a in args:
            a[i].detach().copy_(total)


def _all_gather(args: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
    for outputs, _ in args:
        if len(outputs) != len(args):
            raise EmulatorError(f"all_gather into {len(outputs)} tensors on a group of {len(args)}")
        for out, (_, part) in zip(outputs, args):
            if out.numel() != part.numel():
                raise EmulatorError(f"all_gather of {part.numel()} elements into a tensor of {out.numel()}")
            out.detach().copy_(part.detach().reshape(out.shape))


def _reduce_scatter(args: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    size = len(args)
    for dst, (out, _) in enumerate(args):
        parts = []
        for _, whole in args:
            if whole.numel() != size * out.numel():
                raise EmulatorError(f"reduce_scatter of {whole.numel()} elements into {size} x {out.numel()}")
            parts.append(whole.detach().reshape(size, -1)[dst])
        out.detach().view(-1).copy_(sum(parts[1:], parts[0].clone()))


class _Emulator:
    """The state every rank thread shares: groups, messages, collectives, the calls made."""

    def __init__(
        self, world_size: int, device: torch.device, delay: float, protect: bool, skip_waits: bool, timeout: float
    ):
        self.world_size, self.device = world_size, device
        self.delay, self.protect, self.skip_waits, self.timeout = delay, protect, skip_waits, timeout
        self.cond = threading.Condition()
        self.groups: dict[str, _GroupState] = {}
        self.world_group: str | None = None
        self.calls: list[list[Call]] = [[] for _ in range(world_size)]
        self.transfers: list[_Transfer] = []
        self.failure: tuple[int, BaseException] | None = None
        self.finished = 0
        self.waiting: dict[int, tuple[Callable[[], bool], str]] = {}  # global rank -> (done?, what it waits for)
        cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in range(world_size)] if cuda else []
        self.comm_streams = [torch.cuda.Stream(device) for _ in range(world_size)] if cuda else []
        self.sleep_cycles = round(delay * _cycles_per_second(device)) if cuda and delay else 0

    # -- groups ------------------------------------------------------------------------------
    def process_group(self, name: str, rank: int, size: int, global_ranks: list[int]) -> _EmulatedGroup:
        with self.cond:
            if name not in self.groups:
                self.groups[name] = _GroupState(name, global_ranks or list(range(size)))
                self.world_group = self.world_group or name  # the default group comes first
            return _EmulatedGroup(self, self.groups[name], rank)

    def _log(self, state: _GroupState, rank: int, op: str, peer: int | None) -> None:
        self.calls[state.ranks[rank]].append(Call(state.name, op, peer, state.joined[rank]))

    # -- waiting -----------------------------------------------------------------------------
    def _block(self, rank: int, done: Callable[[], bool], what: str) -> None:
        """Wait (holding `cond`) until done(); raise where another rank failed, on a hang of every
        rank, or after the timeout."""
        deadline = time.monotonic() + self.timeout
        self.waiting[rank] = (done, what)
        try:
            while not done():
                if self.failure is not None:
                    raise _Aborted
                if self.finished + len(self.waiting) == self.world_size and not any(
                    check() for check, _ in self.waiting.values()
                ):
                    waits = "; ".join(f"rank {r} waits for {w}" for r, (_, w) in sorted(self.waiting.items()))
                    raise EmulatorError(f"every rank waits and none can go on (NCCL would hang): {waits}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EmulatorError(f"rank {rank} waited {self.timeout:g} s for {what}")
                self.cond.wait(left)
        finally:
            del self.waiting[rank]

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, error)
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.finished += 1
            self.cond.notify_all()

    # -- point-to-point ----------------------------------------------------------------------
    def post(self, state: _GroupState, rank: int, op: str, peer: int, tensors: list[torch.Tensor], tag: int) -> _Work:
        if len(tensors) != 1:
            raise EmulatorError(f"{op} takes one tensor, got {len(tensors)}")
        tensor = tensors[0]
        src, dst = (rank, peer) if op == "send" else (peer, rank)
        if not tensor.is_contiguous():
            raise EmulatorError(
                f"{op} from rank {src} to rank {dst} on group {state.name}: the tensor must be contiguous "
                f"(NCCL moves its storage as it lies), got shape {tuple(tensor.shape)} strides {tensor.stride()}"
            )
        if op == "recv":
            _poison(tensor)
        end = _End(state.ranks[rank], tensor, tag, self.protect)
        with self.cond:
            self._log(state, rank, op, peer)
            mine, theirs = (state.sends, state.recvs) if op == "send" else (state.recvs, state.sends)
            if theirs.get((src, dst)):
                other = theirs[(src, dst)].popleft()
                self._match(state, (src, dst), *((end, other) if op == "send" else (other, end)))
            else:
                mine.setdefault((src, dst), deque()).append(end)
            self.cond.notify_all()
        return _Work(lambda: self._wait_p2p(state, end, op, peer))

    def _match(self, state: _GroupState, pair: tuple[int, int], send: _End, recv: _End) -> None:
        index = state.matched.get(pair, 0)
        state.matched[pair] = index + 1
        transfer = _Transfer(state.name, index, send, recv)
        if (send.tag, send.numel, send.dtype) != (recv.tag, recv.numel, recv.dtype):
            raise EmulatorError(
                f"{transfer.name()}: sent {send.describe()} but received into {recv.describe()}; NCCL pairs "
                "messages in posting order per pair of ranks, ignoring tags, and needs equal sizes and dtypes"
            )
        if send.device != recv.device:
            raise EmulatorError(f"{transfer.name()}: sent from {send.device} but received on {recv.device}")
        if send.device.type == "cuda":
            transfer.issue(self.comm_streams[recv.rank], self.sleep_cycles, self.protect)
        send.transfer = recv.transfer = transfer
        self.transfers.append(transfer)

    def _wait_p2p(self, state: _GroupState, end: _End, op: str, peer: int) -> None:
        if self.skip_waits:
            return
        what = f"rank {state.ranks[peer]} to post the {'recv' if op == 'send' else 'send'} matching its {op}"
        with self.cond:
            self._block(end.rank, lambda: end.transfer is not None, f"{what} on group {state.name}")
        transfer = end.transfer
        assert transfer is not None
        if transfer.done is not None:
            torch.cuda.current_stream().wait_event(transfer.done)
            end.release()
        elif op == "send":
            transfer.sender_done()
        else:
            transfer.deliver(self.delay)

    # -- collectives -------------------------------------------------------------------------
    def collective(self, state: _GroupState, rank: int, op: str, args, run: Callable[[list], None]) -> _Work:
        tensors = [t for t in _tensors(args) if t.is_cuda]
        ready = _record_event(tensors[0]) if tensors else None
        with self.cond:
            self._log(state, rank, op, None)
            index = state.joined[rank]
            state.joined[rank] += 1
            if index == len(state.collectives):
                state.collectives.append(_Collective(op, len(state.ranks)))
            call = state.collectives[index]
            if call.op != op:
                raise EmulatorError(
                    f"collective {index} on group {state.name}: rank {state.ranks[rank]} calls {op} but another "
                    f"rank called {call.op}; every rank must make the same collectives in the same order"
                )
            call.args[rank], call.ready[rank] = args, ready
            call.joined += 1
            if call.joined == len(state.ranks):
                self._run_collective(call, run, state.ranks[rank], bool(tensors))
                self.cond.notify_all()
        return _Work(lambda: self._wait_collective(state, rank, index, call))

    def _run_collective(self, call: _Collective, run: Callable[[list], None], rank: int, cuda: bool) -> None:
        """Run the call on every rank's tensors, then let go of them: the call outlives its run
        (the waits refer to it), and holding every rank's buffers of every collective for the whole
        run grows the memory with each call until the device runs out."""
        with torch.no_grad():
            if not cuda:
                run(call.args)
            else:
                stream = self.comm_streams[rank]
                with torch.cuda.stream(stream):
                    for event in call.ready:
                        if event is not None:
                            stream.wait_event(event)
                    run(call.args)
                    call.event = torch.cuda.Event()
                    call.event.record(stream)
                if self.protect:  # as for messages: no reuse of the memory before the copies ran
                    for tensor in _tensors(call.args):
                        if tensor.is_cuda:
                            tensor.record_stream(stream)
        call.args, call.ready = [], []
        call.done = True

    def _wait_collective(self, state: _GroupState, rank: int, index: int, call: _Collective) -> None:
        with self.cond:
            self._block(
                state.ranks[rank], lambda: call.done, f"every rank of group {state.name} to join {call.op} {index}"
            )
        if call.event is not None:
            torch.cuda.current_stream().wait_event(call.event)

    # -- the end of a run --------------------------------------------------------------------
    def close(self) -> None:
        """After every rank returned: raise a rank's failure; make the late transfers (CPU, waits
        skipped); refuse unmatched messages and a broken first-call rule."""
        if self.failure is not None:
            rank, error = self.failure
            raise EmulatorError(f"rank {rank} failed: {type(error).__name__}: {error}") from error
        for transfer in self.transfers:
            if transfer.done is None:
                transfer.deliver(0.0)  # already late
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for state in self.groups.values():
            for kind, posts in (("send", state.sends), ("recv", state.recvs)):
                for (src, dst), ends in posts.items():
                    if ends:
                        raise EmulatorError(
                            f"group {state.name}: {len(ends)} {kind}(s) from rank {state.ranks[src]} to rank "
                            f"{state.ranks[dst]} never matched (first: {ends[0].describe()}); NCCL would hang"
                        )
            firsts = {}
            for rank in state.ranks:
                calls = [c for c in self.calls[rank] if c.group == state.name]
                firsts[rank] = calls[0].op if calls else "nothing"
            p2p = [r for r, op in firsts.items() if op in ("send", "recv")]
            if p2p and len(p2p) < len(firsts):
                others = {r: op for r, op in firsts.items() if r not in p2p}
                raise EmulatorError(
                    f"group {state.name}: ranks {p2p} began with a point-to-point call, ranks {others} otherwise; "
                    "NCCL needs every rank of a group in its first collective or batched point-to-point call"
                )


def _tensors(args) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (list, tuple)):
        return [t for a in args for t in _tensors(a)]
    return []


def _cycles_per_second(device: torch.device) -> float:
    """The GPU's clock as `torch.cuda._sleep` counts it, measured."""
    with torch.cuda.device(device):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # clocks up
        start.record()
        torch.cuda._sleep(10_000_000)
        stop.record()
        stop.synchronize()
        return 10_000_000 / (start.elapsed_time(stop) / 1e3)


_thread = threading.local()  # a rank thread's emulator, for the backend's creator
_one_at_a_time = threading.Lock()
_registered = False


def _isolate_threads(on: bool) -> None:
    """c10d registers group names per thread (the ranks' groups share names), as torch's threaded tests do."""
    torch._C._distributed_c10d._set_thread_isolation_mode(on)  # type: ignore[attr-defined]


def _create_group(options, _backend_options) -> dist.ProcessGroup:
    emulator = getattr(_thread, "emulator", None)
    if emulator is None:
        raise RuntimeError(f"the {BACKEND!r} backend runs only inside flashmask3.distributed.emulator.emulate()")
    return emulator.process_group(
        options.group_id, options.group_rank, options.group_size, list(options.global_ranks_in_group)
    )


def _rank_main(emulator: _Emulator, rank: int, fn: Callable[[int, int], T], store, results: list) -> None:
    _thread.emulator = emulator
    try:
        # Autograd's CUDA worker thread is one per device: the ranks' backward passes must run on
        # their own threads, or they wait on each other in one queue.
        with torch.autograd.set_multithreading_enabled(False):
            if emulator.streams:
                torch.cuda.set_device(emulator.device)
                with torch.cuda.stream(emulator.streams[rank]):
                    results[rank] = _in_group(emulator, rank, fn, store)
            else:
                results[rank] = _in_group(emulator, rank, fn, store)
    except _Aborted:
        pass
    except BaseException as error:
        emulator.fail(rank, error)
    finally:
        emulator.finish()


def _in_group(emulator: _Emulator, rank: int, fn: Callable[[int, int], T], store) -> T:
    # No destroy_process_group: the thread's world and group names die with the thread (and
    # torch's ThreadLocalWorld lags c10d's world in some versions: 2.11's has no `comms`).
    dist.init_process_group(BACKEND, rank=rank, world_size=emulator.world_size, store=store)
    return fn(rank, emulator.world_size)


def emulate(
    fn: Callable[[int, int], T],
    world_size: int,
    *,
    device: str | torch.device = "cpu",
    delay: float = 0.0,
    protect_buffers: bool = True,
    skip_waits: bool = False,
    warm_up: Callable[[], object] | None = None,
    timeout: float = 60.0,
) -> Emulation[T]:
    """Run `fn(rank, world_size)` on `world_size` threads, each a rank of a default group of the
    emulated backend (see the module's docstring for its semantics).

    Args:
        fn: the rank's work; it may create subgroups (`dist.new_group`) and returns its result.
        world_size: the number of ranks (threads).
        device: "cpu" or a CUDA device that every rank shares (each rank thread gets it as its
            current device, and its own current stream).
        delay: seconds before each point-to-point transfer (CUDA: `torch.cuda._sleep` on the
            communication stream; CPU: `time.sleep` at the receiver's wait), so that a missing wait
            shows as wrong numbers.
        protect_buffers: keep each message's buffers alive until its waits (NCCL's behavior); off,
            to find code that drops send buffers early.
        skip_waits: the negative control: point-to-point waits do nothing, transfers come late.
        warm_up: called once on this (the main) thread before the rank threads start: compile
            kernels here (the CuTe DSL compiles on the main thread only).
        timeout: seconds a rank may wait for its peers before the run fails.

    Returns:
        Every rank's result and calls. A rank's exception, or a call NCCL would reject or hang on,
        raises EmulatorError (the rank's exception as its cause).
    """
    global _registered
    world_size = check_int("world_size", world_size, 1)
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {str(device)!r}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if delay < 0 or timeout <= 0:
        raise ValueError(f"delay must be >= 0 and timeout > 0 seconds, got delay={delay!r}, timeout={timeout!r}")
    if not _one_at_a_time.acquire(blocking=False):
        raise RuntimeError("emulate() runs one emulation at a time (c10d's world is swapped while it runs)")
    try:
        # torch's threaded test group keeps its world per thread; that module registers its own backend.
        from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

        if not _registered:
            dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu", "cuda"])
            _registered = True
        if warm_up is not None:
            warm_up()
        emulator = _Emulator(world_size, device, delay, protect_buffers, skip_waits, timeout)
        results: list = [None] * world_size
        store = dist.HashStore()
        saved, c10d._world = c10d._world, ThreadLocalWorld()  # type: ignore[assignment]
        _isolate_threads(True)
        try:
            threads = [
                threading.Thread(
                    target=_rank_main, args=(emulator, r, fn, store, results), name=f"emulated-rank-{r}", daemon=True
                )
                for r in range(world_size)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            _isolate_threads(False)
            c10d._world = saved
        emulator.close()
        assert emulator.world_group is not None
        return Emulation(results, emulator.calls, emulator.world_group)
    finally:
        _one_at_a_time.release()
