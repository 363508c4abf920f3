"""Which target layers the drafter reads: the official tap rule and the taps a target can give."""
from __future__ import annotations

DEFAULT_NUM_TARGET_FEATURES = 5


def default_target_layer_ids(num_target_layers: int, num_features: int = DEFAULT_NUM_TARGET_FEATURES) -> list[int]:
    """Official tap rule: spread from the 2nd layer to the 3rd-from-last.

    layer_i = round(1 + i*(L-4)/(K-1)); a single tap is L//2. Qwen3-8B (L=36, K=5) -> [1, 9, 17, 25, 33].
    Python's round() halves to even, which is also what the official helper gets from round().
    """
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"the default tap rule needs at least 4 target layers, got {num_target_layers}")
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_features - 1))) for i in range(num_features)]


def check_target_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Refuse taps that Hugging Face would report after the final norm, or that do not exist.

    `hidden_states[L]` of a Hugging Face forward is the final-normed output, not the residual
    stream, so the last layer (id L-1) cannot be tapped consistently with serving engines.
    """
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids:
        raise ValueError("target_layer_ids is empty")
    for i in layer_ids:
        if i < 0 or i >= num_target_layers - 1:
            raise ValueError(
                f"target layer id {i} is out of range: the target has {num_target_layers} layers and "
                f"ids must lie in [0, {num_target_layers - 2}] (hidden_states[L] of a Hugging Face "
                f"forward is the final-normed output, so layer {num_target_layers - 1} cannot be tapped)"
            )
    return layer_ids
