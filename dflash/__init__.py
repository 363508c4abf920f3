"""dflash: training stack for DFlash speculative-decoding drafters.

Subpackages are imported on demand so that `dflash.ops` works with torch and triton alone:
  dflash.data    token store, batch planner, packer, collation
  dflash.ops     Triton varlen attention kernels and their PyTorch references
  dflash.models  frozen target feature extractor and the DFlash drafter
"""

__version__ = "0.1.0"
