"""Names, main characters and their token positions, on hand-built cases."""

from storylens.data.names import (
    MainCharacter,
    find_main_characters,
    is_capitalised,
    main_character,
    name_mentions,
    name_vocabulary,
    pick_main_character,
    token_positions,
)
from storylens.model.tokenizer import encode_story

# "Lily's dog met Zorba. Zorba's hat." tokenised by hand, byte-level style:
# a leading space belongs to the next word; "'s" is its own token; "Zorba" is two tokens.
TEXT = "Lily's dog met Zorba. Zorba's hat."
OFFSETS = [
    (0, 4),  # Lily            -> position 1
    (4, 6),  # 's              -> 2
    (6, 10),  # " dog"         -> 3
    (10, 14),  # " met"        -> 4
    (14, 18),  # " Zor"        -> 5
    (18, 20),  # "ba"          -> 6
    (20, 21),  # "."           -> 7
    (21, 25),  # " Zor"        -> 8
    (25, 27),  # "ba"          -> 9
    (27, 29),  # "'s"          -> 10
    (29, 33),  # " hat"        -> 11
    (33, 34),  # "."           -> 12
]


def test_hand_offsets_match_text():
    pieces = [TEXT[a:b] for a, b in OFFSETS]
    assert "".join(pieces) == TEXT
    assert pieces[4] == " Zor" and pieces[9] == "'s"


def test_words_stop_at_apostrophes_so_possessive_is_not_part_of_name():
    names = frozenset({"Lily", "Zorba"})
    m = name_mentions(TEXT, names)
    assert m == {"Lily": [(0, 4)], "Zorba": [(15, 20), (22, 27)]}
    curly = name_mentions("Tim’s cap", frozenset({"Tim"}))
    assert curly == {"Tim": [(0, 3)]}


def test_positions_multi_token_name_with_leading_space_and_possessive():
    # " Zor" (14,18) overlaps Zorba at 15..20 through its letters; "'s" (27,29) does not.
    assert token_positions(OFFSETS, [(15, 20), (22, 27)], window=256) == [5, 6, 8, 9]


def test_positions_name_at_story_start_without_space():
    assert token_positions(OFFSETS, [(0, 4)], window=256) == [1]


def test_positions_cut_by_the_window():
    spans = [(15, 20), (22, 27)]
    assert token_positions(OFFSETS, spans, window=9) == [5, 6, 8]  # second mention cut mid-name
    assert token_positions(OFFSETS, spans, window=6) == [5]  # first mention cut mid-name
    assert token_positions(OFFSETS, spans, window=5) == []


def test_token_merging_name_and_possessive_counts_but_lone_space_does_not():
    text = "Hi  Lily's"
    offsets = [(0, 2), (2, 3), (3, 8), (8, 10)]  # "Hi", " ", " Lily", "'s"
    assert token_positions(offsets, [(4, 8)], window=256) == [3]
    merged = [(0, 2), (2, 3), (3, 10)]  # " Lily's" as one token
    assert token_positions(merged, [(4, 8)], window=256) == [3]
    assert text[4:8] == "Lily"


def test_main_character_is_most_mentioned_name_with_two_mentions():
    mc = main_character(TEXT, OFFSETS, frozenset({"Lily", "Zorba"}), window=256)
    assert mc == MainCharacter(
        name="Zorba", mentions=2, spans=((15, 20), (22, 27)), positions=(5, 6, 8, 9), first_mention=5
    )


def test_single_mention_is_not_a_main_character():
    assert main_character(TEXT, OFFSETS, frozenset({"Lily"}), window=256) is None
    assert pick_main_character({"Ann": [(0, 3)]}) is None


def test_tie_goes_to_earliest_first_mention():
    mentions = {"Tim": [(10, 13), (30, 33)], "Sam": [(0, 3), (40, 43)]}
    assert pick_main_character(mentions) == "Sam"
    mentions = {"Tim": [(10, 13), (30, 33), (50, 53)], "Sam": [(0, 3), (40, 43)]}
    assert pick_main_character(mentions) == "Tim"  # frequency first


def test_window_cutting_every_mention_keeps_the_character_without_positions():
    mc = main_character(TEXT, OFFSETS, frozenset({"Zorba"}), window=5)
    assert mc.name == "Zorba" and mc.mentions == 2
    assert mc.positions == () and mc.first_mention is None


def test_capitalised_words():
    assert is_capitalised("Lily") and is_capitalised("Tim")
    for w in ("lily", "I", "OK", "TV", "McDonald"):
        assert not is_capitalised(w)


def test_name_vocabulary_over_the_whole_set():
    stories = [
        "Lily saw a lily. Tim ran. Rose smiled.",
        "She said she likes Tim. I am OK. Once the sun rose.",
    ]
    names = name_vocabulary(stories)
    assert "Tim" in names and "Once" in names
    assert "Lily" not in names  # "lily" is written in lower case
    assert "Rose" not in names  # "rose" only in the other story: the whole set counts
    assert "She" not in names and "I" not in names and "OK" not in names


def test_real_tokenizer_multi_token_name_at_start_and_possessive(shipped_model):
    tok = shipped_model.tokenizer
    story = "Zorbalina had a hat. Zorbalina's hat was red. Then Zorbalina smiled."
    (mc,) = find_main_characters(tok, [story], window=256)
    assert mc.name == "Zorbalina" and mc.mentions == 3
    ids = encode_story(tok, story, 256).ids
    assert mc.first_mention == 1  # the story opens with the name; the marker is 0
    # group the positions into runs of consecutive tokens, one run per mention
    runs, run = [], [mc.positions[0]]
    for p in mc.positions[1:]:
        if p == run[-1] + 1:
            run.append(p)
        else:
            runs.append(run)
            run = [p]
    runs.append(run)
    assert len(runs) == 3
    assert all(len(r) > 1 for r in runs)  # a made-up name is several tokens
    for r in runs:
        assert tok.decode([ids[p] for p in r]).strip() == "Zorbalina"
    # the token after the second mention is the possessive, left out
    assert tok.decode([ids[runs[1][-1] + 1]]).startswith("'")


def test_real_tokenizer_window_cut(shipped_model):
    tok = shipped_model.tokenizer
    story = "Bo ran. " + "The dog ran. " * 100 + "Bo sat."
    names = frozenset({"Bo"})
    (full,) = find_main_characters(tok, [story], names=names, window=10_000)
    (cut,) = find_main_characters(tok, [story], names=names, window=256)
    assert full.name == cut.name == "Bo" and cut.mentions == 2
    assert any(p >= 256 for p in full.positions)  # the second mention lies past the window
    assert cut.positions == tuple(p for p in full.positions if p < 256)
    assert cut.first_mention == full.first_mention == 1


def test_real_quiz_names_are_never_written_in_lower_case(corpus_split):
    import re

    names = name_vocabulary(corpus_split.quiz)
    lower = {w for s in corpus_split.quiz for w in re.findall(r"[^\W\d_]+", s) if w.islower()}
    assert names and all(is_capitalised(n) and n.lower() not in lower for n in names)
    assert "She" not in names and "The" not in names
