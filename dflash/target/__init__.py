"""The target room: the frozen model the drafter learns from. `spec` (TargetSpec: a folder, a preset or
random:..., its config and fingerprint, before any weight loads), `model` (TargetModel: the tapped
features, the shared embedding and lm_head), `taps` (which layers are tapped), `random_weights`
(random:... targets), `load` (tokenizer, model and mask token, loaded to train or to decode)."""
