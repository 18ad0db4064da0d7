"""probe.measure: what a probe is asked and what it measures and reports (the probe's first
floor).

Owns the plain ProbeRequest / ProbeResult and the probe's files (result.py), failure
classification (oom.py), the Meter protocol and the probe's meter: phase peaks of the device,
the allocator and the host (meter.py), and what else the machine did while a probe timed its
steps (machine.py: other processes' cores, the load, the GPU's other processes; the one
contention rule).
May import config, errors, files, hardware, process_tag and version. result.py, oom.py and
machine.py import no torch (runners and the sweep read them); meter.py does.
"""
