"""memory: how much memory a config needs, per GPU and per phase, without running it.

Owns the arithmetic memory model (model.py: estimate_memory, which adds up the phases of
phases.py from the model's shape in shape.py, its model states in states.py and the logits by
kernel in logits.py), its calibration on measured peaks (calibration.py), the verdict as people
read it (verdict.py), the length headroom (length.py), the node's host memory (host.py),
PyTorch's CUDA caching allocator (allocator.py) replayed on a recorded allocation stream
(replay.py: the probe's trace calls it too), the allocator's reserve sketched from a step's
allocations (the sketch package), cuBLAS's workspaces the allocator holds (workspaces.py),
what a GPU process holds outside torch (outside_torch.py) and the trainers' own memory
figures (trainer_figures.py).
May import batching, config, errors, files (its JSON types) and registry; never torch, so
`autotune estimate` and the sweep's pre-screen are instant.
"""
