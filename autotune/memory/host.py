"""The node's host memory: what every rank on one node holds in host RAM, per phase and at
start-up, and whether the node's OOM killer ends the run.

Pure arithmetic over memory/shape.py and memory/states.py (no torch). The most reported OOM
of these trainers is the node's RAM, not a GPU: Ray's memory monitor kills a worker once the
node's used memory (MemTotal - MemAvailable, or the cgroup's usage; pinned memory and
/dev/shm count) passes `RAY_memory_usage_threshold` (0.95 by default; ray_config_def.h
`memory_usage_threshold`), and without Ray (TRL) the kernel's OOM killer acts at the whole of
it.

A node runs R = gpus_per_node ranks of a run of W ranks. Each term below is what the trainer's
own code allocates, with its source; `HostProfile` holds what differs between trainers.

- Rank processes: R x what one rank's process holds beyond its tensors (the CUDA runtime,
  Python, torch, transformers and the rollout engine's host side). A prior on a GPU (a
  caller that measured it passes NodeRun.process_bytes); on a CPU device the whole process is the
  emulated GPU's (its device figure), so nothing is counted here.
- Offload, per rank: fp32 params 4 Psi / W and AdamW's m and v 8 Psi / W between phases
  (verl and EasyR1 fsdp_utils.offload_fsdp_model_to_cpu / offload_fsdp_optimizer). Both copy
  with `.to("cpu", non_blocking=True)`, which returns pinned memory (ATen TensorConversions
  `pin_out`), and PyTorch's pinned host allocator rounds every block up to a power of two
  (CachingHostAllocator.h, `c10::llvm::PowerOf2Ceil`) and keeps freed blocks cached until
  `empty_cache`, which neither trainer calls: on a GPU a block once pinned is held in every
  later phase. The blocks are one flat parameter per FSDP unit where FSDP1 wraps (each
  decoder layer, each vision block and the root) and one optimizer state per flat
  parameter; under FSDP2 or on one GPU, one per parameter tensor (offload_units).
- The reference model, when it waits on the host: FSDP1's CPUOffload pins its flat parameter
  and a gradient buffer of the same size (torch _flat_param.py `_local_shard.pin_memory()`,
  `_cpu_grad`), in the dtype the trainer loads it in (verl fp32, EasyR1 bf16).
- The rollout engine asleep at level 1: vLLM's CuMemAllocator.sleep backs up every weight
  allocation into pinned host memory (`torch.empty(..., pin_memory=True)`), each rank its
  engine's shard (EasyR1 sleeps at level 1; verl at level 2 keeps nothing).
- Start-up: loading the checkpoint into host RAM before FSDP shards it: the actor in fp32 on
  every rank (TRL, each accelerate process; verl with tied embeddings) or on one rank per
  node (EasyR1 `enable_rank0_init`, verl otherwise), then the reference the same way.
- Ray (verl, EasyR1): its node processes (raylet, GCS, dashboard, the driver) and the step's
  batch in the object store (/dev/shm) plus its copy in the driver.
- Data (VL models): the batch's decoded RGB images, and the fp32 pixel values every rank
  computes for its share of the responses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from autotune.config import ProbeConfig, format_bytes, parse_share
from autotune.memory.shape import ModelShape
from autotune.memory.states import ADAM_BYTES, PARAM_BYTES

RAY_THRESHOLD_ENV = "RAY_memory_usage_threshold"
RAY_DEFAULT_THRESHOLD = 0.95  # ray_config_def.h: RAY_CONFIG(float, memory_usage_threshold, 0.95)
# One GPU rank's process beyond its tensors: the CUDA runtime with lazy module loading, cuBLAS
# and NCCL host buffers, Python with torch, transformers and vLLM imported. A prior, stated as
# such wherever it is used (not yet measured on a GPU).
GPU_RANK_PROCESS_BYTES = 4 << 30
# Ray's node processes (raylet, GCS, dashboard agent) and the trainer's driver (TaskRunner)
# beyond the batch it holds: a prior.
RAY_NODE_PROCESSES_BYTES = 2 << 30
# the phases whose host terms differ, in the order of a step (the critic's update holds no
# more on the host than the rollout; validation is the rollout's)
HOST_PHASES = ("rollout", "experience", "update")


def ray_threshold() -> float:
    """The share of the node's memory at which Ray's memory monitor kills a worker:
    RAY_memory_usage_threshold when set, else Ray's default 0.95."""
    raw = os.environ.get(RAY_THRESHOLD_ENV)
    if raw is None or not raw.strip():
        return RAY_DEFAULT_THRESHOLD
    return parse_share(raw, f"{RAY_THRESHOLD_ENV}={raw!r} in the environment: expected a "
                            "share of the node's memory in (0, 1], as Ray reads it "
                            "(default 0.95)")


