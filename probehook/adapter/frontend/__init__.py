"""The adapter's front-end side: code that runs in the user's process and touches vLLM's
offline ``LLM``, ``AsyncLLM``, engine configuration, output classes and IO Processor plugins."""
