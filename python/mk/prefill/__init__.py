"""The packed prefill of the engine on a GPU (`packed`: prompts packed into one pass, flex attention and
grouped-GEMM experts) and its CUDA-graph replays of fresh prompts and of chunks after a cached prefix
(`graphs`)."""
