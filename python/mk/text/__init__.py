"""Text: the tokenizer and its files, incremental detokenization, tool-call parsing and token healing."""
