"""The DFlash drafter kind (`DFlashDraftModel`): the network of `dflash.drafter.network`, the objective's
terms alone, nothing added to the config, the memory plan or the FLOPs: `DrafterKind`'s answers."""
from dflash.drafter.kinds import DrafterKind
from dflash.drafter.network import DFlashDrafter


class DFlashKind(DrafterKind):
    network = DFlashDrafter


KIND = DFlashKind()
