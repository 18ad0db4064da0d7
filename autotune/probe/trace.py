"""The probe's own step traced with fake tensors: the bytes one rank would allocate, per phase.

`trace_request` runs the built-in probe (step/training.py: build, then two steps, every phase)
under torch's FakeTensorMode, as rank 0 of the W-rank run over the fake process group
(sharding.py), on any machine: floating-point tensors carry shape, dtype and device but no
storage, so a 7B model on 8 GPUs traces on a laptop's CPU. Integer and boolean tensors (token
ids, positions, masks, indices: a small share of the bytes) are real, because the models' code
reads their values (Qwen2.5-VL's vision tower splits its attention by the image grid; the
placeholder check counts image tokens); a token an argmax would pick from fake logits is 0.

Every storage the step creates, fake or real, is counted while it lives (torch's MemTracker
counts the same way: storage weak references, plus `UntypedStorage.resize_`, which FSDP2 and
the sleeping engine use to free and refill memory), so each phase's peak is the largest sum of
live device bytes, exactly, for the shapes and kernels of this torch and transformers. What
offload moves to the host is counted apart, and on a GPU cuBLAS's workspaces where a
thread's first GEMM makes one (the forward's, the backward's). The rest is the fixed term,
`context_bytes`: the CUDA context and NCCL's buffers on a GPU (the allocator's rounding is
the replay's); the interpreter's own memory on a CPU.

A GPU run is traced on the CPU with the GPU's kernels' memory where they differ: bf16 compute
under autocast, and AdamW's foreach step (one fp32 temporary the size of the rank's shard).
Loops that repeat the same shapes (generation batches, prefill chunks, decode steps, log-prob
chunks, micro-batches, mini-batches) run two iterations, the first and the last (with a
generation's smaller last batch, the last full one too), and put a result of the same bytes
in place of each other: the first holds what happens once (gradients made, AdamW's state,
FSDP's first all-gathers), the last all that earlier iterations leave behind, so each phase's
peak is exactly that of every iteration (tests compare the two). Both steps run so: the first
brings AdamW's state and the last step's results into being for the second, and where the
caching allocator puts AdamW's state depends on what the first mini-batch's micro-batches
left cached. With the first step's first iteration alone, README command 1's update (64
micro-batches a mini-batch, both offloads) replayed 10.11 GiB reserved against 10.97 for
every iteration and 11.02 on the H200; with its first and last, 10.97 (+27% trace time). A
CPU's trace has no allocator to replay (its peaks are the live tensors, which the second step
holds at least as many of in every phase: AdamW's state from its start), so its first step runs
each loop's first iteration alone (-25 to -35% trace time on the demo's configs). So
a trace takes seconds, not the step's length; what remains is Python's dispatch of each op,
kept lean (C++ asks a fake tensor its device about four times an op: answered first thing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, TypeGuard
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from autotune.memory.replay import (
    ALLOC,
    EMPTY_CACHE,
    FREE,
    MARK,
    PHASE,
    RECORD,
    replay,
    smallest_cap,
)
from autotune.memory.workspaces import CUBLAS_WORKSPACE_BYTES
from autotune.probe.measure.result import ProbeRequest, ProbeStatus
from autotune.probe.measure.unit_loops import SHORT_SAMPLE, UnitClock

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

TRACE_REPEATS = 2  # iterations of a repeated loop a trace runs: its first and its last
_aten = torch.ops.aten
_INIT_OPS = {_aten.uniform_.default, _aten.normal_.default}  # random init: nothing to count
# A functional collective's wait returns its input, the same storage (its schema does not say
# so, and the fake kernel makes a new tensor: a gathered weight would count twice).
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
# C++ asks a fake tensor its device through the dispatcher, several times an op (most of the
# ops a trace sees): answered at once, since nothing is allocated.
_PRIM_DEVICE = torch.ops.prim.device.default
_PLAIN_TYPES = (torch.Tensor, FakeTensor, torch.nn.Parameter)  # not a wrapper such as DTensor
# The autograd engine sums two gradients of one input (InputBuffer::accumulate) in place on
# real tensors, out of place on a tensor subclass such as FakeTensor: seen as this op
# between two backward nodes, with grad mode off (a checkpointed recompute runs with it on).
_ADD = _aten.add.Tensor
# Backward formulas that fill a fresh zero tensor do it in place on real tensors and out of
# place on a tensor subclass ("for composite, vmap and inductor compliance"): gather's
# (aten/src/ATen/native/TensorAdvancedIndexing.cpp gather_backward: new_zeros, then
# scatter_add_ or scatter_add) and index_select's (FunctionsManual.cpp
# index_select_backward: index_add_ or index_add). Out of place, the trace would make a
# second block of the zeros' size and free the first: one more [tokens, vocabulary] block
# in every unfused log-prob's backward, which the allocator replay then has to fit (the
# single-GPU updates' missing 1.7 GiB on the H200).
_FILL_ZEROS = {_aten.scatter_add.default, _aten.index_add.default}
# The ops a GPU runs through cuBLAS, every overload: a thread's first makes its workspace.
_GEMMS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.mv,
          _aten.addmv, _aten.dot, _aten.vdot, _aten._addmm_activation, _aten._scaled_mm}


@dataclass
class _Storage:
    size_bytes: int
    on_host: bool = False
    alloc_id: int = 0  # its live device allocation in the recorded stream (0: none)


class AllocationTracker:
    """Live bytes of every storage the traced step holds, on the device and on the host, and
    the stream of device allocations and frees in the order the step makes them (with the
    stream each is made on: FSDP2 gathers and reduces on streams of its own), which
    memory/replay.py replays through the CUDA caching allocator's rules."""

    def __init__(self) -> None:
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.paused = 0  # > 0: DTensor is propagating shapes (tensors of no rank's memory)
        self.events: list[tuple] = []  # replay.py's ALLOC, FREE, PHASE, ... events
        self._streams: dict[int, int] = {}  # id of a torch.cpu stream -> its number
        self._next_id = 0
        self._workspaces: set[tuple[bool, int]] = set()  # cuBLAS's: (backward, stream)

    def _add(self, record: _Storage, num_bytes: int) -> None:
        if record.on_host:
            self.host_bytes += num_bytes
        else:
            self.device_bytes += num_bytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _stream(self, stream: object | None = None) -> int:
        """The number of `stream`, by default the one an allocation is made on now: FSDP on
        a CPU device selects torch.cpu's stand-in streams exactly where it selects CUDA
        streams on a GPU."""
        stream = torch.cpu.current_stream() if stream is None else stream
        return self._streams.setdefault(id(stream), len(self._streams))

    def _allocated(self, record: _Storage) -> None:
        if not record.on_host and record.size_bytes:
            self._next_id += 1
            record.alloc_id = self._next_id
            self.events.append((ALLOC, record.alloc_id, record.size_bytes, self._stream()))

    def gemm(self, backward: bool) -> None:
        """A GEMM on a GPU: the first of its thread (the forward's, the autograd engine's in
        a backward) on its stream makes that cuBLAS handle's workspace (memory/workspaces.py)."""
        key = (backward, self._stream())
        if key not in self._workspaces and not self.paused:
            self._workspaces.add(key)
            self._next_id += 1
            self.events.append((ALLOC, self._next_id, CUBLAS_WORKSPACE_BYTES, key[1]))

    def recorded(self, tensor: torch.Tensor, stream: object) -> None:
        """`record_stream(tensor, stream)` (FSDP1's, which torch skips on a CPU tensor): the
        block is used on `stream` too, so the allocator defers its reuse after its free."""
        record = self._storages.get(tensor.untyped_storage())
        if record is not None and record.alloc_id:
            self.events.append((RECORD, record.alloc_id, self._stream(stream)))

    def marked(self) -> None:
        """FSDP1 resharded a unit and queued its free event (`_FreeEventQueue.enqueue`):
        the replay counts how far the GPU runs behind by these."""
        self.events.append((MARK,))

    def _freed(self, record: _Storage) -> None:
        if record.alloc_id:
            self.events.append((FREE, record.alloc_id))
            record.alloc_id = 0

    def track(self, tensor: torch.Tensor) -> None:
        if self.paused:
            return
        if type(tensor) not in _PLAIN_TYPES:
            return  # a wrapper (DTensor): its local tensor was counted when it was made
        if tensor.device.type == "meta":
            return  # no memory anywhere (the engine's StaticCache is built on meta, then
            # pointed at views of the pool: counted, it would add a whole cache per batch)
        storage = tensor.untyped_storage()
        if storage in self._storages:
            return
        record = _Storage(storage.nbytes())
        self._storages[storage] = record
        key = id(record)

        def freed(_: weakref.ref[torch.UntypedStorage]) -> None:
            self._add(record, -record.size_bytes)
            self._freed(record)
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)
        self._add(record, record.size_bytes)
        self._allocated(record)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """`UntypedStorage.resize_`: on a GPU a new block of the new size (the old one freed
        after the copy), none at size 0."""
        record = self._storages.get(storage)
        if record is not None and record.size_bytes != storage.nbytes():
            self._add(record, storage.nbytes() - record.size_bytes)
            old_id = record.alloc_id
            record.alloc_id = 0
            record.size_bytes = storage.nbytes()
            self._allocated(record)
            if old_id:
                self.events.append((FREE, old_id))

    def made_in_place(self, into: object, out: object, into_just_made: bool = False) -> None:
        """An op a GPU runs in place on `into` made `out` on the trace's fake tensors (the
        autograd engine's sum of two gradients, torch/csrc/autograd/input_buffer.cpp; a
        backward's fill of fresh zeros, _FILL_ZEROS): `out` takes `into`'s block and no new
        one. `into_just_made`: only when `into`'s block was the allocation right before."""
        if not (isinstance(into, torch.Tensor) and isinstance(out, torch.Tensor)) or not (
                into.is_floating_point() and out.is_floating_point()) or \
                into.shape != out.shape or into.dtype != out.dtype:
            return
        kept = self._storages.get(into.untyped_storage())
        made = self._storages.get(out.untyped_storage())
        if kept is None or made is None or not kept.alloc_id or not made.alloc_id or \
                self.events[-1][:2] != (ALLOC, made.alloc_id):
            return
        if into_just_made and (len(self.events) < 2
                               or self.events[-2][:2] != (ALLOC, kept.alloc_id)):
            return
        self.events.pop()
        made.alloc_id, kept.alloc_id = kept.alloc_id, 0

    def mark_host(self, tensor: torch.Tensor, on_host: bool) -> None:
        """`tensor`'s storage now counts as host memory (offload), or as the device's again.
        A copy made for the host (the trace clones on its one device) was never a device
        allocation: its event is taken back."""
        self.track(tensor)
        record = self._storages[tensor.untyped_storage()]
        if record.on_host != on_host:
            self._add(record, -record.size_bytes)
            if on_host and record.alloc_id and self.events[-1][:2] == (ALLOC, record.alloc_id):
                self.events.pop()
                record.alloc_id = 0
            else:
                self._freed(record)
            record.on_host = on_host
            self._add(record, record.size_bytes)
            self._allocated(record)

    def is_host(self, tensor: torch.Tensor) -> bool:
        record = self._storages.get(tensor.untyped_storage())
        return record is not None and record.on_host


