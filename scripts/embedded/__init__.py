"""The embedded model's training recipe (run by scripts/train_embedded.py), one module per stage:

- corpus: the source files' split into training, validation and held-out files, and the test functions;
- documents: raw files, function documents, chat examples and tool-call conversations;
- tokens: the tokenizer, the encoded documents and the training token stream;
- training: the training loop, its batches, loss and optimizer step, and stream losses;
- evaluation: greedy generation, the completion, chat and tool-call rates, the reference-model checks;
- unlikelihood: the loop rules and the unlikelihood fine-tuning phase;
- outputs: the shipped checkpoint, what the device machine can return, the plot and the table.
"""
