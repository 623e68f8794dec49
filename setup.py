"""Builds the native kernels (csrc/kernels.c) with the compiler already on the machine.

``LEVER_CFLAGS`` overrides the optimisation flags (default: tuned for the
building CPU, which is the CPU that runs it for a source install).
"""
import os

from setuptools import Extension, setup

flags = os.environ.get("LEVER_CFLAGS", "-O3 -march=native").split()
setup(ext_modules=[Extension(
    "lever_actors._kernels", ["csrc/kernels.c"],
    extra_compile_args=["-std=c11", "-ffp-contract=off", "-fno-fast-math", *flags],
    extra_link_args=["-lpthread", "-lm"],
)])
