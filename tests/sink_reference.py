"""The sink and context columns (storylens.looking.sinks) written out plainly, story by story, from
each block's attention probabilities and value vectors through the output projection: the
reference the tests hold storylens's streamed, merged sums to."""

import torch

from storylens.looking.sinks import ACTIVE_SHARE, SINK_THRESHOLD


def sink_columns(stories: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> dict[str, dict]:
    """``stories``: per story, per block, ``a [head, T, T]`` (probabilities) and ``f [head, T, d_model]``
    (each key's value through the head's slice of the output projection), float64. Returns
    ``{column: {(layer, head): value}}``."""
    n_layer = len(stories[0][0])
    out: dict[str, dict] = {}
    for layer in range(n_layer):
        outputs, per_story = [], []
        for atts, fs in stories:
            a, f = atts[layer].to(torch.float64), fs[layer].to(torch.float64)
            o = torch.einsum("hqk,hke->hqe", a, f)[:, 1:]  # [head, T - 1, d_model]: queries q >= 1
            outputs.append(o)
            norms = f.norm(dim=-1)  # [head, key]
            spread = ((o - o.mean(1, keepdim=True)) ** 2).sum(-1).mean(1)
            power = (o**2).sum(-1).mean(1)
            per_story.append((a[:, 1:, 0].mean(-1), norms[:, 0] / norms[:, 1:].mean(-1), spread / power))
        every = torch.cat(outputs, 1)  # [head, all queries, d_model]
        var = ((every - every.mean(1, keepdim=True)) ** 2).sum(-1).mean(1)
        power = (every**2).sum(-1).mean(1)
        first, ratio, share = (torch.stack(x) for x in zip(*per_story))  # [stories, head]
        cols = {
            "context_share": var / power,
            "context_norm": var.sqrt(),
            "sink_rate": (first > SINK_THRESHOLD).double().mean(0),
            "first_value_ratio": ratio.mean(0),
            "active_rate": (share > ACTIVE_SHARE).double().mean(0),
        }
        for name, values in cols.items():
            for h, v in enumerate(values.tolist()):
                out.setdefault(name, {})[(layer, h)] = v
    return out


def assert_sink_columns(got, stories, rel: float = 1e-9) -> int:
    """Every sink column of ``got`` (a HeadScores) equals :func:`sink_columns` of ``stories`` within
    ``rel`` (relative to the value, at least 1); returns how many values were checked."""
    checked = 0
    for name, heads in sink_columns(stories).items():
        for (layer, h), want in heads.items():
            have = got.heads[layer * got.n_head + h][name]
            assert have is not None and abs(have - want) <= rel * max(1.0, abs(want)), (name, layer, h, have, want)
            checked += 1
    return checked
