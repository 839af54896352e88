"""Numeric kernels for the QeRL pipeline, each beside a plain-torch reference."""
