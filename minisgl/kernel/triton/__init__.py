"""Triton versions of the ops in kernel/reference.py, one module per op family."""
