"""fw's standard output parsers: tool calls (one module per model family's format) and ``<think>`` reasoning."""
