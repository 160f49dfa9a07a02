"""The serving engine: requests, KV blocks, scheduling and the step loop."""
