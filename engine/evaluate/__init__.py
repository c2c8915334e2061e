"""Measuring a model: validation loss, log-likelihood scoring and bits per byte, in-run multiple-choice tasks,
text generation, and the tokenizer those read text with."""
