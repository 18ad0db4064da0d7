"""probe: what runs inside a probe's own process, and what crosses its boundary.

Owns the built-in GRPO step (step.py) and its rollout engine (engine.py: the Rollout protocol, the
stand-in with vLLM-like memory or HF generation's; vllm_engine.py: the real vLLM, imported only
when that engine starts), PPO's critic (critic.py), the log-probs fused with the LM head
(logprob.py), LoRA's adapters on the actor (lora.py, through peft), Ulysses sequence parallelism
(ulysses.py: each sequence split over ranks, all-to-all around attention), the models it builds
(models.py), the Meter protocol they measure through and the probe's meter (meter.py), FSDP
sharding over real or emulated ranks (sharding.py), the worker entry point (`python -m
autotune.probe.worker`) and the fork server that forks CPU probes from one import of torch (`python
-m autotune.probe.fork_server`), the launcher of a real multi-rank probe's processes (launcher.py),
the step traced with fake tensors for its memory (trace.py, with its own meter), the command probe
(command.py: a short run of the user's own trainer, read through its log by trainer_logs.py), the
lifetime of every process of a probe (process_tag.py: it dies with its parent and is found by its
tag), what else the machine did while a probe timed its steps (machine.py: other processes' cores,
the load, the GPU's other processes; the one contention rule), failure classification (oom.py) and
the plain ProbeRequest / ProbeResult (result.py). May import batching, config, errors, files,
hardware, registry and memory.allocator (the pure model the trace replays its allocations through).
result.py, oom.py, launcher.py, process_tag.py, machine.py, command.py and trainer_logs.py import
no torch (runners and the sweep use some; a command probe's worker needs none); the rest imports
torch and transformers, and only a worker process of the built-in probe, a fork server, a trace
process (`python -m autotune.probe.trace`) and `autotune estimate --trace` load it.
"""
