"""The JSON Schemas of what a run writes (package data): heads.json, examples.json and the two
summary.json kinds (``storylens score`` and ``report``). Read them with
:func:`storylens.core.schema.schema`."""
