"""The JSON Schemas of what a run writes (package data): heads.json, examples.json, the two
summary.json kinds (``storylens score`` and ``report``) and patch.json (``storylens patch``). Read them with
:func:`storylens.core.schema.schema`."""
