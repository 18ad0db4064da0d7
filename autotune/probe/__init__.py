"""probe: what runs inside a probe's own process, and what crosses its boundary.

The entry points of a probe's processes are this package's top floor: the worker (`python -m
autotune.probe.worker`), the fork server that forks CPU probes from one import of torch
(`python -m autotune.probe.fork_server`) and the step traced with fake tensors for its memory
(trace.py, `python -m autotune.probe.trace`, with its own meter). Under them, a package each,
each floor importing only the floors below it (tests/test_layout.py):

    measure/   what a probe is asked and what it reports: ProbeRequest / ProbeResult, failure
               classes, the Meter protocol and the probe's meter, what else the machine did
    modeling/  the models a step trains: built from their config, FSDP/TP-sharded, LoRA,
               Ulysses SP, the fused log-prob head, PPO's critic
    step/      the built-in GRPO/PPO step, a module per phase, and its rollout engines
    launch/    the processes around a probe: a real multi-rank probe's ranks, a run of the
               user's trainer and its log lines

May import batching, config, errors, files, hardware, registry, process_tag, version and
memory.replay (which runs the trace's allocations through the pure model of the caching
allocator) and
memory.workspaces (cuBLAS's workspaces the trace records).
probe.measure's result, oom and machine and probe.launch import no torch (runners and the
sweep use some; a command probe's worker needs none); the rest imports torch and
transformers, and only a worker process of the built-in probe, a fork server, a trace process
and `autotune estimate --trace` load it.
"""
