"""What a command asked for, resolved once into what runs: the probe of `autotune probe`, the
plan of `autotune run`.

The options are what the user typed, typed and nothing more (`ProbeOptions`, `RunOptions`);
`plan_probe` and `plan_sweep` resolve them once: the device (its kind, its capacity, the cap a
probe runs under), the run's topology and how its ranks are probed, the rollout engine's
defaults, the search space with the user's values, the trainer the sweep writes a config
for, where probes run and how many at once, and the lines to say before it starts. Everything
downstream reads these frozen objects; nothing re-derives them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from autotune.config import (
    DEFAULT_HEADROOM,
    Knobs,
    ProbeConfig,
    Topology,
    algorithm_defaults,
    engine_reserves,
    format_bytes,
    load_knob_file,
    make_probe_config,
    trains_critic,
)
from autotune.errors import ConfigError
from autotune.hardware import (
    NO_GPU_HERE,
    Device,
    device_kind,
    has_nvidia_gpu,
    this_device,
    usable_cpu_ids,
)
from autotune.probe.measure.result import ProbeRequest
from autotune.registry import REGISTRY, get_model_spec, read_model_path_config
from autotune.runners import Runner, ray_cluster_gpus
from autotune.sweep.execution.command_probe import CommandTemplate, command_setup
from autotune.sweep.execution.placement import (
    RankPlan,
    default_topology,
    emulate_ranks,
    make_runner,
    plan_command_ranks,
    plan_ranks,
)
from autotune.sweep.feasibility.preflight import (
    check_model_on_device,
    check_node_host,
    vllm_installed,
)
from autotune.sweep.pick.finalists import DEFAULT_FINALISTS
from autotune.sweep.space.search_space import SearchSpace, load_search_space
from autotune.sweep.space.trainer_target import TrainerTarget, trainer_target
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.study.sharing import HEARTBEAT_S
from autotune.sweep.study.storage import check_storage, check_study_name
from autotune.trainers.verl import VERL

DEMO_MODEL, DEMO_SPACE, DEMO_CAP_BYTES, DEMO_TRIALS = "tiny-qwen2.5", "cpu-demo", 545 << 20, 12
GPU_MODEL, GPU_SPACE, GPU_TRIALS = "qwen2.5-0.5b", "grpo", 40
PPO_SPACES = {"cpu-demo": "cpu-demo-ppo", "grpo": "ppo"}  # the defaults with --algorithm ppo
TIMED_STEPS = 3  # a full probe's (--full-steps) timed steps at least: it measures its spread
SHORT_TIMED_STEPS = 2  # a short probe's: each step also samples every loop's units
MIN_TIMED_S = 2.0  # without --timed-steps, a full probe's steps repeat until they add up to
# this (a short probe's while its step's error is over 1%, within one step's time or this)


@dataclass(frozen=True)
class ProbeOptions:
    """How a command's probes run, as given: the model, the device and its limits, the run
    being tuned, the steps, and knobs set with --set."""

    model: str | None = None
    model_path: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    gpus: tuple[int, ...] | None = None  # GPU ids to pin probes to
    cpu_threads: int | None = None
    gpu_memory_limit_bytes: int | None = None
    reserve_gpu_memory_bytes: int = 0
    host_memory_limit_bytes: int | None = None
    probe_timeout_s: float = 900.0
    nnodes: int | None = None  # None: the base config's, else 1
    gpus_per_node: int | None = None  # None: the base config's, else the GPUs here
    ranks: str = "auto"  # auto | real | emulated
    warmup_steps: int = 1
    timed_steps: int | None = None  # None: TIMED_STEPS (full), SHORT_TIMED_STEPS (short)
    full_steps: bool = False  # every unit of every step, not a short probe's sample
    engine: str = "auto"  # auto | vllm-like | hf
    dtype: str = "auto"
    seed: int = 0
    knobs: Knobs = field(default_factory=dict)  # --set, typed


@dataclass(frozen=True)
class RunOptions:
    """`autotune run` as given: its probes, the search, and where probes run."""

    probe: ProbeOptions = field(default_factory=ProbeOptions)
    space: str | None = None  # a file or a shipped space's name; None: the default
    study: str | None = None  # None: MODEL-SPACE
    results_dir: str = "results"
    objective: str = "throughput_per_memory"
    headroom: float = DEFAULT_HEADROOM
    trials: int | None = None
    timeout_s: float | None = None
    patience: int | None = None
    sampler: str = "tpe"
    base_config: str | None = None
    prune: bool = True
    prescreen: bool = True
    trace: bool = True
    stop_slow: bool = True  # a probe stops once it measured itself under the best (tally.py)
    parallel: int | None = None
    gpus_per_trial: int | None = None  # None: 1, or the run's ranks when they run for real
    executor: str = "local"  # local | ray
    address: str | None = None
    storage: str | None = None
    heartbeat_s: float = HEARTBEAT_S
    confirm: int = 3
    finalists: int = DEFAULT_FINALISTS  # the best K probed again before the pick
    trainer: str | None = None
    launch: str | None = None
    host_memory_bytes: int | None = None  # one node's RAM (None: this machine's)


@dataclass(frozen=True)
class SweepPlan:
    """A sweep ready to run: its settings, the runner its probes run on, the trainer config it
    writes, and what to say before it starts."""

    settings: SweepSettings
    runner: Runner
    trainer: TrainerTarget | None
    notes: tuple[str, ...]


def engine_knobs(engine: str, on_gpu: bool, trainer: str | None = None,
                 named: frozenset[str] = frozenset()) -> Knobs:
    """The rollout engine's knobs --engine sets: an explicit --engine always (as --set
    would); auto only where the space and the user say nothing of the engine (`named`).
    auto on a GPU is EasyR1's and verl's vLLM: the real one where vLLM is installed (vllm),
    else the stand-in with its memory (vllm-like); for TRL, policy (TRL generates with the
    trained model itself); hf on a CPU (a stand-in device whose interpreter alone takes a
    large share of a small cap: the real engine runs there when named, with a KV budget).
    verl's vLLM (>= 0.8.5) sleeps at level 2, EasyR1's at 1."""
    if engine == "auto":
        if "rollout_engine" in named:
            return {}
        engine = "policy" if trainer == "trl" else "hf" if not on_gpu else (
            "vllm" if vllm_installed() else "vllm-like")
    knobs: Knobs = {"rollout_engine": engine}
    if engine_reserves(engine) and trainer == "verl" and "sleep_level" not in named:
        knobs["sleep_level"] = 2
    return knobs


# What each trainer sets in its workers' environment that moves their memory: EasyR1's Ray
# runtime env (verl/trainer/main.py of EasyR1: expandable segments off, no record_stream for
# NCCL's tensors); verl's PPO_RAY_RUNTIME_ENV sets no allocator setting (it switches
# expandable segments per phase in code: the knob); TRL sets nothing (the user's own).
TRAINER_ENV: dict[str, dict[str, str]] = {
    "easyr1": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
               "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    "verl": {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_CUMEM_ENABLE": "0"},
}
# The FSDP wrapper each trainer runs: EasyR1 wraps with FSDP1 only; verl's actor, critic and
# reference take its actor strategy, whose default its adapter holds (fsdp: FSDP1) unless
# the config says fsdp2; TRL shards through accelerate (the probe's default, fsdp2).
TRAINER_FSDP = {"easyr1": "fsdp", "verl": (VERL.defaults or {})["fsdp_strategy"]}


def trainer_env(trainer: str | None) -> dict[str, str]:
    """The environment the trainer gives its workers (TRAINER_ENV), for the probe's."""
    return dict(TRAINER_ENV.get(trainer or "", {}))


