"""LoRA adapters on one base model: each request names its own, all of them batched together.

`request.py` names an adapter (vLLM's `LoRARequest`); `peft.py` and `gguf.py` read the two file
formats into `AdapterWeights`; `slots.py` holds the device's adapter slots in the model's linears
(the kernels add each token's adapter delta: `kernels.ops.lora_delta`); `registry.py` keeps the
adapters the server knows, their weights on the host, and loads the slots the ledger asks for
(`scheduler/adapter_slots.py` decides which adapter goes where)."""
