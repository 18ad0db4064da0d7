"""sweep.execution: how a sweep's probes run (the sweep's second floor).

Owns where probes run (placement.py: the run's topology, real or emulated ranks, the runner),
which GPUs or cores each probe side by side gets (parallel.py: slots, the probe pool), each
trial's command when the probes are short runs of the user's trainer (command_probe.py) and a
Ctrl-C or SIGTERM that is never lost, whatever code it lands in (interrupts.py).
May import config, errors, files, hardware, process_tag, version, probe.measure.result,
runners, trainers and sweep.space.
"""