def trainer_knobs(trainer: str | None, on_gpu: bool,
                  named: frozenset[str] = frozenset()) -> Knobs:
    """What the target trainer always does that a knob stands for, where nothing names it.
    verl takes every response position's entropy in its old-log-prob pass
    (verl/workers/fsdp_workers.py compute_log_prob: calculate_entropy=True; its actor/entropy
    metric). The CUDA allocator: verl turns expandable segments on outside the rollout
    (fsdp_workers.py rollout_mode, via verl/utils/device.py set_expandable_segments);
    EasyR1's Ray runtime env sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
    (verl/trainer/main.py), and TRL sets nothing (the default, off). TRL 1.x scores every
    log-prob through its fused LM head (trl/trainer/grpo_trainer.py add_fused_lm_head), and
    HF Trainer steps AdamW with its fused kernel (optim adamw_torch_fused, torch >= 2.8)."""
    knobs: Knobs = {}
    if trainer in TRAINER_FSDP and "fsdp_strategy" not in named:
        knobs["fsdp_strategy"] = TRAINER_FSDP[trainer]
    if trainer == "verl" and "entropy_metric" not in named:
        knobs["entropy_metric"] = True
    if trainer == "verl" and on_gpu and "expandable_segments" not in named:
        knobs["expandable_segments"] = True
    if trainer == "verl" and on_gpu and "fused_logprob_kernel" not in named \
            and verl_triton_installed():
        knobs["fused_logprob_kernel"] = "triton"  # verl's own kernel, where fused_logprob is on
    if trainer == "trl":
        knobs.update({knob: value for knob, value in
                      (("fused_logprob", True), ("fused_logprob_kernel", "trl"),
                       ("fused_optimizer", True))
                      if knob not in named})
    return knobs


