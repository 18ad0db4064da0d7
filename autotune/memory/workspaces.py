"""cuBLAS's workspaces: what torch's BLAS handles hold through the caching allocator.

torch gives each cuBLAS handle, one per thread, a workspace per stream from the caching
allocator at its first GEMM and keeps it for the process's life
(aten/src/ATen/cuda/CublasHandlePool.cpp, `cublas_handle_stream_to_workspace`). A step has
two: the forward's thread, and the autograd engine's device thread for the backward. Each is
32 MiB on a Hopper card (CUBLAS_WORKSPACE_CONFIG's default there, :4096:8), cuBLASLt reusing
it (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default: `torch.backends.cuda.blas_workspace_size`).
Measured on the H200 (torch 2.11): torch's allocated peak less the traced tensors was 64.6 to
68.1 MiB in every phase of the six expandable-segments rows before the trace recorded them
(benchmarks/results/allocator_fidelity.json). Older cards default to 8 MiB a handle, where
these figures are 48 MiB over. The trace (probe/trace.py) records each where its thread's
first GEMM makes it; the memory model adds both to every phase's reserve (model.py). No torch
here.
"""

from __future__ import annotations

CUBLAS_WORKSPACE_BYTES = 32 << 20  # one handle's, on a stream
CUBLAS_HANDLES = 2  # the forward's thread and the autograd engine's
CUBLAS_WORKSPACES_BYTES = CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES
