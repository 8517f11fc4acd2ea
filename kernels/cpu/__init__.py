"""The CPU loop's C kernels, each beside its Python wrapper, and their one worker pool."""
