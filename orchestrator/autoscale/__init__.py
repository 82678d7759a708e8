"""Autoscaling through Ray Serve's own autoscaler: what each engine host reports
(``load_meter``), the policy Serve calls for each pool (``serve_policy``), and the Serve
options that turn it on (``options``). The decision itself is ``policies.autoscale``;
docs/autoscaling.md."""
