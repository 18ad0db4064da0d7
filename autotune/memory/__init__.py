"""memory: how much memory a config needs, per GPU and per phase, without running it.

Owns the arithmetic memory model (model.py), its calibration on measured peaks
(calibration.py), the estimate as people read it (estimate.py) and the length headroom
(length.py). May import batching, config, errors and registry; never torch, so `autotune
estimate` and the sweep's pre-screen are instant.
"""
