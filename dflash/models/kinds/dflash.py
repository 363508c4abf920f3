"""The DFlash drafter kind (`DFlashDraftModel`): the network of `dflash.models.drafter`, the objective's
terms alone, nothing added to the config, the memory plan or the FLOPs: `DrafterKind`'s answers."""
from dflash.models.drafter import DFlashDrafter
from dflash.models.kinds import DrafterKind


class DFlashKind(DrafterKind):
    network = DFlashDrafter


KIND = DFlashKind()
