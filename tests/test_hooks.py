"""The named hook points (TransformerLens's names and shapes) on the native model and transformers'
GPT-2, GPT-Neo, GPT-NeoX and Llama (grouped key/value heads): each fires once per block per forward with
its shape, attaching them changes nothing, and an edit through one equals the same edit made by a torch
hook written here on the model's own module (so a hook that fired after the output projection, or
never, would fail)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.core.errors import StorylensError
from storylens.lm import NativeLM, load_lm
from storylens.lm.transformers_lm import _attention_of, _decoder_layers

KINDS = ("hook_resid_pre", "hook_q", "hook_k", "hook_v", "hook_z", "hook_attn_out", "hook_mlp_out", "hook_resid_post")
D, H = 32, 4


def _name(layer: int, kind: str) -> str:
    return f"blocks.{layer}.{'attn.' if kind in ('hook_q', 'hook_k', 'hook_v', 'hook_z') else ''}{kind}"


@pytest.fixture(scope="module", params=["gpt2", "gpt_neo", "gpt_neox", "llama"])
def tiny(request, shipped_model, tmp_path_factory):
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPTNeoConfig,
        GPTNeoXConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    vocab, b = shipped_model.tokenizer.get_vocab_size(), tok.bos_token_id
    common = {"vocab_size": vocab, "bos_token_id": b, "eos_token_id": b}
    cfg = {
        "gpt2": lambda: GPT2Config(n_layer=2, n_head=H, n_embd=D, n_positions=64, **common),
        "gpt_neo": lambda: GPTNeoConfig(
            num_layers=2,
            num_heads=H,
            hidden_size=D,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            **common,
        ),  # fmt: skip
        "gpt_neox": lambda: GPTNeoXConfig(
            num_hidden_layers=2,
            num_attention_heads=H,
            hidden_size=D,
            intermediate_size=64,
            max_position_embeddings=64,
            **common,
        ),  # fmt: skip
        "llama": lambda: LlamaConfig(
            hidden_size=D,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        ),  # fmt: skip
    }[request.param]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_lm(folder, dtype=torch.float64)


@pytest.fixture(scope="module")
def native(shipped_model):
    import copy

    return NativeLM(copy.deepcopy(shipped_model).double())


def _ids(lm):
    return torch.tensor([lm.encode("Once upon a time, Lily and Tom went to the park. Tom gave a ball to Lily.")])


def _logits(lm, ids):
    with torch.no_grad():
        return lm.forward(ids)


@pytest.mark.parametrize("which", ["native", "tiny"])
def test_every_hook_fires_once_per_block_with_its_shape_and_changes_nothing(which, native, tiny):
    lm = native if which == "native" else tiny
    ids = _ids(lm)
    T = ids.shape[1]
    d_model = lm.head_output_weights(0).shape[-1]
    d = lm.head_output_weights(0).shape[1]
    kv = getattr(lm, "n_kv_head", lm.n_head)
    want = {
        "hook_resid_pre": (1, T, d_model), "hook_q": (1, T, lm.n_head, d), "hook_k": (1, T, kv, d),
        "hook_v": (1, T, kv, d), "hook_z": (1, T, lm.n_head, d), "hook_attn_out": (1, T, d_model),
        "hook_mlp_out": (1, T, d_model), "hook_resid_post": (1, T, d_model),
    }  # fmt: skip
    names = lm.hook_names()
    assert all(_name(layer, k) in names for layer in range(lm.n_layer) for k in KINDS)
    seen: list[tuple[str, tuple]] = []
    before = _logits(lm, ids)
    # every hook point but hook_pattern (reading the probabilities moves a transformers model off its fused
    # kernel, so its rounding may differ): the logits are the same bits
    keep = [(n, lambda x, hook: seen.append((hook.name, tuple(x.shape)))) for n in names if "pattern" not in n]
    with lm.hooks(keep):
        during = _logits(lm, ids)
        with torch.no_grad(), lm.hooks([(n, lambda x, hook: seen.append((hook.name, ())))
                                        for n in names if "pattern" in n]):  # fmt: skip
            lm.forward(ids, record_attention=True)  # the explicit path fires them too
    assert torch.equal(before, during)
    fired = [n for n, _ in seen]
    for layer in range(lm.n_layer):
        for k in KINDS:
            assert fired.count(_name(layer, k)) == 2, _name(layer, k)  # once in each of the two passes
            assert dict(seen)[_name(layer, k)] == want[k], _name(layer, k)
        assert fired.count(f"blocks.{layer}.attn.hook_pattern") == 1


def _reference(lm, kind: str, layer: int, edit):
    """The same edit as storylens's hook point ``kind``, made by a torch hook written here on the model's
    own module, per family: a handle to remove."""
    if isinstance(lm, NativeLM):
        block = lm.module.transformer.h[layer]
        n, d = lm.n_head, lm.module.config.head_size
        mods = {"hook_q": block.attn.query, "hook_k": block.attn.key, "hook_v": block.attn.value}
        if kind in mods:
            return mods[kind].register_forward_hook(
                lambda m, a, out: edit(out.view(*out.shape[:2], n, d)).reshape(out.shape)
            )
        if kind == "hook_attn_out":
            return block.attn.c_proj.register_forward_hook(lambda m, a, out: edit(out))
        if kind == "hook_mlp_out":
            return block.mlp.register_forward_hook(lambda m, a, out: edit(out))
    else:
        layer_mod = _decoder_layers(lm.module)[layer]
        attn = _attention_of(layer_mod)
        inner = getattr(attn, "attention", attn)
        cfg = lm.module.config
        d = D // H
        if kind in ("hook_q", "hook_k", "hook_v"):
            part = kind[-1]
            own = getattr(inner, f"{part}_proj", None)
            if own is not None:
                n = H if part == "q" else getattr(cfg, "num_key_value_heads", H)
                return own.register_forward_hook(
                    lambda m, a, out: edit(out.view(*out.shape[:2], n, d)).reshape(out.shape)
                )
            i = "qkv".index(part)
            if hasattr(inner, "c_attn"):  # GPT-2: q | k | v

                def gpt2(m, a, out):
                    pieces = list(out.split(D, -1))
                    pieces[i] = edit(pieces[i].reshape(*out.shape[:2], H, d)).reshape(*out.shape[:2], D)
                    return torch.cat(pieces, -1)

                return inner.c_attn.register_forward_hook(gpt2)

            def neox(m, a, out):  # per head q, k, v
                per = out.view(*out.shape[:2], H, 3, d).clone()
                per[..., i, :] = edit(per[..., i, :])
                return per.reshape(out.shape)

            return inner.query_key_value.register_forward_hook(neox)
        if kind == "hook_attn_out":
            proj = next(getattr(inner, a) for a in ("o_proj", "c_proj", "out_proj", "dense") if hasattr(inner, a))
            return proj.register_forward_hook(lambda m, a, out: edit(out))
        if kind == "hook_mlp_out":
            return layer_mod.mlp.register_forward_hook(lambda m, a, out: edit(out))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["hook_q", "hook_k", "hook_v", "hook_attn_out", "hook_mlp_out"])
@pytest.mark.parametrize("which", ["native", "tiny"])
def test_an_edit_through_a_hook_point_is_the_edit_on_the_module(which, kind, native, tiny):
    lm = native if which == "native" else tiny
    ids = _ids(lm)
    layer = lm.n_layer - 1 if kind in ("hook_attn_out", "hook_mlp_out") else 0

    def edit(x):  # scale the first head (or the first features) of the first token on: not a no-op
        x = x.clone()
        x[:, 1:, 0] = x[:, 1:, 0] * 1.5 + 0.25
        return x

    clean = _logits(lm, ids)
    with lm.hooks([(_name(layer, kind), lambda x, hook: edit(x))]):
        ours = _logits(lm, ids)
    handle = _reference(lm, kind, layer, edit)
    try:
        theirs = _logits(lm, ids)
    finally:
        handle.remove()
    assert (ours - clean).abs().max() > 1e-6  # the edit moves the logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)  # float64: the same computation


@pytest.mark.parametrize("which", ["native", "tiny"])
def test_the_residual_hooks_are_the_block_s_input_and_output(which, native, tiny):
    """hook_resid_post of block l is hook_resid_pre of block l + 1; a shift added to resid_pre of the
    last block moves the logits as adding it to resid_post of the block before does."""
    lm = native if which == "native" else tiny
    ids = _ids(lm)
    kept = {}
    with lm.hooks(
        [
            ("blocks.0.hook_resid_post", lambda x, hook: kept.__setitem__("post", x.clone())),
            ("blocks.1.hook_resid_pre", lambda x, hook: kept.__setitem__("pre", x.clone())),
        ]
    ):
        _logits(lm, ids)
    assert torch.equal(kept["post"], kept["pre"])
    shift = torch.linspace(-1, 1, kept["pre"].shape[-1], dtype=kept["pre"].dtype)
    with lm.hooks([("blocks.1.hook_resid_pre", lambda x, hook: x + shift)]):
        a = _logits(lm, ids)
    with lm.hooks([("blocks.0.hook_resid_post", lambda x, hook: x + shift)]):
        b = _logits(lm, ids)
    assert torch.equal(a, b) and (a - _logits(lm, ids)).abs().max() > 1e-6


def test_a_bad_hook_name_names_the_ones_there_are(tiny):
    for bad in ("blocks.0.attn.hook_resid_pre", "blocks.9.hook_q", "blocks.0.hook_x", "hook_z"):
        with pytest.raises(StorylensError, match="hook_resid_pre") as e:
            tiny.add_hook(bad, lambda x, hook: None)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("which", ["native", "tiny"])
def test_the_logits_at_one_position_a_row_are_the_whole_run_s_there(which, native, tiny, monkeypatch):
    """``forward(ids, logits=at)`` is row ``i``'s logits at position ``at[i]`` ``[batch, 1, vocab]``: equal, in
    float64, to the whole run's there with the same hook on the last block's output, the output head run at the
    positions asked for alone; a model that does not take transformers' ``logits_to_keep`` gives the same from
    every position's logits."""
    lm = native if which == "native" else tiny
    ids = _ids(lm).repeat(3, 1)
    at = torch.tensor([ids.shape[1] - 1, 3, ids.shape[1] - 1])
    shift = torch.linspace(-1, 1, lm.head_output_weights(0).shape[-1], dtype=torch.float64)
    last = f"blocks.{lm.n_layer - 1}.hook_resid_post"
    head = lm.module.lm_head if which == "native" else lm.module.get_output_embeddings()
    rows: list[int] = []
    handle = head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    try:
        with lm.hooks([(last, lambda x, hook: x + shift)]), torch.no_grad():
            whole = lm.forward(ids)
            got = lm.forward(ids, logits=at)
            assert rows == [ids.numel(), 3 if which == "native" else 2 * 3]  # two distinct positions, every row
            if which == "tiny":
                monkeypatch.setattr(lm, "_keeps", False)
                every = lm.forward(ids, logits=at)
    finally:
        handle.remove()
    want = whole[torch.arange(3), at][:, None]
    assert got.shape == (3, 1, whole.shape[-1])
    # the same dot products over fewer rows, perhaps blocked otherwise: float64 rounding ~1e-14 on logits of order 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.equal(got[0], got[1])  # two positions, not one
    if which == "tiny":
        assert torch.equal(every, want)
