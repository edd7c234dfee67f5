"""Sinks and dormant heads on a hand-built transformers Llama (grouped key/value heads): head A's
queries and keys are arranged so that it attends only to position 0, head B's so that it attends to
the previous token. A writes one vector everywhere: it is a sink, its context share is 0 and it is
dormant, and switching it to its mean changes nothing; B is none of these. Every sink column also
equals the plain computation from transformers' own attention (tests/sink_reference.py), and one
process equals a resumed, merged run."""

import copy
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from storylens.analysis import score_heads
from storylens.core.heads import Head
from storylens.effects.ablation import ablate_heads, head_output_means
from storylens.lm import load_lm
from storylens.looking.sinks import SinkAccumulator
from storylens.table.accumulator import HeadScoreAccumulator

D_MODEL, N_HEAD, N_KV, D_HEAD = 32, 4, 2, 8
C, S, N = 0, 1, 2  # embedding dims: constant 1 for every token; 1 on the opening token only; 1 on the others
SINK, PREV = Head(0, 0), Head(0, 2)  # head A (key/value group 0) and head B (group 1)
STORIES = 8  # short stories: the previous-token head's rotary angle (0.1 a position) must not wrap (63)


def _hand_built(vocab: int, bos: int):
    """A one-block Llama whose head A reads the opening-token feature as its key (a key only position
    0 has: every query's score there is ~800, elsewhere 0) through the rotary pair of lowest frequency
    (0.001 rad a position: cos stays above 0.99), and whose head B compares the constant feature
    through the pair of frequency 0.1 with its key turned by one position's angle, so its score peaks
    at the previous token (by ~40 over the next best). Values read only the tokens' own small random
    features, so what B copies depends on the story."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=D_MODEL,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV,
        max_position_embeddings=64,
        vocab_size=vocab,
        rope_theta=1e4,  # inverse frequencies of the 4 rotary pairs of a head of 8: 1, 0.1, 0.01, 0.001
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
        emb[:, C], emb[:, S], emb[:, N] = 1.0, 0.0, 1.0
        emb[bos, S], emb[bos, N] = 1.0, 0.0  # every token has the same norm: the constant feature is alike
        for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight):
            p.zero_()
        a.v_proj.weight[:, 3:] = torch.randn(N_KV * D_HEAD, D_MODEL - 3) * 40  # values: the tokens' own features
        a.q_proj.weight[SINK.head * D_HEAD + 3, C] = 10.0  # pair 3 (dims 3, 7): frequency 0.001
        a.k_proj.weight[0 * D_HEAD + 3, S] = 10.0  # group 0: only the opening token has this key
        angle = 0.1  # pair 1 (dims 1, 5): frequency 0.1; B's key turned by one position's angle
        a.q_proj.weight[PREV.head * D_HEAD + 1, C] = 40.0
        a.k_proj.weight[1 * D_HEAD + 1, C] = 40.0 * math.cos(angle)
        a.k_proj.weight[1 * D_HEAD + 5, C] = 40.0 * math.sin(angle)
    return model


@pytest.fixture(scope="module")
def sink_folder(shipped_model, tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=shipped_model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    model = _hand_built(shipped_model.tokenizer.get_vocab_size(), tok.bos_token_id)
    folder = tmp_path_factory.mktemp("sink-llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stories(corpus_split):
    return [" ".join(s.split()[:30]) for s in corpus_split.quiz[:STORIES]]  # under 63 tokens each


@pytest.fixture(scope="module")
def scored(sink_folder, stories):
    lm = load_lm(sink_folder, dtype=torch.float64)
    return lm, score_heads(lm, stories, batch_size=3, progress=False)


def test_the_hand_built_heads_do_what_they_were_built_to(scored):
    _, got = scored
    sink, prev = got.at(SINK), got.at(PREV)
    assert sink.first_mass == 1.0 and prev.prev_token > 0.99


def test_a_sink_is_flagged_and_a_previous_token_head_is_not(scored):
    _, got = scored
    sink, prev = got.at(SINK), got.at(PREV)
    assert sink.sink_rate == 1.0 and prev.sink_rate == 0.0
    # every output of A is the opening token's value, bit for bit: the shifted sums are exactly 0
    assert sink.context_share == 0.0 and sink.context_norm == 0.0 and sink.active_rate == 0.0
    assert sink.first_value_ratio > 0 and sink.output_norm > 0  # it writes something: the same thing everywhere
    assert prev.context_share > 0.5 and prev.active_rate == 1.0
    assert sink.dormant is True and prev.dormant is False


def test_the_sink_s_mean_ablation_changes_nothing(scored, stories):
    lm, got = scored
    ids = [lm.encode(s) for s in stories]
    means = head_output_means(lm, ids, include_marker=False)
    x = torch.tensor([ids[0]])
    with torch.no_grad():
        clean = lm.module(x).logits
        with ablate_heads(lm, [SINK], "mean", means):
            sink_off = lm.module(x).logits
        with ablate_heads(lm, [PREV], "mean", means):
            prev_off = lm.module(x).logits
    # float64: the mean of N copies of one vector is that vector to within N ulps; a logit moves by that
    # times the weights it passes (here under 1e3): far under 1e-9
    assert (sink_off - clean).abs().max() <= 1e-9
    assert (prev_off - clean).abs().max() > 1e-3  # B's mean ablation moves the logits


def test_every_sink_column_equals_transformers_own_attention(scored, stories):
    """The plain float64 computation (tests/sink_reference.py) from output_attentions and the modules'
    own value and output projections."""
    from sink_reference import assert_sink_columns

    lm, got = scored
    model = lm.module
    attn = model.model.layers[0].self_attn
    seen = []
    for text in stories:
        ids = lm.encode(text)
        hidden = {}
        handle = attn.register_forward_pre_hook(
            lambda m, args, kwargs, seen=hidden: seen.__setitem__(0, kwargs["hidden_states"][0]), with_kwargs=True
        )
        try:
            with torch.no_grad():
                a = model(torch.tensor([ids]), output_attentions=True).attentions[0][0]
        finally:
            handle.remove()
        with torch.no_grad():
            v = attn.v_proj(hidden[0]).view(-1, N_KV, D_HEAD)
            w_o = attn.o_proj.weight.T.reshape(N_HEAD, D_HEAD, D_MODEL)
            f = torch.stack([v[:, h // (N_HEAD // N_KV)] @ w_o[h] for h in range(N_HEAD)])  # [head, key, d_model]
        seen.append(([a], [f]))
    assert assert_sink_columns(got, seen) == 5 * N_HEAD


def test_a_resumed_merged_run_equals_one_process(scored, stories):
    """Two accumulators over halves of the stories, one of them through its JSON state (a checkpoint
    or a Ray worker's result), merged: every column as one process's (their shifts differ)."""
    lm, whole = scored
    ids_first = score_heads(lm, stories[:3], batch_size=3, progress=False)
    assert ids_first.at(SINK).context_share == 0.0
    from storylens.engine.record import record

    accs = []
    for part in (stories[:3], stories[3:]):
        acc = HeadScoreAccumulator(lm.n_layer, lm.n_head)
        record(lm, part, [acc], batch_size=3, progress=False)
        accs.append(acc)
    back = HeadScoreAccumulator(lm.n_layer, lm.n_head).load_state(json.loads(json.dumps(accs[1].state())))
    merged = accs[0].merge(back).columns(False)
    for name in ("sink_rate", "first_value_ratio", "context_share", "context_norm", "active_rate"):
        for head in Head.every(lm.n_layer, lm.n_head):
            want, have = whole.at(head)[name], float(merged[name][head])
            assert abs(have - want) <= 1e-9 * max(1.0, abs(want)), (name, head.label)


def test_bad_sink_states_are_refused():
    acc = SinkAccumulator(2, 3)
    state = acc.state()
    for key, bad in [("positions", -1), ("square", [[-1.0] * 3] * 2), ("thresholds", [0.5, 0.1])]:
        broken = copy.deepcopy(state)
        broken[key] = bad
        with pytest.raises(ValueError):
            SinkAccumulator(2, 3).load_state(broken)


@pytest.mark.parametrize("how", ["every head a sink: a constant", "an output projection of zeros: nothing"])
def test_a_block_whose_every_head_writes_a_constant_or_nothing_flags_them_all(sink_folder, stories, tmp_path, how):
    """Issue 61, class 6: the flag's block-relative threshold cannot fire where every head of the block is alike;
    its absolute floor (a context share at most DORMANT_FLOOR) does. The hand-built block with every query head
    turned into A (all attention on position 0, so each writes one vector everywhere), or with its output
    projection zeroed (each writes nothing): every head is flagged, and the flag says nothing of the sink head
    alone any more than of the rest."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(sink_folder, torch_dtype=torch.float64)
    a = model.model.layers[0].self_attn
    with torch.no_grad():
        if how.startswith("every"):
            a.q_proj.weight.zero_()
            a.k_proj.weight.zero_()
            for h in range(N_HEAD):
                a.q_proj.weight[h * D_HEAD + 3, C] = 10.0
            for g in range(N_KV):
                a.k_proj.weight[g * D_HEAD + 3, S] = 10.0
        else:
            a.o_proj.weight.zero_()
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (sink_folder / f).exists():
            (tmp_path / "m" / f).write_bytes((sink_folder / f).read_bytes())
    got = score_heads(load_lm(tmp_path / "m", dtype=torch.float64), stories, batch_size=3, progress=False)
    assert [h.dormant for h in got.heads] == [True] * N_HEAD
    assert all(h.context_share <= 1e-10 for h in got.heads)
    if how.startswith("every"):
        assert all(h.first_mass > 0.999 for h in got.heads)
