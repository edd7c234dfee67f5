"""How heads work together: the model's graph of edges scored on a task (``edges``), circuits of the top edges
run exactly with their faithfulness (``faithfulness``), the scores audited edge by edge (``oracle``) and the
circuit found again on resamples (``stability``); ``run``: ``storylens circuit``'s whole run and its files."""
