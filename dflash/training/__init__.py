"""Training: config, step planning and loading, checkpoints, metrics, and the DeepSpeed loop."""
