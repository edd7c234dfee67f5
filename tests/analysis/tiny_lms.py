"""Tiny seeded transformers models of the families storylens reads, saved and loaded back through
storylens's own loader in float64 (the effects' tests), and the edit they are checked against: a
forward pre-hook on the output projection's input, written here from the architecture alone."""

import copy

import torch
import torch.nn.functional as F

from storylens.lm import NativeLM, load_lm
from storylens.lm.transformers_lm import _attention_of, _decoder_layers, _output_projection

KINDS = ("gpt2", "gpt_neo", "llama", "native")


def tiny_lm(kind: str, shipped_model, folder):
    """``kind`` of :data:`KINDS`: 2 blocks of 4 heads, width 32 (Llama: 2 key/value heads, grouped;
    GPT-Neo: a global block, then a local one of window 8), on the shipped tokenizer; or the shipped model."""
    if kind == "native":
        return NativeLM(copy.deepcopy(shipped_model).double())
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoConfig, LlamaConfig, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    marker = tok.bos_token_id
    common = {"vocab_size": shipped_model.tokenizer.get_vocab_size(), "bos_token_id": marker, "eos_token_id": marker}
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=128, **common)
    elif kind == "gpt_neo":
        cfg = GPTNeoConfig(
            num_layers=2, num_heads=4, hidden_size=32, max_position_embeddings=128,
            attention_types=[[["global", "local"], 1]], window_size=8, **common,
        )  # fmt: skip
    else:
        cfg = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, **common,
        )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_lm(folder, dtype=torch.float64)


def projection(lm, layer):
    """Block ``layer``'s output projection and the head size."""
    if isinstance(lm, NativeLM):
        return lm.module.transformer.h[layer].attn.c_proj, lm.module.config.head_size
    proj = _output_projection(_attention_of(_decoder_layers(lm.module)[layer]))
    return proj, lm.head_output_weights(layer).shape[1]


def head_inputs(lm, story, layer, head):
    """``[len, d]``: what head ``head`` of block ``layer`` hands its output projection on ``story``."""
    proj, d = projection(lm, layer)
    seen = {}

    def pre(module, args):
        seen["x"] = args[0][0, :, head * d : (head + 1) * d].clone()

    handle = proj.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            lm.forward(torch.tensor([story]))
    finally:
        handle.remove()
    return seen["x"]


def loss_change(lm, story, layer, head, value):
    """(the change in ``story``'s summed next-token loss, its predicted tokens) with head ``head``'s slice of
    block ``layer``'s output projection input replaced after position 0 by ``value`` (None: zero; ``[d]``
    or ``[len - 1, d]``), one story alone, by a pre-hook."""
    proj, d = projection(lm, layer)
    sl = slice(head * d, (head + 1) * d)

    def pre(module, args):
        x = args[0].clone()
        x[:, 1:, sl] = 0.0 if value is None else value
        return (x, *args[1:])

    x = torch.tensor([story])
    with torch.no_grad():
        clean = F.cross_entropy(lm.forward(x)[0, :-1], x[0, 1:], reduction="sum")
        handle = proj.register_forward_pre_hook(pre)
        try:
            off = F.cross_entropy(lm.forward(x)[0, :-1], x[0, 1:], reduction="sum")
        finally:
            handle.remove()
    return float(off - clean), len(story) - 1


def loss_off(lm, story, heads):
    """``story``'s summed next-token loss with ``heads`` (``(layer, head)`` pairs) zeroed after position 0 at
    their output projection's input, by pre-hooks written here (none: the plain loss)."""
    handles = []
    for layer, head in heads:
        proj, d = projection(lm, layer)

        def pre(module, args, sl=slice(head * d, (head + 1) * d)):
            x = args[0].clone()
            x[:, 1:, sl] = 0.0
            return (x, *args[1:])

        handles.append(proj.register_forward_pre_hook(pre))
    x = torch.tensor([story])
    try:
        with torch.no_grad():
            return float(F.cross_entropy(lm.forward(x)[0, :-1], x[0, 1:], reduction="sum"))
    finally:
        for h in handles:
            h.remove()
