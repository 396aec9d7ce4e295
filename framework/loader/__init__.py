"""Finding a model (local path or Hugging Face), reading its format, and loading its weights."""
