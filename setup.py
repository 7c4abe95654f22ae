"""Packaging for dspark: the repo root is the `dspark` import package.

The user-facing layout keeps one folder per stage at the repository root
(export/, engines/, runtime/, plugins/, tools/, models/); setup.py maps each
folder onto a subpackage of `dspark`.
"""

from pathlib import Path

from setuptools import setup

SUBPACKAGES = ("models", "export", "engines", "runtime", "plugins", "tools")
ROOT = Path(__file__).parent


def _packages() -> list[str]:
    """Every folder with an __init__.py below the stage folders, found rather than listed (a
    listed one was once forgotten and the installed package lacked it)."""
    found = ["dspark"]
    for top in SUBPACKAGES:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            found.append(".".join(("dspark", *init.parent.relative_to(ROOT).parts)))
    return found


setup(
    name="dspark",
    version="0.1.0",
    description="Deployment compiler and runtime for DSpark speculative decoding",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=_packages(),
    package_dir={"dspark": ".", **{f"dspark.{name}": name for name in SUBPACKAGES}},
    # The bundled demo pair (models/demo/{target,dspark,dflash}) ships inside dspark.models.
    # The plugin sources ship so that an installed dspark can build them (plugins/build.sh).
    package_data={
        "dspark.models": ["demo/README.md", "demo/*/*.json", "demo/*/*.safetensors"],
        "dspark.runtime.serving": ["static/*"],  # the dashboard page: plain HTML/JS/CSS, no build step
        # The C API's sources ship so that an installed dspark can build libdspark (python -m dspark.tools.capi).
        "dspark.runtime.capi": ["*.h", "*.hpp", "*.c", "*.cmake", "CMakeLists.txt", "examples/*"],
        "dspark.plugins": [
            *("*.md", "*.sh", "*.cpp", "CMakeLists.txt", "common/*"),
            *("*/*.md", "*/*.yaml", "*/*.cu", "*/*.h", "*/*.cpp"),
        ],
    },
    install_requires=[
        "torch==2.13.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "click>=8.1",
        "tqdm>=4.66",
        "onnx>=1.17",
        "onnxruntime>=1.20",
        "onnxruntime-extensions>=0.15",
        "onnxscript>=0.2",
        "tokenizers>=0.20",
        "psutil>=5.9",
        "matplotlib>=3.8",
    ],
    extras_require={
        # dev carries what the tests drive: the serve stack, real HTTP clients, a browser driver.
        "dev": ["pytest>=8", "ruff>=0.6", "transformers>=4.51", "scipy>=1.11", "pyyaml>=6",
                "uvicorn>=0.30", "starlette>=0.38", "prometheus-client>=0.20", "openai>=1.40", "httpx>=0.27",
                "uvloop>=0.19; sys_platform != 'win32'", "httptools>=0.6",
                "selenium>=4.20"],
        "tensorrt": ["tensorrt>=10", "polygraphy>=0.49", "nvidia-ml-py>=12", "cuda-bindings>=12.6"],
        # TensorRT for RTX: builds plans ahead of time on any machine (no GPU); they run on RTX-class GPUs.
        # ~95 MB of wheels (tensorrt_rtx_cu13_libs), 228 MB installed; cuda-bindings serves the plans.
        "tensorrt-rtx": ["tensorrt-rtx>=1.7", "cuda-bindings>=13"],
        "bench": ["transformers>=4.51", "onnxruntime-genai>=0.18"],
        # uvloop + httptools: uvicorn's fast event loop and HTTP parser (about a tenth of the
        # 64-client throughput in tools/serve_bench)
        "serve": ["uvicorn>=0.30", "starlette>=0.38", "prometheus-client>=0.20",
                  "uvloop>=0.19; sys_platform != 'win32'", "httptools>=0.6"],
        # N engine replicas on Ray Serve behind one endpoint (dspark serve --replicas N, runtime/cluster)
        "ray": ["ray[serve]>=2.50", "uvicorn>=0.30", "starlette>=0.38", "prometheus-client>=0.20"],
    },
    entry_points={
        "console_scripts": [
            "dspark=dspark.tools.cli:main",
            "dspark-export=dspark.tools.cli:export_main",
            "dspark-build-engine=dspark.tools.cli:build_engine_main",
        ]
    },
)