def verl_triton_installed() -> bool:
    """Whether verl's Triton linear cross-entropy and Triton are installed here, found
    without importing either (probes on this machine's Python import them)."""
    verl, triton = importlib.util.find_spec("verl"), importlib.util.find_spec("triton")
    if verl is None or triton is None or not verl.submodule_search_locations:
        return False
    return any((Path(root) / "utils" / "kernel" / "linear_cross_entropy.py").is_file()
               for root in verl.submodule_search_locations)


def check_model(options: ProbeOptions, known_model: bool = True) -> str:
    """The model's name (a registry model, or a local directory's name), checked before
    anything runs. `known_model`: --model must be in the registry (a probe of the user's
    trainer runs the model of the trainer's config: --model is then a label)."""
    if options.model_path is not None:
        read_model_path_config(options.model_path)
        return options.model or Path(options.model_path).name
    if options.model is None:
        raise ConfigError("give --model NAME (see `autotune models`) or --model-path DIR")
    if known_model:
        get_model_spec(options.model)
    return options.model


def resolve_device(options: ProbeOptions, local: bool = True,
                   gpu_here: bool | None = None) -> Device:
    """--device and the memory limits as a Device: auto is cuda where an NVIDIA GPU is
    (`gpu_here`: a Ray cluster's; by default this machine's); `local` probes run here, so
    --device cuda needs a GPU here and the capacity is this machine's."""
    if local and options.device == "cuda" and not has_nvidia_gpu():
        raise ConfigError(NO_GPU_HERE)
    kind = device_kind(options.device, gpu_here)
    if kind == "cpu" and options.gpus is not None:
        ids = ",".join(map(str, options.gpus))
        raise ConfigError(f"--gpus {ids}: GPU ids, but probes run on the CPU here; leave out "
                          "--gpus, or use --device cuda where a GPU is")
    cores = len(usable_cpu_ids())
    if local and options.cpu_threads is not None and options.cpu_threads > cores:
        raise ConfigError(f"--threads {options.cpu_threads}: this machine lets autotune use "
                          f"{cores} core(s); use --threads {cores} or less")
    if local:
        device = this_device(kind, options.gpu_memory_limit_bytes,
                             options.reserve_gpu_memory_bytes)
        check_memory_flags(device, "this GPU's" if kind == "cuda" else "this machine's RAM,",
                           options.host_memory_limit_bytes)
        return device
    return Device(kind, None, options.gpu_memory_limit_bytes, options.reserve_gpu_memory_bytes)


