"""Where heads look: the detectors (pure functions of ``[batch, head, query, key]`` maps, ``patterns`` and
``reads`` their arithmetic), norm weighting (``faithful``), sinks and dormant heads, position and pronoun
controls, the induction test, and each head's top examples. Fed by :mod:`storylens.engine`; never imports
:mod:`storylens.effects`."""
