"""sweep.pick: how configs are judged and picked, and what a study leaves (the sweep's fifth
floor).

Owns each config's probes taken together and the ranking on them (measurements.py), the
finalists probed again before the pick (finalists.py), each config's step pooled over every probe
that ran its phases (pooled.py), real-rank confirmations of the best
(confirm.py), trials.csv and best.yaml (artifacts.py) and the one export of a study's best to
a trainer's YAML (best_export.py).
May import config, errors, files, registry, version, probe.measure.result, runners, memory,
trainers and the sweep's lower floors (space, execution, feasibility, study).
"""
