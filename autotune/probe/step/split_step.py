"""One side of a split probe (placement=separate): the engine's GPUs or the trainer's.

The engine's side builds only the rollout engine (a compute-dtype copy from the actor's seed,
split over `rollout_tensor_parallel` ranks of its emulated group), awake for the whole run as a
served engine is, and generates its GPU's share of each rollout batch. The trainer's side
builds what a colocated probe builds less the engine, and runs the trained phases (experience,
critic update, update) on its GPU's share; the responses it trains on are the engine's shapes
(always `max_response_length`), which is what a trained phase's time and memory depend on.

The two sides run at once, one process each on cores of their own, joined by a TCP link on
loopback (launch/split_sides.py starts them): each step they meet at a barrier, then the trainer
sends the engine its new weights, every tensor whole in the compute dtype, one at a time (what
verl's and TRL's NCCL broadcasts move), and the engine loads its part of each. With
`staleness=0` they take turns (the trainer waits for this step's rollout, the engine for the
update); with 1 or more the engine generates the next batch while the trainer trains on this
one. A step's time is the wall time from one sync's end to the next's (both sides agree on it
to the link's round trip); each side also times its own phases, and the engine the sync
(`SYNC_PHASE`), so the composition (config/pipeline.py) can be held to the measured step.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any, cast

import torch

from autotune.config import SYNC_PHASE
from autotune.probe.measure.meter import Meter
from autotune.probe.measure.result import ProbeRequest, ProbeStatus
from autotune.probe.measure.unit_loops import mean_and_se
from autotune.probe.modeling.models import without_special_ids
from autotune.probe.modeling.sharding import full_tensor, join_group, named_weights
from autotune.probe.modeling.ulysses import sequence_parallel
from autotune.probe.step.engine import Rollout, RolloutEngine
from autotune.probe.step.training import TrainingProbe


class Link:
    """The two sides' TCP connection: barriers, a JSON hello, and the weights' bytes."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock = sock

    @classmethod
    def connect(cls, side: str, port: int, timeout_s: float) -> Link:
        """The engine's side listens on `port` (bound by the launcher's choice); the
        trainer's connects, retrying while the other process starts. A side waits for the
        other at most `timeout_s` (the probe's own timeout: its runner ends both then)."""
        if side == "engine":
            with socket.create_server(("127.0.0.1", port)) as server:
                server.settimeout(timeout_s)
                sock, _ = server.accept()
                return cls(sock, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(socket.create_connection(("127.0.0.1", port), timeout=5.0),
                           timeout_s)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def barrier(self) -> None:
        self.sock.sendall(b"b")
        self.receive_into(bytearray(1))

    def send_json(self, value: Any) -> None:
        data = json.dumps(value).encode()
        self.sock.sendall(struct.pack("!Q", len(data)) + data)

    def receive_json(self) -> Any:
        size = struct.unpack("!Q", self.receive(8))[0]
        return json.loads(self.receive(size))

    def receive(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.receive_into(buffer)
        return bytes(buffer)

    def receive_into(self, buffer: bytearray | memoryview) -> None:
        view, got = memoryview(buffer).cast("B"), 0
        while got < len(view):
            count = self.sock.recv_into(view[got:])
            if count == 0:
                raise ConnectionError("the other side of the split probe ended")
            got += count


class SplitSide(TrainingProbe):
    """One side of a split probe, run as a TrainingProbe whose step is this side's part of
    the pipelined step (module docstring)."""

    def __init__(self, request: ProbeRequest, meter: Meter, side: str, link: Link) -> None:
        super().__init__(request, meter)
        self.side, self.link = side, link
        self.weight_specs: list[tuple[str, list[int]]] = []  # what each sync sends, in order

    # -- build ------------------------------------------------------------------------------

    def build(self) -> None:
        if self.side == "trainer":
            self._build_trainer()
        else:
            self._build_engine_side()
        # hello: the trainer tells the engine the weights it will send (names, whole shapes)
        if self.side == "trainer":
            self.link.send_json(self.weight_specs)
        else:
            self.weight_specs = [(name, list(shape)) for name, shape in
                                 self.link.receive_json()]

    def _run_problems(self) -> list[str]:
        """The launcher checked the config against the whole run (launch/split_sides.py); a
        side checks only what its own device and model can run (Build._check)."""
        return []

    def _build_trainer(self) -> None:
        """As Build.build, less the engine (the trainer's GPUs hold none)."""
        self._build_trained()
        self.engine = cast("Rollout", NoEngine())
        self.weight_specs = [(name, list(full_tensor(getattr(w, "data", w)).shape))
                             for name, w in named_weights(self.model)]

    def _build_engine_side(self) -> None:
        """The engine alone: a compute-dtype copy from the actor's seed (its weights until
        the first sync), split over its tensor-parallel ranks, awake from its start."""
        self._check()
        if self.request.world_size > 1:
            self.group = join_group(self.request.world_size, True, self.device)
        torch.manual_seed(self.request.seed)
        self._make_prompts()
        engine = self._build_engine_copy()
        self.num_params = sum(p.numel() for p in engine.model.parameters())
        engine.start(self._profile_inputs)
        engine.wake(iter(()))  # awake for the whole run: a served engine never sleeps
        self.engine = engine
        self.engine_weight_bytes = engine.held_weight_bytes()

    def _build_engine_copy(self) -> RolloutEngine:
        from autotune.probe.modeling.sharding import local_tensor, tensor_parallel_engine
        from autotune.probe.step.engine import engine_capacity_bytes

        config = self.config
        engine = self._build_copy(shard=False) if self.group is not None else \
            self._seeded_copy()
        engine_tp = config.rollout_tensor_parallel > 1
        if engine_tp:
            assert self.group is not None  # config rules: tensor parallel spans ranks
            tensor_parallel_engine(engine, self.group, config.rollout_tensor_parallel)
            for param in engine.parameters():
                local_tensor(param).data = local_tensor(param).clone()
        return RolloutEngine(engine, self.model_config, config, self.device, self.compute_dtype,
                             engine_tp, engine_capacity_bytes(config, self.request.device),
                             self._move, self.meter)

    def _seeded_copy(self) -> Any:
        from autotune.probe.modeling.models import build_model

        torch.manual_seed(self.request.seed)
        copy = build_model(self.model_config, self.device, self.compute_dtype,
                           self.request.model_path)
        return copy.eval().requires_grad_(False)

    # -- the pipelined step -----------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """This side's part of one step of the pipeline (module docstring); its seconds per
        phase, and the step's wall time in step_wall_s."""
        started = time.perf_counter()
        seconds: dict[str, float] = {}
        turns = self.config.staleness == 0
        if self.side == "engine":
            phases = {"rollout": self._rollout}
        else:
            self._receive_rollout()
            phases = {"experience": self._experience,
                      **({"critic_update": self._update_critic} if self.critic is not None
                         else {}), "update": self._update}
        self.step_phases = list(phases)
        if self.side == "trainer" and turns:
            self.link.barrier()  # this step's rollout is done
        for name, run in phases.items():
            split = self.sequence_group is not None and name in ("experience", "update")
            with self.meter.phase(name), sequence_parallel(self.sequence_group) if split \
                    else contextlib.nullcontext():
                begun = time.perf_counter()
                run()
                seconds[name] = time.perf_counter() - begun
            if self.steps_run:
                self.settled.add(name)
        if self.side == "engine" and turns:
            self.link.barrier()  # the rollout is done: the trainer may start
        self.link.barrier()  # both sides' phases are done
        with self.meter.phase(SYNC_PHASE):
            begun = time.perf_counter()
            self._sync()
            self.link.barrier()  # the engine holds the new weights
            if self.side == "engine":
                seconds[SYNC_PHASE] = time.perf_counter() - begun
        self.steps_run += 1
        self.step_wall_s.append(time.perf_counter() - started)
        self.step_var_s2.append(0.0)
        return seconds

    def _rollout(self) -> None:
        """The engine's side: the served engine generates, awake (no wake-up, no sleep)."""
        config = self.config
        rows = torch.arange(self.share.prompts_per_step).repeat_interleave(config.rollout_n)
        with torch.no_grad():
            self.engine.generate(self.prompt_ids, self._vl_inputs, rows)
        self.ran.update(world_size=self.request.world_size,
                        prompts_per_step=len(rows) // config.rollout_n,
                        responses_per_step=len(rows))

    def _receive_rollout(self) -> None:
        """The trainer's side: the engine's responses, as shapes (always
        max_response_length, as the engine generates them)."""
        config = self.config
        rows = torch.arange(self.share.prompts_per_step).repeat_interleave(config.rollout_n)
        vocab = int(getattr(self.model_config, "text_config", self.model_config).vocab_size)
        generator = torch.Generator().manual_seed(self.request.seed + self.steps_run)
        ids = torch.randint(0, vocab, (len(rows), config.max_response_length),
                            generator=generator)
        self.responses = without_special_ids(ids, self.model_config).to(self.device)
        self.response_rows = rows
        self.response_lengths = self._response_lengths(len(rows))
        self.ran.update(world_size=self.request.world_size,
                        prompts_per_step=len(rows) // config.rollout_n,
                        responses_per_step=len(self.responses))

    def _sync(self) -> None:
        """The trainer sends every weight whole in the compute dtype, one tensor at a time;
        the engine receives each and loads its part."""
        if self.side == "trainer":
            weights = dict(named_weights(self.model))
            for name, _ in self.weight_specs:
                whole = full_tensor(getattr(weights[name], "data", weights[name]))
                data = whole.detach().to("cpu", self.compute_dtype).contiguous()
                self.link.sock.sendall(data.view(torch.uint8).numpy().data)
                del whole, data
            return
        self.engine.wake(self._received_weights())

    def _received_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        names = set(self.engine.weight_names())
        for name, shape in self.weight_specs:
            whole = torch.empty(shape, dtype=self.compute_dtype)
            self.link.receive_into(whole.view(torch.uint8).numpy().data)
            if name in names:
                yield name, self.engine.part(name, whole.to(self.device))
            del whole

    # -- figures ----------------------------------------------------------------------------

    @property
    def step_tokens(self) -> int:
        """Tokens a step of the whole run trains on: this side's GPUs each ran this share."""
        return self.ran["responses_per_step"] * self.request.world_size * \
            self.config.sequence_length

    def figures(self, timed: list[dict[str, float]]) -> dict[str, Any]:
        """The pipelined step as it ran (wall time, sync to sync), not the sum of phases."""
        walls = self.step_wall_s[-len(timed):]
        step_s, step_se_s = mean_and_se(walls, 0.0)
        phase_s = {p: sum(t.get(p, 0.0) for t in timed) / len(timed) for p in timed[0]}
        return {"status": ProbeStatus.OK, "tokens_per_s": self.step_tokens / step_s,
                "samples_per_s": self.step_tokens / self.config.sequence_length / step_s,
                "step_s": step_s, "phase_s": phase_s, "step_times_s": walls,
                "step_se_s": step_se_s}


class NoEngine:
    """The trainer's side holds no engine: nothing reserved, nothing to report."""

    figures: dict[str, int] = {}
