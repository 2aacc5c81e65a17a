"""The adapter's server side: ``probehook serve``, vLLM's OpenAI-compatible server with
probehook's handlers (completions and chat, pooling routes)."""
