"""Triton kernels (CUDA, or the Triton interpreter on CPU tensors) under the reference ops' names."""
