"""What runs in the user's process, with no vLLM imports: the capture session every front end
shares, request streams, the probe and steering sets, the server's response fields.
``probehook.adapter.frontend`` and ``probehook.adapter.server`` wrap vLLM's front ends around
them."""
