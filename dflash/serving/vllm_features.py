"""The target's tapped features computed by vLLM's offline engine (`capture_features.py --engine vllm`):
the same feature store as the Hugging Face capture (`dflash.features`), the states the engine serves with.

vLLM 0.32's own route: the `extract_hidden_states` speculative method, which has the target return the
inputs of the layers in `eagle_aux_hidden_state_layer_ids` (DFlash's tap of layer i is layer i + 1's
input) and caches them, per prompt token, in a hidden-state KV cache group; its
`ExampleHiddenStatesConnector` copies a finished request's rows out of that cache and writes them to a
file. On the CPU that write fails (`example_hidden_states_connector.py:402`, `torch.empty_like(...,
pin_memory=True)`: "pin_memory=True requires a CUDA or other accelerator backend"), and it runs one
engine step after the request finished, a step `LLM.generate` no longer takes. `HiddenStatesCapture`
(loaded by vLLM through `kv_connector_module_path`) keeps the connector's bookkeeping and takes the rows
into memory instead; `FeatureEngine` takes the step. Both need the engine in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what `cpu_environment` sets).

The final states (the store's `states.bin`) are the last layer's output (tapped as layer N, the output
of the last of N layers) through the engine's own final norm module.
"""
from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from dflash.errors import UserError
from dflash.serving.vllm import VLLMEngine, cpu_environment


class _Copied:
    """A copy already done (the connector polls its copies' CUDA events)."""

    @staticmethod
    def query() -> bool:
        return True


class HiddenStatesCapture(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector with its disk write (pinned memory, a CUDA stream) replaced by a
    copy into `captured`: hidden-states path (the request's `kv_transfer_params`) -> (tokens, layers, H)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captured: dict[str, torch.Tensor] = {}

    def _submit_async_write(self, pending) -> None:
        block = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(block)[None] + blocks[:, None] * block).flatten().to(self._kv_cache.device)
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        self.captured[pending.filename] = rows.to("cpu", copy=True)
        self._req_copy_events[pending.req_id] = _Copied()


class FeatureEngine(VLLMEngine):
    """The target alone in vLLM's offline engine, giving the tapped features and final states of prompts."""

    def __init__(self, target_folder, target_layer_ids, num_layers: int, *, max_model_len: int,
                 dtype: str = "float32", seed: int = 0, threads: int = 1):
        """target_layer_ids: DFlash's taps (layer outputs, 0-based); num_layers: the target's;
        max_model_len: the longest prompt + 1 (the one token each request generates)."""
        import os

        cpu_environment()
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise UserError("--engine vllm: the engine must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        set_threads = torch.set_num_threads
        set_threads(threads)
        from vllm import LLM

        # vLLM collects the inputs of these layers (sorted, once each): tap i is layer i + 1's input,
        # and layer N's "input" is the last layer's output
        self.layers = sorted({i + 1 for i in target_layer_ids} | {num_layers})
        self.columns = [self.layers.index(i + 1) for i in target_layer_ids]
        self.spec_config = None
        try:
            self.llm = LLM(
                model=str(target_folder), dtype=dtype, seed=seed, max_model_len=max_model_len,
                enforce_eager=not torch.cuda.is_available(),
                # every prompt token computed, none read from another request's cached blocks
                enable_prefix_caching=False,
                speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {
                                        "eagle_aux_hidden_state_layer_ids": self.layers}}},
                kv_transfer_config={"kv_connector": HiddenStatesCapture.__name__,
                                    "kv_connector_module_path": __name__, "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"use_synchronization_lock": False}},
            )
        except ValueError as e:
            raise UserError(f"--engine vllm: vLLM does not run {target_folder}: {e}") from None
        finally:
            # The CPU worker replaces torch.set_num_threads with a no-op for the whole process.
            torch.set_num_threads = set_threads
        model = self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model()
        model = model.get_language_model() if hasattr(model, "get_language_model") else model
        try:
            self.norm, self.embed, self.lm_head = model.model.norm, model.model.embed_tokens, model.lm_head
        except AttributeError as e:
            raise UserError(f"--engine vllm: {type(model).__name__} of {target_folder} keeps no final norm, "
                            f"embedding or lm_head where dflash reads them ({e})") from None

    def shared_weights(self, vocab_size: int):
        """The embedding and lm_head (vLLM pads their rows to a multiple of 64: cut to `vocab_size`)."""
        from dflash.target.model import SharedWeights

        embed = self.embed.weight[:vocab_size]
        lm_head = embed if self.lm_head is self.embed else self.lm_head.weight[:vocab_size]
        return SharedWeights(embed=embed, lm_head=lm_head)

    @torch.no_grad()
    def features(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        """The tapped features (tokens, K*H) and final states (tokens, H) of the prompts' tokens, in
        packed order, on the CPU: each prompt prefilled, one token generated."""
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        params = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params, use_tqdm=False)
        core = self.llm.llm_engine.engine_core.engine_core
        while core.scheduler.has_requests():  # the connector takes a finished request's rows a step later
            core.step()
        captured = get_kv_transfer_group().captured
        rows = torch.cat([captured.pop(out.kv_transfer_params["hidden_states_path"]) for out in outs])
        features = rows[:, self.columns].flatten(1)
        last = rows[:, -1].to(self.embed.weight.device)  # layer N, the last of self.layers
        return features, self.norm(last).cpu()

