"""What the server tells about itself: Prometheus metrics, log formats and request lines,
request ids, and startup timings."""
