"""Triton GPU kernels for the conversions; ``launch`` holds the host-side launchers."""