def check_memory_flags(device: Device, capacity_said: str,
                       host_limit_bytes: int | None = None) -> None:
    """ConfigError when --reserve-gpu-memory leaves nothing of the device, --gpu-memory-limit
    is more than the device has (it would be planned as if it were there), or on a CPU
    --host-memory-limit is below the device cap (the same memory: the probe would be killed
    as host_oom before it reached the cap); `capacity_said` names where the capacity came
    from (`--capacity`, `this GPU's`)."""
    cap = device.cap_bytes
    if not device.on_gpu and host_limit_bytes is not None and cap is not None \
            and host_limit_bytes < cap:
        raise ConfigError(f"--host-memory-limit {format_bytes(host_limit_bytes)}: below the "
                          f"device cap of {format_bytes(cap)}, and on the CPU both cap the same "
                          "memory; raise it, or lower --gpu-memory-limit to it")
    capacity = device.capacity_bytes
    if capacity is None:
        return
    if device.reserve_bytes >= capacity:
        raise ConfigError(f"--reserve-gpu-memory {format_bytes(device.reserve_bytes)}: leaves "
                          f"nothing of {capacity_said} {format_bytes(capacity)}; reserve less")
    if device.limit_bytes is not None and device.limit_bytes > capacity:
        raise ConfigError(f"--gpu-memory-limit {format_bytes(device.limit_bytes)}: more than "
                          f"{capacity_said} {format_bytes(capacity)}; give at most that, or "
                          "leave it out")


def probe_request(options: ProbeOptions, model: str, device: Device, topology: Topology,
                  config: ProbeConfig, emulated: bool,
                  trainer: str | None = None) -> ProbeRequest:
    """The ProbeRequest the options make for `config` (a sweep replaces it per trial), in
    the environment `trainer` gives its workers."""
    return ProbeRequest(
        model=model, config=config, model_path=options.model_path, device=device,
        gpu_ids=options.gpus, cpu_threads=options.cpu_threads,
        host_memory_limit_bytes=options.host_memory_limit_bytes,
        timeout_s=options.probe_timeout_s, warmup_steps=options.warmup_steps,
        timed_steps=options.timed_steps or (TIMED_STEPS if options.full_steps
                                            else SHORT_TIMED_STEPS),
        timed_min_s=MIN_TIMED_S if options.timed_steps is None else 0.0, seed=options.seed,
        dtype=options.dtype, nnodes=topology.nnodes, gpus_per_node=topology.gpus_per_node,
        emulated=emulated, env=trainer_env(trainer), full_steps=options.full_steps)


def plan_probe(options: ProbeOptions) -> ProbeRequest:
    """`autotune probe`: one probe of the options' model on this machine, every rule checked
    before it starts."""
    model = check_model(options)
    device = resolve_device(options)
    topology = default_topology(options.nnodes, options.gpus_per_node, device, options.gpus)
    engine = engine_knobs(options.engine, device.on_gpu, named=frozenset(options.knobs))
    config = make_probe_config({**engine, **algorithm_defaults(options.knobs), **options.knobs},
                               topology.world_size)
    emulated = emulate_ranks(options.ranks, topology.world_size, device, options.gpus)
    request = probe_request(options, model, device, topology, config, emulated)
    check_model_on_device(request, config, what="the probe", device_asked=options.device)
    return request


