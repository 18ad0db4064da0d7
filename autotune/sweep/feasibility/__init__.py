"""sweep.feasibility: what must not be run, and what is left to try (the sweep's third floor).

Owns the rules in the order the sweep asks them (screen.py: Feasibility, composing
dominance.py over measured OOMs, prescreen.py's arithmetic memory model calibrated on the
study's probes, and traced.py's traces of a candidate's step in a trace process of the sweep's
own), what is left to try (frontier.py), the checks refused before the first probe
(preflight.py) and the length headroom of a study's configs by its calibrated model
(study_model.py).
May import batching, config, errors, files, hardware, registry, process_tag, version,
probe.measure.result, memory, sweep.space and sweep.execution; never torch (traces run in
their own process).
"""
