"""The dspark C API: dspark.h (C), dspark.hpp (header-only C++), dspark.c (embeds CPython) and bridge.py (the
Python it calls). Build with CMake (CMakeLists.txt, dsparkConfig.cmake) or `python -m dspark.tools.capi --build
DIR`; see the README's "Embedding in C and C++"."""

from pathlib import Path

CAPI_DIR = Path(__file__).resolve().parent  # the C sources, headers and CMake files ship here

