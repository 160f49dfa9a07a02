"""The OpenAI-compatible HTTP server: ``app`` routes, ``serving`` builds and runs requests on the
engine, ``responses`` holds the wire format, ``protocol`` the request bodies, ``metrics`` the
Prometheus metrics."""
