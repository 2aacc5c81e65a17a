"""What runs inside vLLM's worker process, with no vLLM imports: the tap and steering ops, the
step recorder, the probe bank and the steering bank. ``probehook.adapter.worker`` feeds them
vLLM's tensors and batch metadata."""
