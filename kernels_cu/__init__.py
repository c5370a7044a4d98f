"""CUDA C++ sources of sparsecore's GPU kernels, installed as ``sparsecore.kernels_cu``.

The ``.cu``, ``.cuh`` and ``.h`` files beside this module are package data:
`sparsecore.backends.kernel_registry` lists them with their kernels, and the
CuPy backend reads them and compiles them with NVRTC at run time. This module
defines nothing; it makes the directory an importable package (so an
installation can be located with ``importlib``).
"""
