"""From the engines' outboxes and the gateway's logs to the lake: decoding segments, ingesting
them once, the request context and DCGM scrapes."""
