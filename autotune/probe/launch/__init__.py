"""probe.launch: the processes around a probe (the probe's fourth floor, beside step).

Owns the launcher of a real multi-rank probe's ranks (launcher.py), the split probe's two
sides (split_sides.py: placement=separate, the engine's and the trainer's), the command probe
(command.py: a short run of the user's own trainer, measured from outside) and the trainer's
step lines read from its log (trainer_logs.py).
May import config, errors, files, hardware, process_tag, version and probe.measure; never
torch (a command probe's worker needs none).
"""
