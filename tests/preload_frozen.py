"""Imported last by the tests' fork server (`tests.preloaded`): what it has imported goes to the
collector's permanent generation, so that a forked process's full collections (one at every run's
exit, `dflash.errors.end_process_group`: 0.5 s over the preloaded heap) pass over its own objects
only, and do not write to the server's pages."""
import gc

gc.freeze()
