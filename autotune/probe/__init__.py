"""probe: what runs inside a probe's own process, and what crosses its boundary.

Owns the built-in GRPO step (step.py), the models it builds (models.py), the memory meter
(meter.py), FSDP sharding over real or emulated ranks (sharding.py), the worker entry point
(`python -m autotune.probe.worker`), the launcher of a real multi-rank probe's processes
(launcher.py), failure classification (oom.py) and the plain ProbeRequest / ProbeResult
(result.py). May import config, errors, files, hardware and registry. result.py, oom.py and
launcher.py import no torch (runners and the sweep use them); the rest imports torch and
transformers, and only a worker process loads it.
"""
