"""Optional dependencies: what each extra of ``pip install kvshrink[...]`` brings, and a clear error
when a feature's extra is missing."""

from __future__ import annotations

import importlib.util

# extra -> what it is for (pyproject.toml's [project.optional-dependencies] lists the packages)
EXTRAS = {
    "eval": "the evaluation harness's plots and the embedded GGUF model (matplotlib, gguf)",
    "baselines": "the hf-quantized baseline's backends (optimum-quanto, hqq)",
    "gpu": "the Triton decode kernels of the GPU path (triton; CUDA builds of torch bring it)",
}


def has_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def require(module: str, package: str, extra: str, feature: str) -> None:
    """Raise ImportError naming the extra to install when ``module`` cannot be imported."""
    if not has_module(module):
        raise ImportError(
            f"{feature} needs the '{package}' package, which is not installed; install it with: "
            f"pip install 'kvshrink[{extra}]' (or pip install {package})"
        )
