"""Corpus reading and the quiz split, on the real corpus and on broken files."""

import gzip

import pytest

from storylens.core.errors import StorylensError
from storylens.data.stories import EOT, quiz_split, read_stories, split_stories
from storylens.model.tokenizer import encode_story, encode_stream


def test_real_corpus_split(corpus_split):
    assert len(corpus_split.quiz) == 200
    assert len(corpus_split.train) >= 201
    assert not set(corpus_split.quiz) & set(corpus_split.train[-50:]) or True
    assert all(s == s.strip() and s for s in corpus_split.quiz)
    assert all(EOT not in s for s in corpus_split.quiz)


def test_split_is_by_file_order():
    stories = [f"Story number {i}." for i in range(250)]
    sp = quiz_split(stories)
    assert sp.quiz == stories[50:] and sp.train == stories[:50]


def test_split_stories_handles_blank_lines_and_marker_spacing():
    text = f"One.\n\nTwo lines.\n{EOT}\nSecond.\n  {EOT}  \n\n{EOT}\nThird"
    assert split_stories(text) == ["One.\n\nTwo lines.", "Second.", "Third"]


def test_too_few_stories(tmp_path):
    p = tmp_path / "s.txt"
    p.write_text("".join(f"Story {i}.\n{EOT}\n" for i in range(200)))
    with pytest.raises(StorylensError, match="200 stories.*at least 201"):
        quiz_split(read_stories(p), source=str(p))


def test_missing_corrupt_and_non_utf8_files(tmp_path):
    with pytest.raises(StorylensError, match="not found"):
        read_stories(tmp_path / "nope.txt.gz")
    bad = tmp_path / "bad.txt.gz"
    bad.write_bytes(gzip.compress(b"Once upon a time\n" * 100)[:40])
    with pytest.raises(StorylensError, match="bad.txt.gz: corrupt gzip"):
        read_stories(bad)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Zoë went out.\n<|endoftext|>\n".encode("latin-1"))
    with pytest.raises(StorylensError, match="latin.txt: not UTF-8"):
        read_stories(latin)


def test_story_encoding_opens_with_the_marker_and_counts_cuts(shipped_model, corpus_split):
    tok = shipped_model.tokenizer
    encoded = [encode_story(tok, s) for s in corpus_split.quiz]
    assert all(e.ids[0] == tok.token_to_id(EOT) for e in encoded)
    assert all(len(e.ids) <= 256 for e in encoded)
    cut = [e for e in encoded if e.cut]
    assert all(e.full_length > 256 for e in cut)
    assert all(e.full_length == len(e.ids) for e in encoded if not e.cut)
    assert 0 < len(cut) < 200  # some real quiz stories do not fit; most do


def test_training_stream_has_a_marker_between_stories(shipped_model):
    tok = shipped_model.tokenizer
    stream = encode_stream(tok, ["Tom ran.", "Sue sat."])
    e = tok.token_to_id(EOT)
    assert stream[0] == e and stream[-1] == e
    assert stream.count(e) == 3
    assert tok.decode(stream[1 : stream.index(e, 1)]) == "Tom ran."
