"""sweep: the driver. Optuna ask/tell over probes until a stop rule, resumable, shared.

Owns the loop (tuner.py), how trials are told (record.py, objective.py) and counted
(tally.py), what must not be run (feasibility.py, with the traces it asks for: traced.py),
the search space (search_space.py), where the study lives and who may write it (storage.py,
sharing.py), parallel slots (parallel.py), the files a study leaves (artifacts.py) and the
progress view (progress.py). The driver alone talks to Optuna. May import config, errors,
files, hardware, registry, probe.result, runners, memory and trainers; never torch (probes
and traces run in their own processes), never the CLI.
"""
