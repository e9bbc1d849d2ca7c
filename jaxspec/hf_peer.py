"""The `hf` peer row: HF transformers greedy decoding on torch, same weights and prompts."""

from __future__ import annotations

import time

import numpy as np

from jaxspec.checkpoint import flatten_params
from jaxspec.config import LlamaConfig
from jaxspec.convert.keys import params_to_hf


class HFPeer:
    def __init__(self, cfg: LlamaConfig, params: dict):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch = torch
        flat = {k: np.asarray(v, np.float32) for k, v in flatten_params(params).items()}
        state = {k: torch.from_numpy(v.copy()) for k, v in params_to_hf(flat, cfg).items()}
        hf_config = AutoConfig.for_model(**cfg.to_hf_dict())  # the family's class
        self.model = AutoModelForCausalLM.from_config(hf_config).float().eval()
        missing, _ = self.model.load_state_dict(state, strict=False)
        if cfg.tie_embeddings:
            self.model.tie_weights()
        assert not [k for k in missing if k != "lm_head.weight"], missing
        self.eos = list(cfg.eos_token_ids)

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], int, float]:
        """-> (new token ids, steps, seconds)."""
        ids = self.torch.tensor([prompt_ids])
        start = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.eos[0],
            )
        seconds = time.perf_counter() - start
        new = out[0, len(prompt_ids) :].tolist()
        return new, len(new), seconds