def embedded_default(options: RunOptions) -> tuple[RunOptions, str | None]:
    """Without --model, the embedded default: the tiny model on the CPU under a 545 MiB cap
    where no NVIDIA GPU is visible, qwen2.5-0.5b on the GPU otherwise; and the note that says
    so. Without --space, the CPU demo's space for a tiny model on a CPU, else grpo."""
    probe, note = options.probe, None
    budget_given = options.trials or options.timeout_s or options.patience
    ppo = trains_critic(probe.knobs.get("algorithm"))

    def default(space: str) -> str:
        return PPO_SPACES[space] if ppo else space

    on_cpu = device_kind(probe.device) == "cpu"
    if probe.model is None and probe.model_path is None:
        if on_cpu:
            probe = dataclasses.replace(
                probe, model=DEMO_MODEL, device="cpu",
                gpu_memory_limit_bytes=probe.gpu_memory_limit_bytes or DEMO_CAP_BYTES)
            options = dataclasses.replace(options, probe=probe,
                                          space=options.space or default(DEMO_SPACE),
                                          trials=options.trials if budget_given else DEMO_TRIALS)
        else:
            probe = dataclasses.replace(probe, model=GPU_MODEL)
            options = dataclasses.replace(options, probe=probe,
                                          space=options.space or default(GPU_SPACE))
        note = (f"no --model: running the embedded default, {probe.model} on "
                f"{device_kind(probe.device)} over search space {options.space}")
    if options.trials is None and not budget_given:
        options = dataclasses.replace(options, trials=GPU_TRIALS)
    if options.space is None:  # GRPO's real shapes take minutes per probe on a CPU (a model
        # that is not tiny, on a CPU found by itself, is refused by the preflight)
        tiny = probe.model_path is None and probe.model in REGISTRY and REGISTRY[probe.model].tiny
        demo = probe.device == "cpu" or (on_cpu and tiny)
        options = dataclasses.replace(options, space=default(DEMO_SPACE if demo else GPU_SPACE))
    return options, note


def checked_run_options(options: RunOptions) -> RunOptions:
    """The options' own rules, before anything is read or made; --launch without a model
    probes the trainer's run, on the trainer's space unless --space names one."""
    if options.address is not None and options.executor != "ray":
        raise ConfigError("--address: only with --executor ray")
    if options.storage is not None:  # a bad --storage is refused before anything is made
        check_storage(options.storage)
    if options.launch is not None:
        if options.trainer is None:
            raise ConfigError("--launch needs --trainer easyr1, verl or trl: it decides where "
                              "each knob goes in the trainer's config and how its log is read")
        if options.probe.model is None and options.probe.model_path is None:
            options = dataclasses.replace(options, space=options.space or options.trainer,
                                          probe=dataclasses.replace(
                                              options.probe, model=f"{options.trainer}-run"))
    return options


def how_probes_run(options: RunOptions, target: TrainerTarget | None, topology: Topology,
                   device: Device, space: SearchSpace
                   ) -> tuple[RankPlan, CommandTemplate | None, list[str]]:
    """How the run's ranks are probed, and with --launch the trainer's command each probe
    runs (and the lines that say so)."""
    probe = options.probe
    if options.launch is None:
        return plan_ranks(topology, device, probe.ranks, probe.gpus,
                          options.executor == "local", options.confirm,
                          options.gpus_per_trial), None, []
    assert target is not None
    steps = probe.warmup_steps + (probe.timed_steps or TIMED_STEPS)
    ranks = plan_command_ranks(topology, device, probe.gpus, steps, options.gpus_per_trial)
    template, said = command_setup(target, options.launch, space, steps)
    return ranks, template, list(said)