def _tensors(values: Iterable[object]) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (an op nests them in lists and tuples
    only): pytree's general walk costs more than the op itself, at a million ops a trace."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


def _is_float(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and (value.is_floating_point()
                                                or value.is_complex())


class _TraceMode(TorchDispatchMode):
    """Runs each op fake or real (see the module doc) and counts what it allocates."""

    def __init__(self, fake_mode: FakeTensorMode, tracker: AllocationTracker,
                 gpu_kernels: bool = False) -> None:
        super().__init__()
        self.fake_mode, self.tracker, self.gpu_kernels = fake_mode, tracker, gpu_kernels

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        if func is _PRIM_DEVICE and isinstance(args[0], FakeTensor):
            return args[0].fake_device
        kwargs = kwargs or {}
        if func in _INIT_OPS or func is _WAIT_TENSOR:
            return args[0]
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented  # DTensor: it unwraps and calls back with local tensors
        inputs = _tensors(args) + _tensors(kwargs.values()) if kwargs else _tensors(args)
        fake_in = any(isinstance(t, FakeTensor) or _is_float(t) for t in inputs)
        if not fake_in and inputs:  # integers and booleans only: compute them
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)  # the fake mode beneath makes it fake
            if not inputs and not any(_is_float(t) for t in _tensors((out,))):
                with unset_fake_temporarily():  # an integer factory (arange, randint)
                    out = func(*args, **kwargs)
            elif not func._schema.is_mutable and not func.is_view:
                out = tree_map(self._real_integers, out)
        for tensor in _tensors((out,)):
            self.tracker.track(tensor)
        if self.gpu_kernels and func.overloadpacket in _GEMMS:
            self.tracker.gemm(backward=torch._C._current_autograd_node() is not None)
        if (func is _ADD or func in _FILL_ZEROS) and not torch.is_grad_enabled() \
                and torch._C._current_autograd_node() is not None:
            if func is _ADD and len(args) == 2 and not kwargs and _is_float(args[1]):
                self.tracker.made_in_place(args[0], out)
            elif func in _FILL_ZEROS:
                self.tracker.made_in_place(args[0], out, into_just_made=True)
        return out

    @staticmethod
    def _real_integers(value: object) -> object:
        """An integer or boolean result of fake values (argmax of logits): real zeros."""
        if isinstance(value, FakeTensor) and not _is_float(value):
            with unset_fake_temporarily():
                return torch.zeros(value.shape, dtype=value.dtype)
        return value


