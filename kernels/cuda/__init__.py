"""The device loop's CUDA C and its NVRTC build."""
