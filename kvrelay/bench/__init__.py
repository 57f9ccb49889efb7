"""`kvrelay bench`: a serving benchmark client for any OpenAI-compatible server.

It imports nothing of the server: `config` (flags), `workload` (seeded requests),
`client` (one streamed request, timed), `metrics` (percentiles, goodput), `report`
(tables, the JSON result, plots) and `run` (rounds, `--compare`, `--spawn`).
"""