@contextlib.contextmanager
def _patched(tracker: AllocationTracker) -> Iterator[None]:
    """What a dispatch mode cannot tell apart, patched while tracing: `UntypedStorage.resize_`
    is no op it sees (FSDP2 and the sleeping engine free and refill memory with it),
    DTensor's sharding propagation runs ops on global-shape tensors that no rank allocates
    (and keeps in its cache), and FSDP1's `record_stream` calls (torch skips them for a CPU
    tensor) and the reshards its rate limiter queues, which decide when the allocator may
    reuse what FSDP1 frees."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    resize, propagate = (torch.UntypedStorage.resize_,
                         ShardingPropagator._propagate_tensor_meta_non_cached)

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        result = resize(storage, size)  # the storage itself
        tracker.resized(storage)
        return result

    def propagate_uncounted(self: ShardingPropagator, op_schema: OpSchema) -> object:
        tracker.paused += 1
        try:
            return propagate(self, op_schema)
        finally:
            tracker.paused -= 1

    from torch.distributed.fsdp import _flat_param, _runtime_utils
    from torch.distributed.fsdp._limiter_utils import _FreeEventQueue

    def record_stream(tensor: torch.Tensor, stream: object) -> None:
        tracker.recorded(tensor, stream)

    enqueue = _FreeEventQueue.enqueue

    def enqueue_marked(self: _FreeEventQueue, event: torch.Event) -> None:
        tracker.marked()
        enqueue(self, event)

    with mock.patch.object(torch.UntypedStorage, "resize_", resize_), \
            mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached",
                              propagate_uncounted), \
            mock.patch.object(_flat_param, "_no_dispatch_record_stream", record_stream), \
            mock.patch.object(_runtime_utils, "_no_dispatch_record_stream", record_stream), \
            mock.patch.object(_FreeEventQueue, "enqueue", enqueue_marked):
        yield


class TracedMeter:
    """The trace's Meter (meter.py): phase peaks of live bytes plus the fixed term, and host
    memory as a tag on storages (step/offload.py moves offloaded tensors through it)."""

    repeats: int | None = TRACE_REPEATS  # None: every iteration, as a probe runs them

    def __init__(self, tracker: AllocationTracker, context_bytes: int,
                 gpu_kernels: bool) -> None:
        self.tracker, self.context_bytes = tracker, context_bytes
        self.device = torch.device("cpu")
        self.gpu_kernels = gpu_kernels
        self.runs_kernels = False  # fake tensors: Triton and vLLM are modelled, never run
        self.current_phase: str | None = None
        self.phase_peak_mem_bytes: dict[str, int] = {}
        self.phase_allocator_peak_bytes: dict[str, int] = {}
        self.phase_tensor_peak_bytes = self.phase_allocator_peak_bytes  # no caching here
        self.peak_host_bytes = 0
        self.host_peak_rss_bytes = 0
        self.host_held_peak_bytes = 0  # what a probe measures; the trace has peak_host_bytes
        self.clock = UnitClock(short=False)  # a trace times nothing

    def runs(self, iteration: int, count: int) -> bool:
        """Of a loop that repeats its shapes, the first iteration runs (what happens once:
        gradients, AdamW's state, lazy buffers) and the last `repeats - 1` (all that earlier
        iterations leave behind held); the step makes the others' results in their place."""
        return self.repeats is None or iteration == 0 or iteration >= count - self.repeats + 1

    def iterations(self, unit: str, work: Sequence[float], also: Iterable[int] = (),
                   sample: int = SHORT_SAMPLE, tail: int = 1,
                   middle: bool = True, warm_last: bool = False) -> Iterator[int]:
        """The units `runs` keeps, and `also`; untimed (`warm_last`, a short probe's warm-up's,
        is moot: the last runs but in a CPU's first step, whose peaks the second's cover)."""
        kept = set(also)
        return iter([i for i in range(len(work)) if self.runs(i, len(work)) or i in kept])

    def read_device_bytes(self) -> int:
        return self.tracker.device_bytes + self.context_bytes

    def release_cache(self) -> None:
        self.tracker.events.append((EMPTY_CACHE,))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        tracker = self.tracker
        tracker.peak_device_bytes = tracker.device_bytes
        self.current_phase = name
        tracker.events.append((PHASE, name))
        yield
        tracker.events.append((PHASE, None))
        peak = tracker.peak_device_bytes
        self.phase_allocator_peak_bytes[name] = max(
            self.phase_allocator_peak_bytes.get(name, 0), peak)
        self.phase_peak_mem_bytes[name] = max(self.phase_peak_mem_bytes.get(name, 0),
                                              peak + self.context_bytes)
        self.peak_host_bytes = max(self.peak_host_bytes, tracker.host_bytes)
        self.current_phase = None

    def measure_peak_bytes(self, run: Callable[[], None]) -> int:
        tracker = self.tracker
        before = tracker.peak_device_bytes
        start = tracker.peak_device_bytes = tracker.device_bytes
        run()
        peak = tracker.peak_device_bytes
        tracker.peak_device_bytes = max(before, peak)
        return peak - start

    def to_host(self, tensor: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        host = tensor.clone()
        self.tracker.mark_host(host, True)
        return host

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def on_host(self, tensor: torch.Tensor) -> bool:
        return self.tracker.is_host(tensor)


@dataclass
class TraceResult:
    """One rank's traced memory: per-phase peaks (the fixed term included) and what offload
    and a sleeping engine hold in host memory."""

    phase_peak_mem_bytes: dict[str, int]
    context_bytes: int
    host_offload_bytes: int
    model_state_bytes: dict[str, int]
    engine_weight_bytes: int
    engine: dict[str, int]
    num_params: int
    world_size: int
    trace_s: float
    share: dict[str, int] = field(default_factory=dict)
    phase_tensor_bytes: dict[str, int] = field(default_factory=dict)  # live tensors at most
    # a GPU's, replayed (memory/replay.py): each phase's reserved and allocated peaks
    phase_reserved_bytes: dict[str, int] = field(default_factory=dict)
    phase_allocated_bytes: dict[str, int] = field(default_factory=dict)  # blocks, as torch
    fits_under_bytes: int | None = None  # the smallest cap torch can run the step under
    allocator: dict[str, bool] = field(default_factory=dict)  # the settings replayed

    @property
    def peak_mem_bytes(self) -> int:
        return max(self.phase_peak_mem_bytes.values())


def trace_request(request: ProbeRequest, context_bytes: int,
                  every_iteration: bool = False,
                  events: list[tuple] | None = None) -> TraceResult:
    """Trace `request`'s probe as rank 0 of its world: two steps, every phase, no memory.

    `request.device` says what is modelled (cuda: bf16 and the GPU's kernels; cpu: the CPU
    probe) and the memory the probe may use there, which a vllm-like engine reserves its
    share of; the real vLLM (rollout_engine=vllm) cannot run on fake tensors, so its rollout is
    traced as the stand-in with vLLM's memory (vllm-like). `every_iteration` runs every
    iteration of every loop in both steps, as a probe does (the tests hold the shortcuts to
    it: the same bytes). `events`, when given, receives the recorded allocation stream
    (memory/replay.py's events), for a replay under other settings or caps.
    """
    from autotune.probe.modeling.sharding import leave_group
    from autotune.probe.step.state import allocator_settings
    from autotune.probe.step.training import TrainingProbe

    started = time.perf_counter()
    if request.config.runs_real_vllm:
        request = dataclasses.replace(request, config=request.config.replace(
            rollout_engine="vllm-like"))
    if request.world_size > 1:  # rank 0, its peers over the fake process group
        request = dataclasses.replace(request, emulated=True)
    tracker = AllocationTracker()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    meter = TracedMeter(tracker, context_bytes, gpu_kernels=request.device.on_gpu)
    probe = TrainingProbe(request, meter)
    try:
        with fake_mode, _TraceMode(fake_mode, tracker, request.device.on_gpu), \
                _patched(tracker):
            probe.build()
            # the first step brings AdamW's state and its results into being for the second;
            # both run each loop's first and last iterations, but a CPU's first its first
            # alone (module docstring)
            for first in (True, False):
                meter.repeats = None if every_iteration else \
                    1 if first and not request.device.on_gpu else TRACE_REPEATS
                probe.step()
    finally:
        leave_group()
    if events is not None:
        events.extend(tracker.events)
    tensors = dict(meter.phase_allocator_peak_bytes)
    peaks = dict(meter.phase_peak_mem_bytes)
    reserved, allocated, fits_under = {}, {}, None
    settings = allocator_settings(request)
    if request.device.on_gpu:  # what the card holds: the allocator's reserve, replayed
        replayed = replay(tracker.events, settings)
        reserved, allocated = replayed.phase_reserved_bytes, replayed.phase_allocated_bytes
        peaks = {phase: reserved.get(phase, value - context_bytes) + context_bytes
                 for phase, value in peaks.items()}
        fits_under = smallest_cap(tracker.events, settings)
    return TraceResult(
        phase_peak_mem_bytes=peaks, context_bytes=context_bytes,
        phase_tensor_bytes=tensors, phase_reserved_bytes=reserved, phase_allocated_bytes=allocated,
        fits_under_bytes=fits_under, allocator=dataclasses.asdict(settings),
        host_offload_bytes=meter.peak_host_bytes,
        model_state_bytes=dict(probe.model_state_bytes),
        engine_weight_bytes=probe.engine_weight_bytes, engine=dict(probe.engine.figures),
        num_params=probe.num_params, world_size=request.world_size,
        trace_s=time.perf_counter() - started, share={"val_prompts": 0, **probe.ran})


def pin_threads(cpu_ids: tuple[int, ...] | None) -> None:
    """Every thread of this process onto `cpu_ids` (the cores of a slot no probe holds now:
    a trace never takes a running probe's cores); None leaves them where they are."""
    import os

    if not cpu_ids:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpu_ids)


