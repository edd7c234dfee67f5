"""Fixtures the circuits' tests share: each tiny seeded model of tiny_lms.KINDS (float64) and three pairs of the
name task encoded for it."""

import pytest
from tiny_lms import KINDS, tiny_lm


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, shipped_model, tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_lm(request.param, shipped_model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def task_pairs(tiny):
    from storylens.effects.patching import NAME_PAIRS, encode_pairs, read_pairs

    return encode_pairs(tiny, read_pairs(NAME_PAIRS)[:3], NAME_PAIRS.name)


@pytest.fixture
def float64_rms(monkeypatch):
    """transformers' LlamaRMSNorm in its input's dtype (it casts to float32 first, whatever the model's), for tests
    that compare storylens's own pullback through a norm with autograd's through the model in float64."""
    import torch
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
