"""What heads do: every head's effect on the loss or a task's metric. Attribution patching and direct logit
attribution streamed from the gradient pass (``attribution``), heads switched off exactly (``ablation``),
every head's exact effect over stories at a fraction of a forward pass each (``exact``), their cost counted
before they run (``cost``), the estimate audited against exact ablation (``audit``), and
activation patching on clean/corrupt pairs (``patching``). Fed by :mod:`storylens.engine`; never imports
:mod:`storylens.looking`."""