def serve(requests: Iterable[str], results: IO[str]) -> None:
    """Trace each request line of `requests` (a ProbeRequest's JSON on one line) and write
    one JSON line to `results`: the TraceResult, {"oom": "cache_oom", "message": ...} for a
    config whose engine cannot start in the trace as in its probe (its pool past the device),
    or {"error": one line} for a model or config the trace cannot follow. Ends at end of
    input (the sweep closed it, or died)."""
    import json

    from autotune.probe.measure.oom import classify_exception

    for line in requests:
        request = ProbeRequest.from_json(line)
        pin_threads(request.cpu_ids)
        try:
            result = dataclasses.asdict(trace_request(request, 0))
        except Exception as exc:
            status, message = classify_exception(exc)
            first = (str(exc).splitlines() or [""])[0]
            # the engine's pool past the device, as the probe's would be: a prediction (not
            # the trace process's own MemoryError); anything else, the sweep goes on with its
            # arithmetic pre-screen
            result = {"oom": status.value, "message": message} \
                if status is ProbeStatus.CACHE_OOM else \
                {"error": f"{type(exc).__name__}: {first[:300]}"}
        results.write(json.dumps(result) + "\n")
        results.flush()


def main(argv: list[str]) -> int:
    """`python -m autotune.probe.trace`: the sweep's trace process, started once a sweep and
    kept (torch and transformers load once, then each trace is the trace alone): one
    request a line on standard input, one result a line on standard output."""
    import os
    import sys

    from autotune.probe.worker import quiet_libraries

    if argv:
        print(main.__doc__, file=sys.stderr)
        return 2
    results = os.fdopen(os.dup(1), "w")  # the results' own stream: what libraries print
    os.dup2(2, 1)  # goes to standard error
    sys.stdout = sys.stderr
    quiet_libraries()
    torch.set_num_threads(1)
    serve(sys.stdin, results)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
