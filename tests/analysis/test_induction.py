"""The induction test on repeated random tokens (``induction_random``) on a hand-built transformers
Llama: head I's rotary key is turned by ``length - 1`` positions' angle, so each query looks exactly
``length - 1`` tokens back, where the test's induction key is (the token after the query's token in the
first copy); head P looks at the previous token. The column must find I at 1 and P at 0, on the right
diagonal, the same on every call, and reach the head table of ``score_heads`` and ``storylens score``."""

import json
import math
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.analysis import score_heads
from storylens.core.heads import Head
from storylens.lm import load_lm
from storylens.looking.detectors import BUILTIN_COLUMNS, INDUCTION_LENGTH, INDUCTION_RANDOM, MORE, OVERVIEW
from storylens.looking.induction import induction_random, lm_sequences, special_ids, stripe_scores

D_MODEL, N_HEAD, N_KV, D_HEAD = 32, 4, 2, 8
WINDOW = 64  # the test's length: min(INDUCTION_LENGTH, (64 - 1) // 2) = 31
LENGTH = min(INDUCTION_LENGTH, (WINDOW - 1) // 2)
FREQ = 0.1  # rotary pair 1 (dims 1, 5) of a head of 8 with rope_theta 1e4; wraps after 2 pi / 0.1 = 62.8 positions
IND, PREV = Head(0, 0), Head(0, 2)  # key/value groups 0 and 1; heads 1 and 3 have no query (an even spread)


def _hand_built(vocab: int, bos: int):
    """One block; every token's embedding is a constant feature (dim 0) plus small noise, so a query
    and a key built from it score ``cos(FREQ * (q - k) - angle)`` times a large gain: one-hot on
    ``q - k = angle / FREQ`` (the next offsets lose ~90 nats)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=D_MODEL,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV,
        max_position_embeddings=WINDOW,
        vocab_size=vocab,
        rope_theta=1e4,
        bos_token_id=bos,
        eos_token_id=bos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double()
    a = model.model.layers[0].self_attn
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 0.003)
        emb[:, 0] = 1.0
        for p in (a.q_proj.weight, a.k_proj.weight):
            p.zero_()
        for head, offset in ((IND, LENGTH - 1), (PREV, 1)):
            group, angle = head.head // (N_HEAD // N_KV), FREQ * offset
            a.q_proj.weight[head.head * D_HEAD + 1, 0] = 40.0
            a.k_proj.weight[group * D_HEAD + 1, 0] = 40.0 * math.cos(angle)
            a.k_proj.weight[group * D_HEAD + 5, 0] = 40.0 * math.sin(angle)
    return model


@pytest.fixture(scope="module")
def folder(shipped_model, tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    out = tmp_path_factory.mktemp("induction-llama")
    _hand_built(shipped_model.tokenizer.get_vocab_size(), tok.bos_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lm(folder):
    return load_lm(folder, dtype=torch.float64)


def test_the_induction_head_scores_one_and_the_previous_token_head_zero(lm):
    got = induction_random(lm)
    assert got is not None and got.shape == (1, N_HEAD) and got.dtype == torch.float64
    assert got[IND] > 0.99 and got[PREV] < 0.01
    # the even-spread heads: 1 / (q + 1) at each second-copy query q = L + 1 .. 2L, averaged. Equal
    # scores give an even softmax up to a few float64 roundings; 1e-6 covers the float32 stage of
    # LlamaRMSNorm inside this float64 model (2^-24, about 6e-8 relative) some 16 times over
    even = sum(1 / (q + 1) for q in range(LENGTH + 1, 2 * LENGTH + 1)) / LENGTH
    assert got[0, 1].item() == pytest.approx(even, rel=1e-6) and got[0, 3].item() == pytest.approx(even, rel=1e-6)


def test_the_sequences_are_seeded_ordinary_tokens_repeated(lm):
    ids = lm_sequences(lm)
    assert ids is not None and ids.shape == (4, 1 + 2 * LENGTH)
    assert (ids[:, 0] == lm.marker_id).all() and torch.equal(ids[:, 1 : 1 + LENGTH], ids[:, 1 + LENGTH :])
    assert not set(ids[:, 1:].flatten().tolist()) & set(special_ids(lm))
    assert torch.equal(ids, lm_sequences(lm)) and not torch.equal(ids, lm_sequences(lm, seed=1))
    assert torch.equal(induction_random(lm), induction_random(lm))  # the same model, the same bits


def test_the_stripe_is_the_diagonal_after_the_first_copy():
    """Hand-made maps: one-hot on key q - L + 1 gives 1, on q - L (the same token) or q - 1 gives 0."""
    L = 5
    T = 1 + 2 * L
    q = torch.arange(T)
    maps = [torch.zeros(2, 3, T, T) for _ in range(3)]
    for m, offset in zip(maps, (L - 1, L, 1)):
        k = (q - offset).clamp(min=0)
        m[:, :, q, k] = 1.0
    got = stripe_scores(maps, L)
    assert got.shape == (3, 3) and got[0].eq(1).all() and got[1:].eq(0).all()


def test_the_column_is_declared_and_reaches_the_table(lm):
    assert INDUCTION_RANDOM in BUILTIN_COLUMNS and {OVERVIEW, MORE} <= INDUCTION_RANDOM.shown
    scores = score_heads(lm, ["Once upon a time Tom saw Tom.", "Lily ran. Lily sat."], progress=False)
    column = scores.column("induction_random")
    assert column == induction_random(lm).flatten().tolist()  # the stories do not enter it
    assert "induction_random" in scores.shown(OVERVIEW) and scores.title("induction_random")


def test_storylens_score_writes_it(folder, tmp_path, corpus_split):
    import subprocess

    stories = tmp_path / "s.txt"
    stories.write_text("".join(f"{' '.join(s.split()[:30])}\n<|endoftext|>\n" for s in corpus_split.quiz[:4]))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "storylens", "score", "--no-progress", "--model", str(folder)]
    r = subprocess.run([*cmd, "--stories", str(stories), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {h["label"]: h for h in json.loads((out / "heads.json").read_text())["heads"]}
    assert rows["L1H1"]["induction_random"] > 0.99 and rows["L1H3"]["induction_random"] < 0.01
    assert "induction_random" in (out / "heads.csv").read_text().splitlines()[0].split(",")
