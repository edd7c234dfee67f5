"""The head table, where the two questions meet: every head's row of looking columns and (with ``causal``)
effect columns, streamed by one accumulator (``accumulator``) and read back (``scores``); the truth table,
which puts what the strongest heads of each detector look at beside what switching them off costs
(``truth``); the lesson's name-head ablation (``name_ablation``); a run's model and stories (``run_info``)."""
