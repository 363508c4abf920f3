"""Tools that drive whole runs: the batching-mode comparison and its report, the DeepSpeed config
tuner, the recipe comparison."""
