"""The adapter's worker side: code that runs in vLLM's worker process and touches vLLM's model
loader, model runner, worker RPC and logits processors."""
