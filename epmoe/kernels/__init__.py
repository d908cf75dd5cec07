"""Triton kernels of the expert path: permute (ep_scatter), gather (ep_gather), fused
activation + quantization, grouped GEMM. Each kernel sits directly above its Python wrapper,
which checks inputs (ValueError naming value, rule and fix), allocates and launches.

Without CUDA they run under Triton's CPU interpreter (epmoe.env sets TRITON_INTERPRET=1 before
any kernel is defined)."""