@dataclass(frozen=True)
class HostProfile:
    """How one trainer holds a run in host memory: the fields each term reads."""

    name: str
    ray: bool  # a Ray application: its node processes, object store and memory monitor
    load_on_every_rank: bool | None  # start-up: every rank reads the checkpoint into host RAM
    # (None: only when the embeddings are tied, as verl decides)
    ref_load_bytes: int  # bytes per parameter the reference is loaded (and offloaded) in
    ref_pinned_copies: int  # FSDP1 CPUOffload pins the flat parameter and a gradient buffer
    source: str  # where these come from
    ref_loaded_beside_actor: bool = False  # start-up: the reference read while the actor's
    # host copy is still held (TRL builds both before preparing either)


HOST_PROFILES: dict[str | None, HostProfile] = {
    # the built-in probe's run stands for verl's and EasyR1's: Ray, one loader per node, its
    # own reference in the compute dtype (ref_load_bytes 0), one pinned copy per tensor
    None: HostProfile("autotune's probe (a verl/EasyR1-like run)", ray=True,
                      load_on_every_rank=False, ref_load_bytes=0, ref_pinned_copies=1,
                      source="probe/step/training.py, as verl and EasyR1 place states"),
    "verl": HostProfile("verl", ray=True, load_on_every_rank=None, ref_load_bytes=4,
                        ref_pinned_copies=2,
                        source="verl fsdp_workers.py _build_model_optimizer (model_dtype fp32, "
                               "use_meta_tensor=not tie_word_embeddings; ref CPUOffload)"),
    "easyr1": HostProfile("EasyR1", ray=True, load_on_every_rank=False, ref_load_bytes=2,
                          ref_pinned_copies=2,
                          source="EasyR1 fsdp_workers.py (enable_rank0_init, ref in bf16, "
                                 "ref.fsdp.enable_cpu_offload)"),
    "trl": HostProfile("TRL", ray=False, load_on_every_rank=True, ref_load_bytes=4,
                       ref_pinned_copies=0,
                       source="TRL grpo_trainer.py (from_pretrained in every process, fp32; "
                              "the reference on the GPU)", ref_loaded_beside_actor=True),
}


def pinned_bytes(block_bytes: list[int]) -> int:
    """Host memory of blocks pinned through PyTorch's caching host allocator: each rounded up
    to a power of two."""
    return sum(1 << (size - 1).bit_length() for size in block_bytes if size > 0)


def fsdp_unit_params(shape: ModelShape) -> list[int]:
    """Parameters of each FSDP unit as verl and EasyR1 wrap a Qwen2 model (one per decoder
    layer and vision block, the root holding the rest): they sum to shape.num_params."""
    units = [shape.layer_params] * shape.layers
    blocks = shape.vision_layers
    if blocks:
        hv, iv = shape.vision_hidden, shape.vision_intermediate
        block = 2 * hv + hv * 3 * hv + 3 * hv + hv * hv + hv + 2 * (hv * iv + iv) + iv * hv + hv
        units += [block] * blocks
    return [shape.num_params - sum(units), *units]


def parameter_sizes(shape: ModelShape) -> list[int]:
    """Every parameter's elements, one entry a tensor (a Qwen2 decoder, its vision tower):
    what a run that offloads tensor by tensor pins one block for. They sum to
    shape.num_params."""
    sizes = [shape.embedding_params, *shape.layer_tensors * shape.layers, shape.hidden]
    if not shape.tied_embeddings:
        sizes.append(shape.embedding_params)
    if shape.is_vl:
        sizes += [*shape.vision_block_tensors * shape.vision_layers,
                  *shape.vision_merger_tensors]
    return sizes


def offload_units(shape: ModelShape, config: ProbeConfig, world_size: int) -> list[int]:
    """The tensors offload moves, in parameters: FSDP1's flat parameter per unit (EasyR1's
    and verl's fsdp: flat_param_to), else one tensor per parameter (FSDP2's per-parameter
    shards, verl's fsdp2 and the probe's; one GPU's plain parameters): each a pinned
    block of its own (measured on an H200: the probe's 0.5B offload pinned 12.11 GiB, the
    per-parameter blocks' sum to the byte; benchmarks/results/gpu)."""
    if config.flat_shards(world_size):
        return fsdp_unit_params(shape)
    return parameter_sizes(shape)


