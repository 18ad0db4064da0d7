"""memory.sketch: the caching allocator's reserve beyond a phase's tensors, without a trace.

Owns the sketches the memory model adds to its tensors on a GPU: a phase's large
allocations laid out in the step's order and replayed through memory/replay.py, for the
trained phases (step_reserve.py: the experience's forwards, the update's micro-batches and
AdamW steps) and an HF-generation rollout (rollout_reserve.py), in one vocabulary
(layout.py: the shapes a sketch needs, its event stream, FSDP's units gathered and
resharded on their streams). The trace (probe/trace.py) records the real stream; this is
what `autotune estimate` adds without one.
May import errors, version, config (its kernels' chunk size), memory.replay and
memory.workspaces (the cuBLAS workspace a step makes); never torch.
"""