def plan_sweep(options: RunOptions) -> SweepPlan:
    """Resolve `autotune run`'s options into a SweepPlan, every input checked first (one
    line each: nothing is made on bad input). A Ray runner connects to its cluster here."""
    options, default_note = embedded_default(checked_run_options(options))
    probe = options.probe
    model = check_model(probe, known_model=options.launch is None)
    assert options.space is not None
    loaded = load_search_space(options.space)
    if loaded.trainer_keys and options.launch is None:
        raise ConfigError(f"{loaded.source}: searches the trainer's own keys "
                          f"({', '.join(loaded.trainer_keys)}); only a run of your trainer can "
                          "apply them: add --trainer and --launch")
    local = options.executor == "local"
    device = resolve_device(probe) if local else cluster_device(probe, options.address)
    if not device.on_gpu and (options.gpus_per_trial or 1) > 1:
        raise ConfigError(f"--gpus-per-trial {options.gpus_per_trial}: probes run on the CPU, "
                          "which has no GPUs to pin; split its cores with --parallel instead")
    target, notes = None, [default_note] if default_note else []
    if options.trainer is not None:  # its base config's topology is the default
        target, base, loaded, said = trainer_target(options.trainer, options.base_config,
                                                    loaded, probe.nnodes, probe.gpus_per_node,
                                                    launched=options.launch is not None,
                                                    on_cpu=not device.on_gpu)
        topology = target.topology
        notes += said
    else:
        topology = default_topology(probe.nnodes, probe.gpus_per_node, device, probe.gpus)
        base = load_knob_file(options.base_config) if options.base_config is not None else {}
    space, base_params = user_space(loaded, topology, probe, device, options, base)
    name = check_study_name(options.study if options.study is not None
                            else f"{model}-{space.name}")
    ranks, template, said = how_probes_run(options, target, topology, device, space)
    notes += said
    safe = space.config_for(space.safe_params())  # the template's config
    request = probe_request(probe, model, device, topology, safe, ranks.emulated,
                            options.trainer)
    if template is None:
        check_model_on_device(request, safe, device_checks=local, device_asked=probe.device)
    check_node_host(request, safe, options.host_memory_bytes,
                    target.adapter.name if target is not None else None)
    notes += [ranks.note] if ranks.note else []
    runner, slots = make_runner(options.executor, options.address, request, options.parallel,
                                ranks.gpus_per_trial, name)
    settings = SweepSettings(
        study_name=name, study_dir=Path(options.results_dir) / name, space=space,
        request=request, objective=options.objective, headroom=options.headroom,
        max_trials=options.trials, timeout_s=options.timeout_s, patience=options.patience,
        seed=probe.seed, sampler=options.sampler, base_params=base_params,
        prune_dominated=options.prune, prescreen=options.prescreen, trace=options.trace,
        stop_slow=options.stop_slow,
        trainer=f"{target.adapter.name} on {topology.nnodes}x{topology.gpus_per_node} GPUs"
        if target is not None else None, storage=options.storage, slots=tuple(slots),
        heartbeat_s=options.heartbeat_s, confirm=ranks.confirm, command=template,
        finalists=options.finalists,
        node_host_bytes=options.host_memory_bytes,
        node_trainer=target.adapter.name if target is not None else None)
    if len(slots) > 1:
        notes.append(f"{len(slots)} probes at a time ({options.executor}): "
                     f"{' | '.join(slot.describe() for slot in slots)}")
    return SweepPlan(settings, runner, target, tuple(notes))


def cluster_device(options: ProbeOptions, address: str | None) -> Device:
    """The device of probes on a Ray cluster: auto is cuda when the cluster has GPUs; its
    capacity is each probe's to report."""
    gpus = ray_cluster_gpus(address)
    if options.device == "cuda" and not gpus:
        raise ConfigError("--device cuda: the Ray cluster has no GPUs; use --device cpu or "
                          "start Ray on GPU nodes")
    return resolve_device(options, local=False, gpu_here=gpus > 0)


def user_space(loaded: SearchSpace, topology: Topology, probe: ProbeOptions, device: Device,
               options: RunOptions, base: Knobs
               ) -> tuple[SearchSpace, Knobs | None]:
    """The space for the run's topology with --set, the engine's defaults and the base
    config's values fixed, and the base config's searched values as a trial (with --trainer
    and no base config, the trainer's start is the safest config)."""
    loaded = loaded.for_world(topology.world_size)
    named = frozenset({*loaded.params, *loaded.fixed, *probe.knobs, *base})
    engine = {**engine_knobs(probe.engine, device.on_gpu, options.trainer, named),
              **trainer_knobs(options.trainer, device.on_gpu, named)}
    algorithm = algorithm_defaults({**dict.fromkeys(loaded.params), **loaded.fixed_knobs, **base,
                                    **probe.knobs})  # PPO's rollout_n, where none is named
    space, base_params = loaded.with_user_values({**engine, **algorithm, **probe.knobs}, base,
                                                 options.base_config or options.trainer)
    if options.trainer is not None and base_params is None:
        base_params = space.safe_params()
    return space, base_params

