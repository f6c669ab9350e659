"""Triton GPU kernels for the conversions; ``launchers`` holds the host-side launchers."""
