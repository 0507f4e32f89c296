"""Grounding: data and box conventions (`data`), MedLoc-R1 with its IoU curriculum (`medloc`, `curriculum`) and
GeoViS with its zoom environment, views and tree search (`geovis`, `geovis_env`, `geovis_views`,
`geovis_search`). ``python -m pipelines.grounding convert|check ...`` is ``mmalign grounding``."""
