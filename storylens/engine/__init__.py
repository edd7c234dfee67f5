"""The recording engine, below both questions: stories encoded once and batched (``encode``), the one
recording pass that hands every measure :class:`~storylens.engine.record.Chunk`\\ s of each block's map
(``record``), the gradient pass (``gradients``), what a chunk carries besides the map (``masks``: the
batch's query masks and key sets; ``images``: what each key's value writes), and the statistics every
measure streams (``accumulate``: mergeable float64 means; ``ranks``: rank correlation)."""
