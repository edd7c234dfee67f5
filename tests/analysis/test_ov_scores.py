"""Copy suppression (McDougall et al. 2023) and successor (Gould et al. 2023) scores from a head's OV circuit
(storylens.effects.ov_scores): heads built by hand to copy, to suppress and to name the next item score what
their definitions say; the ordinal sequences break where a member is not one token; on the shipped model the
chunked computation equals the full ``[vocab, vocab]`` circuit formed whole."""

import torch

from storylens.effects.ov_scores import copy_suppression, ordinal_sequences, successor
from storylens.effects.weights import F64, HeadWeights, head_weights

V = 32  # tokens, and the width: the embedding is the identity, so the full OV circuit is W_V W_O itself


def _heads(*ovs: torch.Tensor) -> HeadWeights:
    """One block whose head ``h`` has ``W_V W_O = ovs[h]`` (``W_V`` the identity), ``W_E = W_U = I``."""
    eye = torch.eye(V, dtype=F64)
    n = len(ovs)
    return HeadWeights(
        W_Q=torch.zeros(1, n, V, V, dtype=F64), W_K=torch.zeros(1, n, V, V, dtype=F64),
        W_V=eye.expand(1, n, V, V).clone(), W_O=torch.stack(ovs)[None], W_E=eye, W_U=eye, W_pos=None, group=1,
        gram=eye, unembed_embed=eye,
    )  # fmt: skip


def test_built_heads_score_what_the_definitions_say():
    eye = torch.eye(V, dtype=F64)
    shift = torch.diag(torch.ones(V - 1, dtype=F64), 1)  # token t's row raises t + 1
    w = _heads(-eye, eye, shift, torch.zeros(V, V, dtype=F64))
    got = copy_suppression(w)[0]
    # suppressing: each token's own logit is the lowest of its row; copying: the highest; the successor head
    # leaves the token's own logit at 0 with V - 2 others (not among the 10 lowest: ties count against)
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]
    runs = [[0, 1, 2, 3, 4, 5], [10, 11, 12]]
    got = successor(w, runs)[0]
    # the successor head names the next member every time; the copying head never (it names the token itself);
    # all-equal logits pick the earliest member, the run's first: never a successor
    assert got[2].item() == 1.0 and got[1].item() == 0.0 and got[3].item() == 0.0
    assert successor(w, [[7]]).isnan().all()  # no run of two: no figure


def test_a_member_that_is_not_one_token_breaks_its_sequence():
    vocab = {" one": 1, " two": 2, " three": 3, " five": 5, " six": 6, " Monday": 9, "Tuesday": 10}

    def encode(text):
        return [vocab[text]] if text in vocab else [0, 0]

    got = ordinal_sequences(encode)
    assert got["number words"] == [[1, 2, 3], [5, 6]]  # " four" is two tokens: three and five are not neighbours
    assert "days" not in got and "letters" not in got  # no run of two, with or without the space


def test_on_the_shipped_model_the_chunks_equal_the_whole_circuit(shipped_model, monkeypatch):
    """The rows formed a few at a time (a chunk of 64 here) against every head's full ``[vocab, vocab]`` circuit
    formed whole, on a sample of tokens: the same float64 products, so the same ranks but where two entries of a
    row are within rounding of each other (none are, on this sample: checked)."""
    from storylens.effects import ov_scores
    from storylens.lm import NativeLM

    w = head_weights(NativeLM(shipped_model))
    tokens = torch.arange(0, w.W_E.shape[0], 37)
    monkeypatch.setattr(ov_scores, "CHUNK_BYTES", 64 * w.W_Q.shape[1] * w.W_U.shape[1] * 8)
    got = copy_suppression(w, tokens=tokens)
    ov = w.kv(w.W_V) @ w.W_O
    for layer in range(w.W_Q.shape[0]):
        full = w.W_E[tokens] @ ov[layer] @ w.W_U  # [head, tokens, vocab]
        own = full[:, torch.arange(len(tokens)), tokens]
        gap = (full - own[..., None]).abs().masked_fill(full == own[..., None], float("inf")).amin(-1)
        assert gap.min() > 1e-9  # no near-tie on this sample: the ranks cannot depend on rounding
        want = (((full <= own[..., None]).sum(-1) - 1) < 10).to(F64).mean(-1)
        assert torch.equal(got[layer], want)
    assert ((got >= 0) & (got <= 1)).all()
