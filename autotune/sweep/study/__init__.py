"""sweep.study: what a study holds (the sweep's fourth floor).

Owns where a study lives and the driver lock (storage.py), how drivers share one study
(sharing.py: who owns a config, which running trials are dead; heartbeat.py: a driver's
trials kept alive from a thread of its own), what a sweep maximises and how
each outcome is told to Optuna (objective.py, record.py), everything that defines a sweep and
what of it a resumed study must share (settings.py) and each trial's files under logs/
(trial_files.py).
May import config, errors, files, hardware, version, probe.measure.result, sweep.space and
sweep.execution.
"""
