"""Torch reference implementations of the ops: the ground truth every back-end's kernels are tested against, under the same op names."""
