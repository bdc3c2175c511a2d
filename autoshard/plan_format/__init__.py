"""The plan file format: a plan as data (``model``), written and read as checked JSON (``files``),
and whether a plan fits a model's graph today (``fits``).

Below the passes, so that the ``load-partition`` pass reads plan files; making a plan from a run
(``autoshard.plan_origin``) and rebuilding stages from one (``autoshard.plan_io``) need the passes
and sit above them. ``autoshard.plan_io`` re-exports their public names.
"""
