"""Tools that drive whole runs: the batching-mode comparison and its report, the DeepSpeed config
tuner, the recipe comparison; and the programs of the `launch/` scripts of the same name (benchmarks,
checks, measurements, the demo's builder), each `launch/NAME.py` a shim over `dflash.tools.NAME.main`."""
