"""Builds the native kernels (csrc/kernels.c) with the compiler already on the machine.

``LEVER_CFLAGS`` overrides the optimisation flags (default: tuned for the
building CPU, which is the CPU that runs it for a source install).
"""
import os

from setuptools import Extension, setup

flags = os.environ.get("LEVER_CFLAGS", "-O3 -march=native").split()
# -fno-wrapv: Python's own CFLAGS, which setuptools puts first, carry -fwrapv. Defining signed
# overflow keeps gcc from treating the kernels' int index arithmetic as plain arithmetic, and the
# one-activation-row Q5_0/Q8_0 path compiled that way ran 2.5x slower (the draft's 896x4864
# projections, weights from DRAM: 0.51 ms against 0.21 ms a call). The kernels never overflow a
# signed integer, so the results are the same bits either way.
# -Werror=implicit-function-declaration: a helper defined only inside a SIMD branch once left the
# portable build calling it undeclared (an int-returning guess, so wrong sums); now it stops the build.
setup(ext_modules=[Extension(
    "lever_actors._kernels", ["csrc/kernels.c"],
    extra_compile_args=["-std=c11", "-fno-wrapv", "-ffp-contract=off", "-fno-fast-math",
                        "-Werror=implicit-function-declaration", *flags],
    extra_link_args=["-lpthread", "-lm"],
)])
