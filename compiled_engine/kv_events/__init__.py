"""KV cache events for routers: what the radix cache stores and evicts, published over ZMQ in vLLM's
wire format (`--kv-events-config`)."""
