"""A step's seconds from the config's arithmetic, before any probe: the time side of
`estimate`'s split answer (split.py) and of the GPU landscapes the benchmarks search
(benchmarks/gpu_landscape.py, placement.py, pick_under_noise.py). From
../shared/reference/memory-and-throughput.md section 9, calibrated to EasyR1's published
baselines:

    T_step = T_gen + T_logprob + T_update + T_offload

- T_update = 6 P T / (G peak eta(m_u)) with gradient checkpointing (its recompute is inside
  the fitted eta: EasyR1's baselines run it), x 6/8 without it.
- T_logprob = passes x 2 P T / (G peak c eta(m_e)): the old-log-prob pass and the reference's.
- eta(m) = eta_max m / (m + m_half), m responses' token budget per micro-batch.
- T_gen = alpha x waves x L_max x t_decode(B) + prefill, one engine of TP GPUs: waves =
  ceil(its responses / B), B = the sequences it holds at once (max_num_seqs, or what its KV
  pool holds at the mean sample length), t_decode = (weights + B ctx kv) / (TP bandwidth)
  + two all-reduces a layer with TP > 1; tail-bound: each wave waits for its longest response.
- T_offload = the bytes offload moves each step (section 8.2) over the host link.

Separate placement (issue 68): the rollout runs on the engine's `rollout_gpus` (rollout_gpus /
TP engines share the responses, each with its KV pool at gpu_memory_utilization of a GPU it
has to itself, no offload or sleep), the trained phases on the other GPUs (their FLOPs over
fewer GPUs, offload only where asked), and the actor's bf16 weights go to the engine once a
step at SYNC_BYTES_PER_S; the step is composed by config/pipeline.py (staleness 0: the sum;
1 or more: the slower side and the sync).

P is the language model's parameters (verl's and EasyR1's MFU leave the ViT out), T the
step's tokens: its samples times the mean sample's tokens, which the baselines give at their
lengths (2,048-token prompts and responses: 738 tokens) and which is taken to scale with the
config's maximum lengths (a guess: a run's mean response length is its own; docs/
benchmarks.md). Fitted to EasyR1 v0.3.2 (assets/baselines.md: Qwen2.5-VL-7B, 8 x H100,
micro-batches 1/2: 145 s a step, actor MFU 16.0%; 4/8: 120 s, 23.2%, at 1,600 and 2,000
tokens/s/GPU): eta_max and m_half from the two MFUs, c and alpha from the two step times:
four numbers, four parameters, so no residual there; the other published rows are predicted
out of sample (`describe`). What no baseline varies (the engine's share of the GPU, its TP,
offload, the GPU itself) follows the physics above, not a fit. Pure arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autotune.config import ProbeConfig
from autotune.config.pipeline import step_seconds
from autotune.memory.shape import ModelShape, kv_cache_bytes, model_shape
from autotune.probe.measure.unit_loops import (
    UPDATE_WARMS_LAST,
    decode_share,
    short_schedule,
    warmup_schedule,
)

GiB = 1 << 30
HOST_LINK_BYTES_PER_S = 25e9  # pinned PCIe, per GPU, low end of section 8.1's 25-50 GB/s
ALLREDUCE_S = 10e-6  # one small NVLink all-reduce of a decode step (latency-bound)
PROFILE_BYTES = 1 << 30  # the engine's profile run and CUDA graphs, kept out of its pool
PREFILL_ETA = 0.4
# the weight sync trainer -> engine: verl's fully async ablation (docs/advance/fully_async.md,
# verl 1dda039, "checkpoint-engine Ablation Experiment": Qwen2.5-Math-7B, 4 trainer + 4 rollout
# H20s, 0.12 s a sync without the checkpoint engine), i.e. 15.2 GB of bf16 in 0.12 s
SYNC_BYTES_PER_S = 125e9


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's dense bf16 FLOP/s and HBM bandwidth (memory-and-throughput.md 7.2)."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    memory_bytes: int


# in the order a capacity is matched (an 80 GiB card is taken for an H100 SXM)
GPU_SPECS = (GpuSpec("H100 SXM 80 GB", 989e12, 3.35e12, 80 * GiB),
             GpuSpec("H200 SXM 141 GB", 989e12, 4.8e12, 141 * 10**9),
             GpuSpec("A100 40 GB", 312e12, 1.555e12, 40 * GiB),
             GpuSpec("A100 80 GB", 312e12, 2.039e12, 80 * GiB),
             GpuSpec("H100 PCIe 80 GB", 756e12, 2.0e12, 80 * GiB))


def gpu_spec(device_name: str | None, capacity_bytes: int) -> tuple[GpuSpec, str]:
    """The GPU a run is planned for, and how it was known: "named" (a spec whose family the
    device's name names, the nearest in memory, PCIe or SXM as named where the table has it),
    "memory" (the first within 10% of `capacity_bytes`), else "assumed" (an H100 SXM, the
    baselines' GPU)."""
    name = (device_name or "").upper()
    for family in ("H200", "H100", "A100"):
        if family in name:
            kin = [s for s in GPU_SPECS if s.name.startswith(family)]
            form = [s for s in kin if ("PCIE" in name) == ("PCIe" in s.name)] or kin
            return min(form, key=lambda s: abs(s.memory_bytes - capacity_bytes)), "named"
    near = [s for s in GPU_SPECS if abs(s.memory_bytes - capacity_bytes) <= 0.1 * s.memory_bytes]
    return (near[0], "memory") if near else (GPU_SPECS[0], "assumed")


@dataclass(frozen=True)
class Hardware:
    """Where a run's step is timed: `gpus` GPUs of one kind, `capacity_bytes` each."""

    gpu: GpuSpec
    gpus: int
    capacity_bytes: int

    @classmethod
    def of(cls, capacity_bytes: int, gpus: int, device_name: str | None = None) -> Hardware:
        return cls(gpu_spec(device_name, capacity_bytes)[0], gpus, capacity_bytes)

    def engine_gpus(self, config: ProbeConfig) -> int:
        """The GPUs that generate: every one colocated, the engine's own separate."""
        return config.rollout_gpus if config.separate else self.gpus

    def engine_responses(self, config: ProbeConfig) -> int:
        """The responses one engine (rollout_tensor_parallel GPUs) generates a step."""
        return config.rollout_batch_size * config.rollout_n * \
            config.rollout_tensor_parallel // self.engine_gpus(config)


@dataclass(frozen=True)
class Baseline:
    """A published run: EasyR1 assets/baselines.md, Qwen2.5-VL-7B GRPO on 8 x H100."""

    what: str
    micro_batch_size_update: int
    micro_batch_size_experience: int
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float | None


# v0.3.2 (vLLM 0.10.0): the fit
FIT = (Baseline("v0.3.2 micro 1/2", 1, 2, 145.0, 1600.0, 0.160),
       Baseline("v0.3.2 micro 4/8", 4, 8, 120.0, 2000.0, 0.232))
# v0.2.x (April 2025, an older vLLM and EasyR1): out of sample
OUT_OF_SAMPLE = (Baseline("v0.2.x micro 4/16", 4, 16, 180.0, 1200.0, 0.136),
                 Baseline("v0.2.x micro 10/20", 10, 20, 170.0, 1400.0, 0.192))
# the baselines' config: examples/config.yaml
BASELINE_CONFIG = ProbeConfig(
    rollout_batch_size=512, rollout_n=5, global_batch_size=128, max_prompt_length=2048,
    max_response_length=2048, dynamic_batching=True, gradient_checkpointing=True,
    offload_params=True, offload_optimizer=True, rollout_engine="vllm-like",
    gpu_memory_utilization=0.6, rollout_tensor_parallel=2, use_kl=True,
    offload_ref_params=True)
BASELINE_MODEL = "qwen2.5-vl-7b"
BASELINE_HARDWARE = Hardware(GPU_SPECS[0], 8, 80 * GiB)


def language_params(shape: ModelShape) -> int:
    return shape.num_params - shape.vision_params


def sample_lengths(config: ProbeConfig) -> int:
    """A sample's maximum tokens: its prompt's and its response's."""
    return config.max_prompt_length + config.max_response_length


@dataclass(frozen=True)
class TimeModel:
    eta_max: float
    m_half: float
    forward_gain: float  # c: a forward's efficiency over the update's
    alpha: float  # measured generation over the tail-bound decode model
    sample_share: float  # a sample's mean tokens over its maximum (the baselines' T / samples)

    PROBE_START_S = 60.0  # a probe's start: processes, the model built, the engine up

    def eta(self, micro: int) -> float:
        return self.eta_max * micro / (micro + self.m_half)

    def sample_tokens(self, config: ProbeConfig) -> float:
        """A sample's mean tokens, prompt and response (the baselines' share of the maximum)."""
        return self.sample_share * sample_lengths(config)

    def step_tokens(self, config: ProbeConfig) -> float:
        return config.rollout_batch_size * config.rollout_n * self.sample_tokens(config)

    def phase_seconds(self, config: ProbeConfig, shape: ModelShape, hardware: Hardware
                      ) -> dict[str, float]:
        """Each phase's seconds in one step: rollout (generation, weight sync and the offload
        around it), experience (the log-prob passes), update."""
        peak = hardware.gpu.peak_flops
        params, tokens = language_params(shape), self.step_tokens(config)
        trainers = config.trainer_gpus(hardware.gpus)
        update = 6 * params * tokens / (trainers * peak
                                        * self.eta(config.micro_batch_size_update))
        if not config.gradient_checkpointing:
            update *= 6 / 8
        passes = 2 if config.use_kl else 1
        logprob = passes * 2 * params * tokens / (
            trainers * peak * self.forward_gain * self.eta(config.micro_batch_size_experience))
        offload = offload_s(config, shape, trainers)
        rollout = self.alpha * self.decode_s(config, shape, hardware) \
            + self.prefill_s(config, shape, hardware)
        if config.separate:  # the offload's transfers are the trainer's own
            return {"rollout": rollout, "experience": logprob + offload, "update": update}
        return {"rollout": rollout + offload, "experience": logprob, "update": update}

    def sync_s(self, config: ProbeConfig, shape: ModelShape) -> float:
        """Separate placement's weight sync a step: the actor's bf16 weights to the engine
        (colocated, the engine's wake-up reads them in place: inside the rollout)."""
        return 2 * shape.num_params / SYNC_BYTES_PER_S if config.separate else 0.0

    def concurrency(self, config: ProbeConfig, shape: ModelShape, hardware: Hardware) -> int:
        """Sequences one engine holds at once: max_num_seqs, its responses, or its KV pool at
        the mean sample length, whichever is least."""
        tp = config.rollout_tensor_parallel
        weights = 2 * shape.engine_params(tp)
        pool = config.gpu_memory_utilization * hardware.capacity_bytes - weights - PROFILE_BYTES
        pool_tokens = pool * tp / kv_cache_bytes(shape, 1)
        responses = hardware.engine_responses(config)
        return max(1, min(config.max_num_seqs, responses,
                          int(pool_tokens / self.sample_tokens(config))))

    def decode_s(self, config: ProbeConfig, shape: ModelShape, hardware: Hardware) -> float:
        peak, bandwidth = hardware.gpu.peak_flops, hardware.gpu.hbm_bytes_per_s
        tp = config.rollout_tensor_parallel
        batch = self.concurrency(config, shape, hardware)
        waves = math.ceil(hardware.engine_responses(config) / batch)
        step_bytes = 2 * shape.engine_params(tp) + batch * self.sample_tokens(config) * \
            kv_cache_bytes(shape, 1) / tp
        step_s = max(step_bytes / bandwidth, 2 * language_params(shape) * batch / (tp * peak))
        if tp > 1:
            step_s += 2 * shape.layers * ALLREDUCE_S
        return waves * config.max_response_length * step_s

    def prefill_s(self, config: ProbeConfig, shape: ModelShape, hardware: Hardware) -> float:
        prompts = config.rollout_batch_size * config.rollout_n * self.sample_tokens(config) / 2
        return 2 * language_params(shape) * prompts / (
            hardware.engine_gpus(config) * hardware.gpu.peak_flops * PREFILL_ETA)

    def short_step_s(self, config: ProbeConfig, shape: ModelShape, hardware: Hardware,
                     warmup: bool = False) -> float:
        """What one step of a short probe runs (autotune/probe/measure/unit_loops.py: of each
        loop its first unit, a middle one and its last): the rollout's waves likewise, of
        each wave's blocks of decode steps the first two and the last two (the real vLLM's
        waves whole), of each log-prob pass and each mini-batch their micro-batches
        likewise, the mini-batches likewise (each ends in its optimizer step), offload's
        transfers whole. `warmup`: its warm-up step, of each loop the first unit (of the
        waves also the last full one, of the update's mini-batches and micro-batches the
        last) and of a wave's decode steps the first and the last."""
        phases = self.phase_seconds(config, shape, hardware)

        def share(count: int, also: tuple[int, ...] = ()) -> float:  # of a loop of `count`
            schedule = warmup_schedule(count, also) if warmup else short_schedule(count)
            return len(schedule) / count  # units, the share a short probe runs

        def last_too(count: int) -> float:  # the update's loops: a warm-up runs the last too
            return share(count, (count - 1,) if UPDATE_WARMS_LAST else ())

        waves = math.ceil(hardware.engine_responses(config)
                          / self.concurrency(config, shape, hardware))
        trainers = config.trainer_gpus(hardware.gpus)
        transfers = offload_s(config, shape, trainers)
        per_rank = config.rollout_batch_size * config.rollout_n // trainers
        minibatch = config.global_batch_size * config.rollout_n // trainers
        rollout = phases["rollout"] - transfers
        if not config.runs_real_vllm:  # the probe's own decode loop: two steps a wave in the
            steps = max(1, config.max_response_length - 1)  # warm-up, its blocks' sample after
            ran = min(2, steps) / steps if warmup else decode_share(steps)
            rollout -= self.alpha * self.decode_s(config, shape, hardware) * (1 - ran)
        return (rollout * share(waves, (waves - 1,)) + transfers
                + phases["experience"] * share(math.ceil(
                    per_rank / config.micro_batch_size_experience))
                + phases["update"] * last_too(math.ceil(
                    config.rollout_batch_size / config.global_batch_size))
                * last_too(math.ceil(minibatch / config.micro_batch_size_update)))

    def probe_wall_s(self, step_s: float) -> float:
        """A probe's wall time: its start, a warm-up step and two timed steps."""
        return self.PROBE_START_S + 3 * step_s

    def step_s(self, config: ProbeConfig, shape: ModelShape | None = None,
               hardware: Hardware = BASELINE_HARDWARE) -> float:
        """One step's seconds (config/pipeline.py composes a separate placement's)."""
        shape = shape or model_shape(BASELINE_MODEL)
        return step_seconds(self.phase_seconds(config, shape, hardware),
                            config.separate, config.staleness, self.sync_s(config, shape))

    def tokens_per_s_per_gpu(self, config: ProbeConfig, shape: ModelShape,
                             hardware: Hardware) -> float:
        """The run's tokens a second over all its GPUs, per GPU."""
        return self.step_tokens(config) / self.step_s(config, shape, hardware) / hardware.gpus

    @classmethod
    def calibrated(cls) -> TimeModel:
        """Fitted to FIT exactly (see the module's docstring)."""
        (a, b) = FIT
        # eta(m) = eta_max m / (m + h) through both MFUs: a.mfu (1 + h/ma) = b.mfu (1 + h/mb)
        ma, mb = a.micro_batch_size_update, b.micro_batch_size_update
        assert a.mfu is not None and b.mfu is not None  # the fit's rows publish their MFU
        m_half = (b.mfu - a.mfu) / (a.mfu / ma - b.mfu / mb)
        eta_max = a.mfu * (ma + m_half) / ma
        samples = BASELINE_CONFIG.rollout_batch_size * BASELINE_CONFIG.rollout_n
        gpus = BASELINE_HARDWARE.gpus
        sample_tokens = sum(r.tokens_per_s_per_gpu * gpus * r.step_s for r in FIT) / (
            len(FIT) * samples)
        model = cls(eta_max, m_half, 1.0, 1.0, sample_tokens / sample_lengths(BASELINE_CONFIG))
        configs = [dataclasses.replace(BASELINE_CONFIG, micro_batch_size_update=r.
                                       micro_batch_size_update, micro_batch_size_experience=r.
                                       micro_batch_size_experience) for r in FIT]
        # the step-time difference is the log-prob passes' (update's known from the MFUs)
        shape = model_shape(BASELINE_MODEL)
        parts = [model.phase_seconds(c, shape, BASELINE_HARDWARE) for c in configs]
        rest = [r.step_s - p["update"] for r, p in zip(FIT, parts, strict=True)]
        forward_gain = (parts[0]["experience"] - parts[1]["experience"]) / (rest[0] - rest[1])
        model = dataclasses.replace(model, forward_gain=forward_gain)
        part = model.phase_seconds(configs[0], shape, BASELINE_HARDWARE)
        decode = model.decode_s(configs[0], shape, BASELINE_HARDWARE)
        alpha = (rest[0] - part["experience"] - (part["rollout"] - decode)) / decode
        return dataclasses.replace(model, alpha=alpha)

    def describe(self) -> str:
        """The fitted constants, and each published row against the model."""
        lines = [f"time model: eta(m) = {self.eta_max:.3f} m / (m + {self.m_half:.3f}); "
                 f"forwards at {self.forward_gain:.2f} x the update's eta; generation "
                 f"{self.alpha:.2f} x the tail-bound decode model; "
                 f"{self.sample_tokens(BASELINE_CONFIG):.0f} tokens a sample at the "
                 f"baselines' {sample_lengths(BASELINE_CONFIG):,} ({self.sample_share:.1%})"]
        for row in (*FIT, *OUT_OF_SAMPLE):
            config = dataclasses.replace(
                BASELINE_CONFIG, micro_batch_size_update=row.micro_batch_size_update,
                micro_batch_size_experience=row.micro_batch_size_experience)
            step = self.step_s(config)
            tokens = self.step_tokens(config) / step / BASELINE_HARDWARE.gpus
            mfu = self.eta(row.micro_batch_size_update)
            kind = "fit" if row in FIT else "out of sample"
            lines.append(f"  {row.what:<20} {kind:<14} step {step:6.1f} s vs {row.step_s:.0f} "
                         f"({step / row.step_s - 1:+.1%}); {tokens:,.0f} vs "
                         f"{row.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; MFU {mfu:.1%} vs "
                         f"{row.mfu:.1%}")
        (a, b) = OUT_OF_SAMPLE  # an older stack, slower whole: compare what micro-batches did
        steps = [self.step_s(dataclasses.replace(
            BASELINE_CONFIG, micro_batch_size_update=r.micro_batch_size_update,
            micro_batch_size_experience=r.micro_batch_size_experience)) for r in (a, b)]
        lines.append(f"  v0.2.x, micro 10/20 over 4/16: step time x{steps[1] / steps[0]:.3f} "
                     f"modelled, x{b.step_s / a.step_s:.3f} published")
        return "\n".join(lines)


def offload_s(config: ProbeConfig, shape: ModelShape, trainer_gpus: int) -> float:
    """Offload's traffic a step per trainer GPU (section 8.2): fp32 params out and in around
    three phases, AdamW's state out and in once, the reference's bf16 params in for its
    pass."""
    params = shape.num_params / trainer_gpus
    moved = (6 * 4 * params if config.offload_params else 0) + \
        (2 * 8 * params if config.offload_optimizer else 0) + \
        (2 * params if config.use_kl and config.ref_on_host else 0)
    return moved / HOST_LINK_BYTES_PER_S