def shard_blocks(units: list[int], bytes_per_param: int, world_size: int) -> list[int]:
    """One rank's shard of each unit, in bytes (FSDP pads a flat parameter to split evenly)."""
    return [bytes_per_param * -(-n // world_size) for n in units]


@dataclass(frozen=True)
class NodeRun:
    """The run around one rank: how many ranks share its node and the whole run, where it
    runs, and what the trainer does (its HostProfile)."""

    ranks_per_node: int
    world_size: int
    on_gpu: bool
    compute_bytes: int
    trainer: str | None = None
    process_bytes: int | None = None  # one rank's process beyond its tensors, measured
    process_note: str = ""  # where `process_bytes` comes from

    @property
    def profile(self) -> HostProfile:
        return HOST_PROFILES[self.trainer]

    @property
    def rank_process_bytes(self) -> int:
        if self.process_bytes is not None:
            return self.process_bytes
        return GPU_RANK_PROCESS_BYTES if self.on_gpu else 0


@dataclass(frozen=True)
class NodeHost:
    """Host bytes of one node per phase and at start-up (named terms, whole node), against
    the node's memory and the share at which its OOM killer acts."""

    phases: dict[str, dict[str, int]]
    host_bytes: int  # the node's RAM
    threshold: float  # share of it at which the killer acts
    killer: str
    rank_held_bytes: int  # what one rank holds on the host at most (offload, ref, engine)
    rank_process_bytes: int  # one rank's process beyond what it holds
    notes: tuple[str, ...] = field(default=())

    @property
    def rank_bytes(self) -> int:
        """One rank's host memory at most: its process and what it holds there."""
        return self.rank_process_bytes + self.rank_held_bytes

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def binding_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak_bytes(self) -> int:
        return self.total(self.binding_phase)

    @property
    def kill_bytes(self) -> int:
        """Node memory past which the run is killed."""
        return int(self.threshold * self.host_bytes)

    @property
    def host_oom(self) -> bool:
        return self.peak_bytes > self.kill_bytes

    def verdict(self) -> str:
        """One line: the node's peak, where, against what kills it."""
        peak, phase = self.peak_bytes, self.binding_phase
        word = "predicted host_oom" if self.host_oom else "fits"
        return (f"node host memory: {word}: {format_bytes(peak)} at {phase} against "
                f"{format_bytes(self.kill_bytes)} ({self.threshold:.0%} of "
                f"{format_bytes(self.host_bytes)}, where {self.killer} acts)")


def held_bytes(blocks: list[int], pinned: bool) -> int:
    """Host memory of `blocks` (bytes each): pinned, each rounded up to a power of two
    (pinned_bytes); unpinned (the CPU build never pins), their own sizes."""
    return pinned_bytes(blocks) if pinned else sum(blocks)


def critic_units(shape: ModelShape, config: ProbeConfig, units: list[int],
                 world_size: int) -> list[int]:
    """PPO's critic's tensors as offload moves them, from the actor's `units`: FSDP1's units
    with the root holding the value head, else the actor's tensors less an untied head, plus
    the value head's two."""
    if config.flat_shards(world_size):
        return [shape.critic_params - sum(units[1:]), *units[1:]]
    critic = [*units, shape.hidden, 1]
    if not shape.tied_embeddings:
        critic.remove(shape.embedding_params)
    return critic


def rank_held_terms(shape: ModelShape, config: ProbeConfig, run: NodeRun) -> dict[str, int]:
    """What one rank holds on the host, each term at its largest: the actor's offloaded params
    and AdamW state, the reference where it waits there, the critic's offload, the engine's
    weights asleep at level 1."""
    w, c, pinned = run.world_size, run.compute_bytes, run.on_gpu
    units = offload_units(shape, config, w)
    terms = dict.fromkeys(("offloaded_params", "offloaded_optimizer", "reference",
                           "critic_offloaded_params", "critic_offloaded_optimizer",
                           "engine_weights_asleep"), 0)
    if config.offload_params:
        terms["offloaded_params"] = held_bytes(shard_blocks(units, PARAM_BYTES, w), pinned)
    if config.offload_optimizer:  # m and v, a block each
        terms["offloaded_optimizer"] = held_bytes(
            2 * shard_blocks(units, ADAM_BYTES // 2, w), pinned)
    if config.holds_ref_copy and config.ref_on_host:
        copies = run.profile.ref_pinned_copies if pinned else 1
        ref_bytes = run.profile.ref_load_bytes or c
        terms["reference"] = copies * held_bytes(shard_blocks(units, ref_bytes, w), pinned)
    critic = critic_units(shape, config, units, w) if config.has_critic else []
    if critic and config.critic_offload_params:
        terms["critic_offloaded_params"] = held_bytes(
            shard_blocks(critic, PARAM_BYTES, w), pinned)
    if critic and config.critic_offload_optimizer:
        terms["critic_offloaded_optimizer"] = held_bytes(
            2 * shard_blocks(critic, ADAM_BYTES // 2, w), pinned)
    if config.engine_reserves and config.enable_sleep and config.sleep_level == 1:
        terms["engine_weights_asleep"] = held_bytes(
            engine_blocks(shape, c, config.rollout_tensor_parallel), pinned)
    return terms


def rank_phase_terms(shape: ModelShape, config: ProbeConfig,
                     run: NodeRun) -> dict[str, dict[str, int]]:
    """One rank's host terms in each of HOST_PHASES (memory/phases.py's phases): the actor's
    params come back for the rollout where it generates itself and for both training phases,
    its optimizer for the update; the critic's params for its value forward (experience) and
    its update (its own phase, where no more is on the host than in rollout), its optimizer
    for the update. On a GPU freed pinned blocks stay cached: from the second step on, every
    term is held in every phase."""
    held = rank_held_terms(shape, config, run)
    wanted = {"rollout": ("offloaded_params", "offloaded_optimizer", "reference",
                          "critic_offloaded_params", "critic_offloaded_optimizer"),
              "experience": ("offloaded_optimizer", "reference", "engine_weights_asleep",
                             "critic_offloaded_optimizer"),
              "update": ("reference", "engine_weights_asleep", "critic_offloaded_params",
                         "critic_offloaded_optimizer")}
    on_host = {phase: {name: held[name] for name in names} for phase, names in wanted.items()}
    if config.actor_generates:  # generating itself, the actor has its params on the device
        on_host["rollout"]["offloaded_params"] = 0
    if run.on_gpu:
        union: dict[str, int] = {}
        for terms in on_host.values():
            for name, value in terms.items():
                union[name] = max(union.get(name, 0), value)
        on_host = {phase: dict(union) for phase in on_host}
    return on_host


def node_host(shape: ModelShape, config: ProbeConfig, run: NodeRun, host_bytes: int,
              threshold: float | None = None) -> NodeHost:
    """The node's host memory for `config` on `run`'s node of `host_bytes` RAM: each phase of
    a step and the start-up, every rank on the node counted, against `threshold` of it
    (default: Ray's, read from the environment, or the whole of it without Ray)."""
    profile, r = run.profile, run.ranks_per_node
    on_host = rank_phase_terms(shape, config, run)
    shared = shared_terms(shape, config, run)
    processes = r * run.rank_process_bytes
    phases = {phase: {"rank_processes": processes,
                      **{f"{name} x{r}": r * value for name, value in on_host[phase].items()
                         if value},
                      **shared} for phase in HOST_PHASES}
    phases["startup"] = {"rank_processes": processes, **startup_terms(shape, config, run),
                         **{k: v for k, v in shared.items() if k.startswith("ray_processes")}}
    rank_held = max(sum(terms.values()) for terms in on_host.values())
    if threshold is None:
        threshold = ray_threshold() if profile.ray else 1.0
    killer = "Ray's memory monitor" if profile.ray else "the kernel's OOM killer"
    return NodeHost(phases, host_bytes, threshold, killer, rank_held, run.rank_process_bytes,
                    process_notes(run))


def process_notes(run: NodeRun) -> tuple[str, ...]:
    """Where the rank processes' figure comes from, when a reader should know."""
    if run.process_bytes is None and run.on_gpu:
        return (f"rank processes: the prior {format_bytes(GPU_RANK_PROCESS_BYTES)} per rank, "
                "not yet measured on a GPU",)
    if run.process_note:
        return (f"rank processes: {run.process_note}",)
    return ()


def engine_blocks(shape: ModelShape, compute_bytes: int, tensor_parallel: int) -> list[int]:
    """One rank's rollout engine weights, one block per allocation as vLLM holds them (fused
    qkv and gate-up projections per layer, the embedding, an untied LM head), split over
    `tensor_parallel` ranks."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tp, c = tensor_parallel, compute_bytes
    layer = [c * (h * (q + 2 * kv)) // tp, c * (q + 2 * kv) // tp, c * q * h // tp,
             c * 2 * h * shape.intermediate // tp, c * shape.intermediate * h // tp,
             c * h, c * h]
    blocks = layer * shape.layers + [c * shape.embedding_params // (1 if shape.tied_embeddings
                                                                  else tp), c * h]
    if not shape.tied_embeddings:
        blocks.append(c * shape.embedding_params // tp)
    rest = shape.engine_params(tp) * c - sum(blocks)  # the vision tower: a block per unit
    if rest > 0 and shape.vision_layers:
        per_block = rest // (shape.vision_layers + 1)
        blocks += [per_block] * shape.vision_layers + [rest - per_block * shape.vision_layers]
    return blocks


def startup_terms(shape: ModelShape, config: ProbeConfig, run: NodeRun) -> dict[str, int]:
    """The checkpoint read into host RAM before FSDP shards it: the actor in fp32, then the
    reference (loaded after the actor's copy is freed), on every rank or one per node."""
    profile = run.profile
    every = profile.load_on_every_rank
    if every is None:  # verl: meta tensors on all but rank 0 unless the embeddings are tied
        every = shape.tied_embeddings
    loaders = run.ranks_per_node if every else 1
    actor = PARAM_BYTES * shape.num_params
    reference = (profile.ref_load_bytes or run.compute_bytes) * shape.num_params \
        if config.holds_ref_copy else 0
    if profile.ref_loaded_beside_actor:
        return {f"checkpoint_load x{loaders}": loaders * (actor + reference)}
    return {f"checkpoint_load x{loaders}": loaders * max(actor, reference)}


def shared_terms(shape: ModelShape, config: ProbeConfig, run: NodeRun) -> dict[str, int]:
    """What the node holds once, whatever its ranks: Ray's processes and the step's batch in
    its object store (and the driver), and a VL batch's images."""
    terms: dict[str, int] = {}
    share = config.share(run.world_size)
    node_responses = share.responses_per_step * run.ranks_per_node
    if run.profile.ray:
        prompt, response = config.max_prompt_length, config.max_response_length
        seq = prompt + response
        # DataProto of a step: input_ids, attention_mask, position_ids (int64, the sequence)
        # and responses (int64), with old and reference log-probs, advantages and the
        # response mask in fp32; put in the object store once and held by the driver
        per_response = 8 * (3 * seq + response) + 4 * 4 * response
        terms["ray_processes"] = RAY_NODE_PROCESSES_BYTES
        terms["ray_object_store_batch"] = 2 * node_responses * per_response
    if shape.is_vl:
        patches = (config.image_size_px // shape.patch_px) ** 2
        rgb = 3 * config.image_size_px ** 2  # one decoded image, uint8
        pixel_values = 4 * patches * 3 * 2 * shape.patch_px ** 2  # fp32, temporal patch 2
        prompts = share.prompts_per_step * run.ranks_per_node
        terms["vl_images"] = prompts * rgb + node_responses * pixel_values
    return terms


def format_node_host(host: NodeHost, ranks_per_node: int) -> str:
    """The node's host memory as a table: each term per phase, the totals and the verdict."""
    names = list(dict.fromkeys(name for terms in host.phases.values() for name in terms))
    phases = list(host.phases)
    lines = [f"node host memory ({ranks_per_node} rank{'s' if ranks_per_node > 1 else ''} on "
             f"the node, {host.killer} at {host.threshold:.0%} of "
             f"{format_bytes(host.host_bytes)}):", "",
             f"{'term':<30}" + "".join(f"{phase:>12}" for phase in phases)]
    for name in names:
        lines.append(f"{name:<30}" + "".join(
            f"{format_bytes(host.phases[p][name]) if host.phases[p].get(name) else '-':>12}"
            for p in phases))
    lines.append(f"{'total':<30}" + "".join(f"{format_bytes(host.total(p)):>12}"
                                           for p in phases))
    lines += ["", host.verdict(), *host.notes]
    return "\n".join(lines)
