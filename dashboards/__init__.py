"""Grafana dashboards over the metrics of the predictor service and the gateway, written from code.

`definitions` holds both dashboards panel by panel and `grafana` turns them into Grafana's JSON; the JSON files
beside this module (`leadtime-predictor.json`, `leadtime-router.json`) are written from them by
`leadtime dashboards build` and ship with the package. `promql` reads the queries back as Prometheus evaluates
them, `render` draws the main panels from a Prometheus with matplotlib. Nothing else of Leadtime's imports this
package but the CLI, tests and bench.
"""
